"""Command line + `--config` YAML  ->  `ServeConfig`.

Order of work:
  1. argparse reads the command line; every flag records (spelling, typed value).
  2. `--config FILE` (if any) is read the same way; its keys are flag names without dashes.
  3. Two different spellings of one setting in the same source are an error naming both.
     The command line overrides the file.
  4. Values are checked (ranges, choices) -> ConfigError naming the flag.
  5. Any value a flag cannot honour yet -> NotSupportedError, one line per flag:
     `not supported yet: --flag (what it does)`.
"""

from __future__ import annotations

import argparse
import difflib
import shutil
import sys
import textwrap
from dataclasses import dataclass, fields
from typing import Any, NoReturn

from tokenspeed.config.deterministic import check_deterministic
from tokenspeed.config.errors import ConfigError, NotSupportedError
from tokenspeed.config.flag import GROUPS, Flag
from tokenspeed.config.kv_events import resolve_kv_events
from tokenspeed.config.serve_config import ServeConfig
from tokenspeed.config.speculative import resolve_speculative
from tokenspeed.config.table import (
    BY_DEST,
    BY_SPELLING,
    FLAGS,
    MODEL_DEST,
    POSITIONAL_MODEL,
    lookup,
)

_SEEN = "_tokenspeed_seen"
_CONFIG_FIELDS = frozenset(f.name for f in fields(ServeConfig))

DESCRIPTION = """\
Start an OpenAI-compatible server for one model.

Flag names follow vLLM and SGLang where the meaning is the same, so existing launch commands
mostly carry over; several spellings of one setting (e.g. --max-model-len / --context-length)
are listed together, and giving two of them at once is an error. Flags marked [not supported
yet] are recognised, but asking for anything other than their default stops the launch with
a message instead of being silently ignored."""


@dataclass
class _Given:
    """One value the user supplied, and how (for error messages)."""

    spelling: str  # "--max-model-len", "positional model", or "max-model-len" from the file
    value: Any
    where: str = ""  # "" for the command line, else " (in FILE)"

    @property
    def label(self) -> str:
        if self.spelling == POSITIONAL_MODEL:
            return POSITIONAL_MODEL
        return "--" + self.spelling.lstrip("-") + self.where


class _ArgumentParser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise ConfigError(message)


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Wider help, and never wraps inside a --flag-name."""

    def __init__(self, prog: str) -> None:
        width = min(110, shutil.get_terminal_size((100, 24)).columns) - 2
        super().__init__(prog, max_help_position=34, width=width)

    def _split_lines(self, text: str, width: int) -> list[str]:
        text = " ".join(text.split())
        return textwrap.wrap(text, width, break_on_hyphens=False)


class _Record(argparse.Action):
    """Converts the value with the table's rules and records it with its spelling."""

    def __init__(
        self, option_strings: list[str], dest: str, flag: Flag, negate: bool = False, **kwargs: Any
    ) -> None:
        super().__init__(option_strings, dest, **kwargs)
        self.flag = flag
        self.negate = negate

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        spelling = option_string or POSITIONAL_MODEL
        if values is None or values is argparse.SUPPRESS:
            return  # the optional positional model was not given
        flag = self.flag
        try:
            if flag.kind == "bool" and not flag.takes_value:
                value: Any = True
            else:
                value = flag.convert(values)
        except ValueError as e:
            raise ConfigError(f"{spelling}: {e}") from None
        if flag.kind == "bool" and self.negate:
            value = not value
        seen: dict[str, list[_Given]] = getattr(namespace, _SEEN)
        seen.setdefault(flag.dest, []).append(_Given(spelling, value))


def _metavar(flag: Flag) -> str | None:
    if flag.metavar:
        return flag.metavar
    if flag.choices is not None and len(flag.choices) <= 8:
        return "{" + ",".join(map(str, flag.choices)) + "}"
    return {"int": "N", "float": "X", "json": "JSON"}.get(flag.kind, "VALUE")


def _help_text(flag: Flag) -> str:
    parts = [flag.help]
    if flag.default is not None and (flag.kind != "bool" or flag.default):
        parts.append(f"[default: {flag.default_text()}]")
    if flag.choices is not None and len(flag.choices) > 8:
        parts.append(f"[choices: {', '.join(map(str, flag.choices))}]")
    if not flag.implemented:
        parts.append("[not supported yet]")
    return " ".join(parts).replace("%", "%%")


def build_serve_parser(prog: str = "tokenspeed serve") -> argparse.ArgumentParser:
    """The argparse parser behind `tokenspeed serve`, with flags in SGLang-style groups.
    Values are recorded untouched by defaults; `parse_serve_args` does the resolving."""
    parser = _ArgumentParser(
        prog=prog,
        usage=f"{prog} [MODEL] [options]",
        description=DESCRIPTION,
        formatter_class=_HelpFormatter,
        allow_abbrev=False,
        argument_default=argparse.SUPPRESS,
    )
    groups = {name: parser.add_argument_group(name) for name in GROUPS}
    model_flag = BY_DEST[MODEL_DEST]
    groups[model_flag.group].add_argument(
        "model",
        nargs="?",
        default=None,
        action=_Record,
        flag=model_flag,
        metavar="MODEL",
        help="Model to serve, as a positional argument; same as --model-path.",
    )
    for flag in FLAGS:
        group = groups[flag.group]
        positive = (flag.name, *flag.aliases)
        kwargs: dict[str, Any] = {"dest": "_arg_" + flag.dest, "flag": flag, "action": _Record}
        if flag.kind == "bool":
            if flag.takes_value:
                kwargs["metavar"] = "{true,false}"
            else:
                kwargs["nargs"] = 0
        elif flag.kind == "list":
            kwargs["nargs"] = flag.nargs
            kwargs["metavar"] = _metavar(flag)
        else:
            kwargs["metavar"] = _metavar(flag)
        group.add_argument(*positive, help=_help_text(flag), **kwargs)
        if flag.negated:
            negated_help = f"The opposite of {flag.name} (this is the default)."
            group.add_argument(*flag.negated, negate=True, help=negated_help, **kwargs)
    return parser


# ---- the YAML file ------------------------------------------------------------------------


def _find_config_path(seen: dict[str, list[_Given]]) -> str | None:
    given = seen.get("config_file")
    return given[-1].value if given else None


def _read_config_file(path: str) -> dict[str, list[_Given]]:
    import yaml  # imported lazily: most launches have no config file

    try:
        with open(path, encoding="utf-8") as fh:
            data = yaml.safe_load(fh)
    except OSError as e:
        raise ConfigError(f"--config {path}: cannot read the file ({e.strerror})") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"--config {path}: not valid YAML ({e})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"--config {path}: the file must be a mapping of flag names to values, got {type(data).__name__}"
        )
    where = f" (in {path})"
    seen: dict[str, list[_Given]] = {}
    unknown: list[str] = []
    for key, raw in data.items():
        flag = lookup(key) if isinstance(key, str) else None
        if flag is None:
            unknown.append(str(key))
            continue
        name = "--" + str(key).lstrip("-").replace("_", "-")
        if flag.dest == "config_file":
            raise ConfigError(f"--config {path}: a config file cannot name another config file")
        if raw is None:
            continue  # `key:` with no value leaves the default
        try:
            value = flag.convert(raw)
        except ValueError as e:
            raise ConfigError(f"{name}{where}: {e}") from None
        if flag.kind == "bool" and name in flag.negated:
            value = not value
        seen.setdefault(flag.dest, []).append(_Given(name, value, where))
    if unknown:
        lines = [
            f"--config {path}: unknown key{'s' if len(unknown) > 1 else ''}: "
            + ", ".join(repr(k) for k in unknown)
        ]
        for key in unknown:
            hint = _suggest("--" + key.lstrip("-").replace("_", "-"))
            if hint:
                lines.append(f"  {key!r}: did you mean {hint.lstrip('-')!r}?")
        raise ConfigError("\n".join(lines))
    return seen


# ---- resolving ------------------------------------------------------------------------------


def _suggest(spelling: str) -> str | None:
    match = difflib.get_close_matches(spelling, list(BY_SPELLING), n=1, cutoff=0.75)
    return match[0] if match else None


def _check_conflicts(seen: dict[str, list[_Given]]) -> None:
    for dest, given in seen.items():
        labels: list[str] = []
        for g in given:
            if g.label not in labels:
                labels.append(g.label)
        if len(labels) > 1:
            flag = BY_DEST[dest]
            raise ConfigError(
                f"conflicting flags: {labels[0]} and {labels[1]} both set {flag.dest} "
                f"({flag.what}); give only one of them"
            )


def _unrecognized(extras: list[str]) -> ConfigError:
    lines = []
    for arg in extras:
        if arg.startswith("-"):
            hint = _suggest(arg.split("=", 1)[0])
            lines.append(f"unknown flag: {arg}" + (f" (did you mean {hint}?)" if hint else ""))
        else:
            lines.append(f"unexpected argument: {arg!r} (only one positional model is allowed)")
    return ConfigError("\n".join(lines))


def _resolve(cli: dict[str, list[_Given]], file: dict[str, list[_Given]]) -> dict[str, _Given]:
    _check_conflicts(file)
    _check_conflicts(cli)
    chosen: dict[str, _Given] = {}
    for source in (file, cli):  # the command line wins over the file
        for dest, given in source.items():
            chosen[dest] = given[-1]  # a repeated spelling: the last one wins
    return chosen


def _validate(chosen: dict[str, _Given]) -> None:
    errors = []
    for dest, given in chosen.items():
        try:
            BY_DEST[dest].check(given.value)
        except ValueError as e:
            errors.append(f"{given.label}: {e}")
    if errors:
        raise ConfigError("\n".join(errors))


def _check_supported(chosen: dict[str, _Given]) -> None:
    lines = []
    for dest, given in chosen.items():
        flag = BY_DEST[dest]
        detail = flag.unsupported_detail(given.value)
        if detail is None:
            continue
        line = f"not supported yet: {given.label} ({flag.what})"
        lines.append(line + (f": {detail}" if detail else ""))
    if lines:
        raise NotSupportedError(lines)


def _check_traces_endpoint(endpoint: str) -> None:
    """Refuses at once (before workers load) what the Rust core's exporter would refuse at start
    (rust/server/src/otel.rs `traces_url`): only plain OTLP/HTTP."""
    scheme, sep, _ = endpoint.partition("://")
    if sep and scheme != "http":
        raise NotSupportedError([(f"not supported yet: --otlp-traces-endpoint ({endpoint}: {scheme}:// "
                                  "- traces go over OTLP/HTTP without TLS; give host:port or http://host:port)")])


def parse_serve_args(argv: list[str]) -> ServeConfig:
    """Resolve `tokenspeed serve` arguments (everything after `serve`) into a ServeConfig.

    Raises ConfigError for unknown flags, bad values, conflicting spellings and config-file
    problems, and NotSupportedError (a ConfigError) for features not built yet. `--help`
    prints the grouped help and raises SystemExit(0), as argparse does."""
    parser = build_serve_parser()
    namespace = argparse.Namespace(**{_SEEN: {}})
    _, extras = parser.parse_known_args(list(argv), namespace)
    if extras:
        raise _unrecognized(extras)
    cli: dict[str, list[_Given]] = getattr(namespace, _SEEN)
    path = _find_config_path(cli)
    file = _read_config_file(path) if path is not None else {}
    chosen = _resolve(cli, file)
    _validate(chosen)
    _check_supported(chosen)
    # Flags without a ServeConfig field are unimplemented, so they hold their defaults here.
    values = {dest: g.value for dest, g in chosen.items() if dest in _CONFIG_FIELDS}
    if "otlp_traces_endpoint" in values:  # vLLM has no --enable-trace: the endpoint turns it on
        values.setdefault("enable_trace", True)
        _check_traces_endpoint(values["otlp_traces_endpoint"])
    return check_deterministic(resolve_kv_events(resolve_speculative(ServeConfig(**values))))


def load_serve_config(argv: list[str]) -> ServeConfig:
    """CLI wrapper around parse_serve_args: an error is printed to stderr and exits with
    status 2; `--dry-run` prints the resolved configuration as JSON and exits 0."""
    try:
        config = parse_serve_args(argv)
    except ConfigError as e:
        print(f"tokenspeed serve: error: {e.message}", file=sys.stderr)
        raise SystemExit(e.exit_code) from None
    if config.dry_run:
        print(config.to_json())
        raise SystemExit(0)
    return config


def config_from_kwargs(values: dict[str, Any], where: str = "keyword argument") -> ServeConfig:
    """A ServeConfig from Python keyword arguments named by the flags' dests (`model_path`,
    `max_running_requests`, ...; any spelling `lookup` knows, `max_model_len` too): the same
    conversion, checks and "not supported yet" refusals as the command line and `--config`."""
    seen: dict[str, list[_Given]] = {}
    unknown: list[str] = []
    for key, raw in values.items():
        flag = BY_DEST.get(key) or lookup(key)
        if flag is None or flag.dest == "config_file":
            unknown.append(key)
            continue
        if raw is None:
            continue  # None leaves the default
        try:
            value = flag.convert(raw)
        except ValueError as e:
            raise ConfigError(f"{key} ({where}): {e}") from None
        if flag.kind == "bool" and "--" + key.replace("_", "-") in flag.negated:
            value = not value
        seen.setdefault(flag.dest, []).append(_Given(key, value, f" ({where})"))
    if unknown:
        lines = []
        for key in unknown:
            hint = _suggest("--" + key.replace("_", "-"))
            lines.append(f"unknown {where} {key!r}"
                         + (f" (did you mean {hint.lstrip('-').replace('-', '_')!r}?)" if hint else ""))
        raise ConfigError("\n".join(lines))
    chosen = _resolve(seen, {})
    _validate(chosen)
    _check_supported(chosen)
    return check_deterministic(
        ServeConfig(**{dest: g.value for dest, g in chosen.items() if dest in _CONFIG_FIELDS}))
