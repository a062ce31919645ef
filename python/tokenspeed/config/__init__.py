"""`tokenspeed serve` configuration: the flag table, argument parsing, and `ServeConfig`.

    from tokenspeed.config import parse_serve_args, ConfigError, NotSupportedError
    cfg = parse_serve_args(["SmolLM2-135M-Instruct", "--max-model-len", "4096"])
    cfg.server_dict()  # for the Rust core
    cfg.worker_dict()  # for the Python worker

Imports nothing heavy (no torch), so `tokenspeed serve --help` stays fast.
"""

from tokenspeed.config.errors import ConfigError, NotSupportedError
from tokenspeed.config.flag import GROUPS, Flag
from tokenspeed.config.parser import (
    build_serve_parser,
    config_from_kwargs,
    load_serve_config,
    parse_serve_args,
)
from tokenspeed.config.serve_config import ServeConfig
from tokenspeed.config.table import BY_DEST, BY_SPELLING, FLAGS, counts, lookup
from tokenspeed.config.table_core import DEFAULT_MODEL

__all__ = [
    "BY_DEST",
    "BY_SPELLING",
    "DEFAULT_MODEL",
    "FLAGS",
    "GROUPS",
    "ConfigError",
    "Flag",
    "NotSupportedError",
    "ServeConfig",
    "build_serve_parser",
    "config_from_kwargs",
    "counts",
    "load_serve_config",
    "lookup",
    "parse_serve_args",
]
