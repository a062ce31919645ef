"""`--kv-events-config`: vLLM's and SGLang's `KVEventsConfig` JSON, checked and completed once
when `tokenspeed serve` resolves its arguments. The Rust core (rust/server/src/kv_events.rs)
receives either None (publisher "null": off, nothing recorded) or every key filled in."""

from __future__ import annotations

import dataclasses
from typing import Any

from tokenspeed.config.errors import ConfigError, NotSupportedError

# vLLM's and SGLang's defaults for each key (vllm/config/kv_events.py, sglang kv_events.py).
DEFAULTS: dict[str, Any] = {
    "publisher": "null",
    "endpoint": "tcp://*:5557",
    "replay_endpoint": None,
    "buffer_steps": 10_000,
    "hwm": 100_000,
    "max_queue_size": 100_000,
    "topic": "",
}
# The ZMQ PUB queue per subscriber is fixed at this many messages (the `zeromq` crate's).
FIXED_HWM = 100_000
# vLLM's later key; accepted only with its off value.
_ENABLE = "enable_kv_cache_events"


def resolve_kv_events(cfg: Any) -> Any:
    """`cfg` with `kv_events_config` completed (or None when off); raises ConfigError."""
    spec = cfg.kv_events_config
    if spec is None:
        return cfg
    if not isinstance(spec, dict):
        raise ConfigError("--kv-events-config must be a JSON object")
    unknown = sorted(set(spec) - set(DEFAULTS) - {_ENABLE})
    if unknown:
        raise ConfigError(f"--kv-events-config: unknown key {unknown[0]!r} "
                          f"(known: {', '.join(DEFAULTS)})")
    full = DEFAULTS | {k: v for k, v in spec.items() if k != _ENABLE}
    publisher = full["publisher"]
    if publisher == "null" or spec.get(_ENABLE) is False:
        return dataclasses.replace(cfg, kv_events_config=None)
    if publisher != "zmq":
        raise ConfigError(f"--kv-events-config: unknown publisher {publisher!r} "
                          "(known: null, zmq)")
    _check_values(full)
    return dataclasses.replace(cfg, kv_events_config=full)


def _check_values(full: dict[str, Any]) -> None:
    for key in ("endpoint", "topic"):
        if not isinstance(full[key], str):
            raise ConfigError(f"--kv-events-config: {key} must be a string")
    # buffer_steps 0 keeps nothing for replay; the queues need room for one batch.
    for key, least in (("buffer_steps", 0), ("max_queue_size", 1), ("hwm", 1)):
        value = full[key]
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            raise ConfigError(f"--kv-events-config: {key} must be an integer >= {least}, "
                              f"got {value!r}")
    for key in ("endpoint", "replay_endpoint"):
        value = full[key]
        if value is not None and (not isinstance(value, str) or not value.startswith("tcp://")):
            raise NotSupportedError([(f"not supported yet: --kv-events-config ({key} {value!r}: "
                                      "only tcp://host:port endpoints)")])
    if full["hwm"] != FIXED_HWM:
        raise NotSupportedError([(f"not supported yet: --kv-events-config (hwm {full['hwm']}: "
                                  f"the publisher's queue is fixed at {FIXED_HWM} messages)")])
