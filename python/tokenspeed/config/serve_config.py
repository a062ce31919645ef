"""`ServeConfig`: the resolved settings of `tokenspeed serve`.

Generated from the flag table: one field per implemented flag (every other flag must still
hold its default, anything else is refused as "not supported yet", so there is nothing for the
runtime to read), named by the flag's dest, with the table's default. `section(reader)` cuts
what one component reads (the flags whose `readers` name it).
"""

from __future__ import annotations

import json
from dataclasses import asdict, field, make_dataclass
from typing import Any

from tokenspeed.config.flag import Flag
from tokenspeed.config.table import BY_DEST, FLAGS

REDACTED = "<redacted>"


# Python types of the table's value kinds, for the generated fields' annotations.
_TYPES: dict[str, Any] = {"str": str, "int": int, "float": float, "bool": bool, "json": Any, "list": list}


class _Settings:
    """Methods of `ServeConfig`; its fields come from the flag table (below)."""

    def to_dict(self) -> dict[str, Any]:
        """All settings, JSON-ready."""
        return asdict(self)  # type: ignore[call-overload]  (a dataclass once generated)

    def section(self, reader: str) -> dict[str, Any]:
        """The settings `reader` (a `Flag.readers` name: server, scheduler, worker, cli) reads,
        by flag dest: the one place a component's config is cut from the declared table."""
        return {k: v for k, v in self.to_dict().items() if reader in BY_DEST[k].readers}

    def server_dict(self) -> dict[str, Any]:
        """Settings the Rust core reads (its front end and engine loop, and its scheduler)."""
        return self.section("server") | self.section("scheduler")

    def worker_dict(self) -> dict[str, Any]:
        """Settings the Python worker reads."""
        return self.section("worker")

    def to_json(self, redact_secrets: bool = True) -> str:
        """What `--dry-run` prints. The API key is replaced unless redact_secrets=False."""
        d = self.to_dict()
        if redact_secrets and d.get("api_key") is not None:
            d["api_key"] = REDACTED
        return json.dumps(d, indent=2, sort_keys=False)


def _field(flag: Flag) -> tuple[str, Any, Any]:
    kind = _TYPES[flag.kind]
    return flag.dest, (kind if flag.default is not None else kind | None), field(default=flag.default)


# One field per implemented flag, named by its dest, its default the table's: nothing here
# restates a setting. `dataclasses.fields(ServeConfig)` lists them; docs/flags.md documents them.
ServeConfig = make_dataclass("ServeConfig", [_field(f) for f in FLAGS if f.implemented],
                             bases=(_Settings,))
ServeConfig.__module__ = __name__  # pickled by reference (workers are spawned): findable here
