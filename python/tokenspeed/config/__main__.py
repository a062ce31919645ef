"""`python -m tokenspeed.config [serve args]`: resolve the arguments and print the result as
JSON (like `tokenspeed serve --dry-run`), or print the error and exit 2.

`python -m tokenspeed.config --markdown`: print the flag reference (docs/flags.md) from the flag
table, so the page cannot drift from it (tests/test_flags_doc.py compares the two)."""

from __future__ import annotations

import sys
from typing import Any

from tokenspeed.config.flag import GROUPS, Flag
from tokenspeed.config.parser import load_serve_config
from tokenspeed.config.table import FLAGS, counts

HEADER = """# `tokenspeed serve` flags

Generated from the flag table (`python/tokenspeed/config/table_*.py`) by
`python -m tokenspeed.config --markdown > docs/flags.md`; do not edit by hand
(`tests/test_flags_doc.py` fails when the two differ). Every spelling is also a key of a
`--config` YAML file (without the leading dashes; `_` for `-` works too). `tokenspeed serve --help`
prints the same help, and `tokenspeed serve --dry-run` the resolved configuration. The model may
also be given as the first positional argument (same as `--model-path`).

{flags} flags: {implemented} implemented (below, by help group) and {not_supported} accepted so that
SGLang and vLLM command lines parse, refused at start with `not supported yet` when given a value
other than their default (listed at the end). "Read by" says who consumes the setting: `server`
(the Rust core's HTTP front end and engine loop), `scheduler` (the Rust scheduler), `worker` (the
Python model processes), `launch` (only the launcher: `--config`, `--dry-run`, the parallel
layout, values it derives and hands on in another form).
"""


def _code(values: Any) -> str:
    return ", ".join(f"`{v}`" for v in values)


def _num(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else str(v)


def type_text(flag: Flag) -> str:
    """The value a flag takes: its kind, its choices (those that work today) and its range."""
    if flag.kind == "bool":
        return "switch"
    text = f"list of {flag.item}" if flag.kind == "list" else flag.kind
    if flag.choices is not None:
        now = flag.supported if flag.supported is not None else flag.choices
        text += f": one of {_code(now)}"
        later = [v for v in flag.choices if v not in now]
        if later:
            text += f" (also accepted, not supported yet: {_code(later)})"
    if flag.minimum is not None:
        text += f", {'>' if flag.min_exclusive else '>='} {_num(flag.minimum)}"
    if flag.maximum is not None:
        text += f", <= {_num(flag.maximum)}"
    if flag.allowed_special:
        text += f", or {_code(flag.allowed_special)}"
    if flag.unsupported_values:
        text += f" (not supported yet: {_code(flag.unsupported_values)})"
    if flag.max_supported is not None:
        text += f" (up to {_num(flag.max_supported)} for now)"
    return text


def flag_section(flag: Flag) -> str:
    spellings = _code((flag.name, *flag.aliases))
    if flag.negated:
        spellings += f"; off: {_code(flag.negated)}"
    return (f"### `{flag.name}`\n\n"
            f"- spellings: {spellings}\n"
            f"- type: {type_text(flag)}\n"
            f"- default: `{flag.default_text()}`\n"
            f"- read by: {_code(flag.readers)}\n\n"
            f"{flag.help}\n")


def refused_line(group: str, flags: list[Flag]) -> str:
    """One help group's refused flags on one line, each with its other spellings."""
    names = [f"`{f.name}`" + (f" ({_code(f.aliases + f.negated)})" if f.aliases or f.negated else "")
             for f in flags]
    return f"- **{group}**: " + ", ".join(names)


def flags_markdown() -> str:
    """docs/flags.md: the implemented flags in detail by help group, then the refused ones."""
    parts = [HEADER.format(**counts())]
    for group in GROUPS:
        done = [f for f in FLAGS if f.group == group and f.implemented]
        if done:
            parts.append(f"## {group}\n")
            parts.extend(flag_section(f) for f in done)
    parts.append("## Not supported yet\n\nAny value but the default is refused at start with "
                 "`not supported yet`.\n")
    refused = [refused_line(g, [f for f in FLAGS if f.group == g and not f.implemented])
               for g in GROUPS if any(f.group == g and not f.implemented for f in FLAGS)]
    parts.append("\n".join(refused) + "\n")
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args == ["--markdown"]:
        sys.stdout.write(flags_markdown())
        return 0
    config = load_serve_config(args)
    print(config.to_json())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
