"""The `Flag` record: one row of the `tokenspeed serve` flag table.

Every command-line flag (and every `--config` YAML key) is described by exactly one `Flag`.
The table itself lives in the `table_*.py` modules; `FLAGS` in `table.py` joins them.
No torch here: the CLI imports this on every start.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Literal

Kind = Literal["str", "int", "float", "bool", "json", "list"]
# Who reads a setting; each reader's config is derived from the flags that name it:
#   server     the Rust core's front end and engine loop (ServerConfig, rust/server/src/config.rs)
#   scheduler  the Rust scheduler (SchedulerConfig, rust/engine/src/scheduler/request.rs): sent
#              as ServerConfig's `scheduler` section, field names = flag dests
#   worker     the Python worker (WorkerSpec.settings)
#   launch     only the launcher (`tokenspeed serve` in Python: `--config`, `--dry-run`, the
#              parallel layout, values it derives and hands on in another form)
# The `server` and `scheduler` sections are exact: Rust refuses a missing or unknown field.
Reader = Literal["server", "scheduler", "worker", "launch"]

READERS: tuple[str, ...] = ("server", "scheduler", "worker", "launch")

# Help groups, in the order `tokenspeed serve --help` prints them.
G_MODEL = "Model and tokenizer"
G_HTTP = "HTTP server"
G_API = "API related"
G_QUANT = "Quantization and data type"
G_MEMORY = "Memory and scheduling"
G_RUNTIME = "Runtime options"
G_PARALLEL = "Parallelism"
G_MULTINODE = "Multi-node distributed serving"
G_EP = "Expert parallelism (MoE)"
G_LOGGING = "Logging and metrics"
G_OVERRIDE = "Model override args"
G_LORA = "LoRA"
G_KERNEL = "Kernel backends"
G_SPEC = "Speculative decoding"
G_NGRAM = "Ngram speculative decoding"
G_HICACHE = "Hierarchical cache and KV store"
G_MAMBA = "Mamba cache"
G_SPARSITY = "Double sparsity"
G_OFFLOAD = "Offloading"
G_OPT = "Optimization and debugging"
G_DUMP = "Debug tensor dumps and tokenizer batching"
G_PD = "PD disaggregation"
G_LOADER = "Custom weight loading"
G_MISC = "Other features"
G_DEPRECATED = "Deprecated SGLang arguments"
G_LAUNCH = "Launcher"

GROUPS: tuple[str, ...] = (
    G_MODEL,
    G_HTTP,
    G_API,
    G_QUANT,
    G_MEMORY,
    G_RUNTIME,
    G_PARALLEL,
    G_MULTINODE,
    G_EP,
    G_LOGGING,
    G_OVERRIDE,
    G_LORA,
    G_KERNEL,
    G_SPEC,
    G_NGRAM,
    G_HICACHE,
    G_MAMBA,
    G_SPARSITY,
    G_OFFLOAD,
    G_OPT,
    G_DUMP,
    G_PD,
    G_LOADER,
    G_MISC,
    G_DEPRECATED,
    G_LAUNCH,
)


@dataclass(frozen=True)
class Flag:
    """One setting. `name` is the canonical spelling; `aliases` set the same value and
    `negated` (bool flags only) set the opposite value. `implemented=False` means the flag is
    parsed and validated, but any value other than `default` is refused as "not supported yet".
    For implemented flags, `supported` (a subset of `choices`) and `max_supported` narrow which
    values work today; the rest of the valid values are also "not supported yet". `refusals`
    gives a refused value its own reason (what it would need, and what to use instead), said in
    place of the generic "not available yet"."""

    name: str
    help: str
    group: str
    kind: Kind = "str"
    default: Any = None
    aliases: tuple[str, ...] = ()
    negated: tuple[str, ...] = ()
    choices: tuple[Any, ...] | None = None
    supported: tuple[Any, ...] | None = None
    value_aliases: dict[str, str] = field(default_factory=dict)
    casefold: bool = False
    item: Kind = "str"
    nargs: str = "+"
    minimum: float | None = None
    maximum: float | None = None
    min_exclusive: bool = False
    allowed_special: tuple[Any, ...] = ()
    max_supported: float | None = None
    unsupported_values: tuple[Any, ...] = ()
    refusals: dict[Any, str] = field(default_factory=dict)
    takes_value: bool = False
    readers: tuple[Reader, ...] = ("server",)
    json_type: type | None = None  # a JSON flag's document must be this (dict: an object)
    implemented: bool = False
    dest: str = ""
    metavar: str | None = None

    def __post_init__(self) -> None:
        if not self.dest:
            object.__setattr__(self, "dest", self.name.lstrip("-").replace("-", "_"))
        if self.negated and self.kind != "bool":
            raise ValueError(f"{self.name}: only bool flags can have negated spellings")
        if not self.readers or not set(self.readers) <= set(READERS):
            raise ValueError(f"{self.name}: readers must be some of {READERS}, got {self.readers!r}")
        if self.group not in GROUPS:
            raise ValueError(f"{self.name}: unknown help group {self.group!r}")
        if self.choices is not None and not set(self.refusals) <= set(self.choices):
            raise ValueError(f"{self.name}: a refusal names a value that is not a choice")

    @property
    def spellings(self) -> tuple[str, ...]:
        return (self.name, *self.aliases, *self.negated)

    @property
    def what(self) -> str:
        """A short phrase saying what the flag does: the first sentence of its help."""
        first = self.help.split(". ")[0].strip().rstrip(".")
        return first[:1].lower() + first[1:] if first[:2] != first[:2].upper() else first

    # ---- value conversion and checks -------------------------------------------------

    def convert(self, raw: Any) -> Any:
        """Turn one command-line string (or YAML value) into a typed value, or raise
        ValueError with a message that does not yet name the flag."""
        if self.kind == "bool":
            return _to_bool(raw)
        if self.kind == "list":
            items = raw if isinstance(raw, list) else [raw]
            if self.item in ("int", "float"):  # numbers may also be given as "1,2,4"
                items = [y for x in items for y in _split_list(x)]
            return [self._convert_scalar(self.item, x) for x in items]
        if self.kind == "json":
            return _to_json(raw)
        return self._convert_scalar(self.kind, raw)

    def _convert_scalar(self, kind: Kind, raw: Any) -> Any:
        if kind == "int":
            return _to_int(raw)
        if kind == "float":
            return _to_float(raw)
        if isinstance(raw, bool) or not isinstance(raw, (str, int, float)):
            raise BadValue(f"expected a string, got {_show(raw)}")
        text = str(raw)
        if self.casefold:
            text = text.lower()
        return self.value_aliases.get(text, text)

    def check(self, value: Any) -> None:
        """Range and choice checks on a converted value; raises ValueError."""
        if value is None or value in self.allowed_special:
            return
        if self.json_type is not None and not isinstance(value, self.json_type):
            shape = {dict: "object", list: "array"}.get(self.json_type, self.json_type.__name__)
            raise BadValue(f"expected a JSON {shape}, got {_show(value)}")
        values = value if self.kind == "list" else [value]
        for v in values:
            if self.choices is not None and v not in self.choices:
                raise BadValue(f"invalid choice {_show(v)} (choose from {', '.join(self.choices)})")
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                self._check_range(v)

    def _check_range(self, v: float) -> None:
        lo, hi = self.minimum, self.maximum
        if lo is not None and (v < lo or (self.min_exclusive and v == lo)):
            bound = f"greater than {_num(lo)}" if self.min_exclusive else f"at least {_num(lo)}"
            extra = (
                f" or one of {', '.join(map(_show, self.allowed_special))}" if self.allowed_special else ""
            )
            raise BadValue(f"must be {bound}{extra}, got {_num(v)}")
        if hi is not None and v > hi:
            raise BadValue(f"must be at most {_num(hi)}, got {_num(v)}")

    def unsupported_detail(self, value: Any) -> str | None:
        """None if `value` works today. Otherwise "" (the whole feature is missing) or a note
        on which values are missing, for the "not supported yet" message."""
        if value == self.default or (self.default is None and value in ([], {})):
            return None
        values = value if isinstance(value, list) else [value]
        for v in values:
            if isinstance(v, (str, int, float)) and v in self.refusals:
                why = self.refusals[v]
                return why if self.kind == "bool" else f"{_show(v)} is not built into TokenSpeed: {why}"
        if not self.implemented:
            return ""
        if value in self.unsupported_values:
            return f"the value {_show(value)} is not available yet"
        if self.supported is not None:
            bad = [v for v in values if v not in self.supported]
            if bad:
                avail = ", ".join(map(str, self.supported))
                return f"{_show(bad[0])} is not available yet; available now: {avail}"
        top = self.max_supported
        if top is not None and isinstance(value, (int, float)) and value > top:
            return f"{_num(value)} is not available yet; only up to {_num(top)} for now"
        return None

    def default_text(self) -> str:
        if self.default is None:
            return "none"
        if isinstance(self.default, bool):
            return "on" if self.default else "off"
        return json.dumps(self.default) if self.kind == "json" else str(self.default)


# ---- scalar converters -------------------------------------------------------------------


class BadValue(ValueError):
    """A value that does not fit the flag; the message does not yet name the flag."""


def _show(v: Any) -> str:
    return repr(v) if isinstance(v, str) else json.dumps(v) if isinstance(v, (bool, type(None))) else str(v)


def _num(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else str(v)


def _to_int(raw: Any) -> int:
    if isinstance(raw, bool):
        raise BadValue(f"expected an integer, got {_show(raw)}")
    if isinstance(raw, int):
        return raw
    if isinstance(raw, float) and raw.is_integer():
        return int(raw)
    if isinstance(raw, str):
        try:
            return int(raw.strip().replace("_", ""), 10)
        except ValueError:
            pass
    raise BadValue(f"expected an integer, got {_show(raw)}")


def _to_float(raw: Any) -> float:
    if isinstance(raw, bool):
        raise BadValue(f"expected a number, got {_show(raw)}")
    if isinstance(raw, (int, float)):
        value = float(raw)
    elif isinstance(raw, str):
        try:
            value = float(raw.strip())
        except ValueError:
            raise BadValue(f"expected a number, got {_show(raw)}") from None
    else:
        raise BadValue(f"expected a number, got {_show(raw)}")
    if not math.isfinite(value):
        raise BadValue(f"expected a finite number, got {_show(raw)}")
    return value


_TRUE = {"true", "yes", "on", "1"}
_FALSE = {"false", "no", "off", "0"}


def _to_bool(raw: Any) -> bool:
    if isinstance(raw, bool):
        return raw
    if isinstance(raw, str) and raw.strip().lower() in _TRUE | _FALSE:
        return raw.strip().lower() in _TRUE
    raise BadValue(f"expected true or false, got {_show(raw)}")


def _to_json(raw: Any) -> Any:
    if isinstance(raw, (dict, list)):
        return raw
    if not isinstance(raw, str):
        raise BadValue(f"expected a JSON string, got {_show(raw)}")
    try:
        return json.loads(raw)
    except json.JSONDecodeError as e:
        raise BadValue(f"invalid JSON ({e.msg} at position {e.pos})") from None


def _split_list(raw: Any) -> list[Any]:
    if isinstance(raw, str):
        return [x for x in raw.replace(",", " ").split() if x]
    return [raw]


# ---- compact constructors used by the table modules -------------------------------------


def b(name: str, help: str, group: str, **kw: Any) -> Flag:
    """A switch: present means true."""
    kw.setdefault("default", False)
    return Flag(name, help, group, kind="bool", **kw)


def i(name: str, help: str, group: str, default: int | None = None, **kw: Any) -> Flag:
    return Flag(name, help, group, kind="int", default=default, **kw)


def f(name: str, help: str, group: str, default: float | None = None, **kw: Any) -> Flag:
    return Flag(name, help, group, kind="float", default=default, **kw)


def s(name: str, help: str, group: str, default: str | None = None, **kw: Any) -> Flag:
    return Flag(name, help, group, kind="str", default=default, **kw)


def c(name: str, help: str, group: str, choices: tuple[Any, ...], default: Any = None, **kw: Any) -> Flag:
    """A value from a fixed set."""
    kind = "int" if all(isinstance(x, int) for x in choices) else "str"
    return Flag(name, help, group, kind=kind, default=default, choices=choices, **kw)


def j(name: str, help: str, group: str, **kw: Any) -> Flag:
    """A JSON document given as a string (or as a mapping/list in the YAML file)."""
    return Flag(name, help, group, kind="json", metavar="JSON", **kw)


def lst(name: str, help: str, group: str, item: Kind = "str", **kw: Any) -> Flag:
    """One or more values (space- or comma-separated; a list in the YAML file)."""
    return Flag(name, help, group, kind="list", item=item, **kw)
