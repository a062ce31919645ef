"""The whole `tokenspeed serve` flag table and lookups over it.

`FLAGS` is the single source of truth for the command line, the `--config` YAML keys,
`--help`, and `ServeConfig`. It is plain Python data, split over the `table_*` modules by
help group; nothing is generated from the seed documents at run time.
"""

from __future__ import annotations

from tokenspeed.config.flag import Flag
from tokenspeed.config.table_core import CORE_FLAGS
from tokenspeed.config.table_debug import DEBUG_TABLE
from tokenspeed.config.table_features import FEATURE_TABLE
from tokenspeed.config.table_parallel import PARALLEL_TABLE

FLAGS: tuple[Flag, ...] = (*CORE_FLAGS, *PARALLEL_TABLE, *FEATURE_TABLE, *DEBUG_TABLE)

# The positional argument is another spelling of --model-path.
POSITIONAL_MODEL = "positional model"
MODEL_DEST = "model_path"


def _index() -> tuple[dict[str, Flag], dict[str, Flag]]:
    by_spelling: dict[str, Flag] = {}
    by_dest: dict[str, Flag] = {}
    for flag in FLAGS:
        if flag.dest in by_dest:
            raise ValueError(f"duplicate setting {flag.dest!r} in the flag table")
        by_dest[flag.dest] = flag
        for spelling in flag.spellings:
            if not spelling.startswith("--") or spelling in by_spelling:
                raise ValueError(f"bad or duplicate spelling {spelling!r} in the flag table")
            by_spelling[spelling] = flag
    return by_spelling, by_dest


BY_SPELLING, BY_DEST = _index()


def lookup(spelling: str) -> Flag | None:
    """The flag for `--name` (or `name`, or `name_with_underscores`), or None."""
    key = spelling.strip()
    key = "--" + key.lstrip("-").replace("_", "-")
    return BY_SPELLING.get(key)


def is_negated(flag: Flag, spelling: str) -> bool:
    return spelling in flag.negated


def counts() -> dict[str, int]:
    """Summary numbers for docs and reports."""
    implemented = sum(f.implemented for f in FLAGS)
    return {
        "flags": len(FLAGS),
        "implemented": implemented,
        "not_supported": len(FLAGS) - implemented,
        "aliases": sum(len(f.aliases) + len(f.negated) for f in FLAGS),
        "spellings": len(BY_SPELLING),
    }
