"""The engine inside this Python process: the workers `tokenspeed serve` would start, and the
Rust core's request pipeline and engine threads (`tokenspeed._core.Engine`) with no HTTP. One
per process; `shutdown()` (also at interpreter exit) stops the workers and unlinks the shared
memory."""

from __future__ import annotations

import atexit
import json
import logging
import os
import threading
from typing import Any

from tokenspeed.config import ServeConfig, config_from_kwargs

logger = logging.getLogger("tokenspeed.offline")

_LOCK = threading.Lock()
_RUNNING: EngineCore | None = None


class EngineDeadError(RuntimeError):
    """The worker group died (or the engine failed): in-flight and new requests fail."""


class RequestFailed(RuntimeError):
    """The engine could not finish a request (overloaded, internal error)."""


def make_config(model: str | os.PathLike[str] | None, kwargs: dict[str, Any]) -> ServeConfig:
    """The same keyword names as `tokenspeed serve`'s flags (their dests: `max_model_len`,
    `tp_size`, `max_running_requests`, ...), checked as the command line is."""
    values = dict(kwargs)
    if model is not None:
        values["model_path"] = os.fspath(model)
    return config_from_kwargs(values)


class EngineCore:
    """Starts the workers and the engine; `submit`, `recv`, `abort`, `shutdown`."""

    def __init__(self, cfg: ServeConfig) -> None:
        global _RUNNING
        with _LOCK:
            if _RUNNING is not None:
                raise RuntimeError("a TokenSpeed engine is already running in this process; "
                                   "call shutdown() on it (or leave its `with` block) first")
            _RUNNING = self
        self.failure: str | None = None
        self._closed = False
        try:
            self._start(cfg)
        except BaseException:
            with _LOCK:
                _RUNNING = None
            raise
        atexit.register(self.shutdown)

    def _start(self, cfg: ServeConfig) -> None:
        from tokenspeed import _core
        from tokenspeed.launch.serve import LaunchError, server_config, start_workers

        if int(cfg.nnodes or 1) > 1:
            raise LaunchError("the offline engine runs on one node: --nnodes > 1 is not supported "
                              "yet (use `tokenspeed serve`)")
        self.group = start_workers(cfg, on_failure=self._on_failure)
        g = self.group
        try:
            config = server_config(g.cfg, g.layout, g.vocab_size, g.capacities, g.pages,
                                   g.max_running, g.workers, g.lora)
            logger.info("workers ready on %s: %d KV pages x %d tokens, %d running requests",
                        g.layout.device, g.pages, int(cfg.page_size), g.max_running)
            self.core = _core.Engine.start(json.dumps(config), g.channels, cfg.log_level or "info")
        except BaseException:
            g.stop()
            raise
        g.watch.start()

    def _on_failure(self, message: str) -> None:
        self.failure = message
        logger.error("%s", message)

    def check_alive(self) -> None:
        if self._closed:
            raise RuntimeError("the engine was shut down")
        if self.failure is not None or not self.core.healthy:
            raise EngineDeadError(self.failure or "the engine's worker group is down")

    def submit(self, request_id: str, kind: str, body: dict[str, Any], stream: bool = False) -> None:
        self.check_alive()
        self.core.submit(request_id, kind, json.dumps(body), stream)

    def recv(self, timeout: float | None = 0.5) -> list[dict[str, Any]]:
        """Events of every request (the GIL released while waiting)."""
        return json.loads(self.core.recv(timeout))

    def abort(self, request_id: str) -> None:
        if not self._closed:
            self.core.abort(request_id)

    def error(self, event: dict[str, Any]) -> Exception:
        """The exception an error event raises in the caller."""
        err = event["error"]
        message = err["message"]
        if err["kind"] == "invalid":
            return ValueError(f"{err['param']}: {message}" if err.get("param") else message)
        if self.failure is not None or not self.core.healthy:
            return EngineDeadError(f"{self.failure or 'the worker group is down'} ({message})")
        return RequestFailed(message)

    def decode(self, ids: list[int]) -> str:
        return self.core.decode(ids)

    def shutdown(self) -> None:
        """Aborts what runs, stops the engine and the workers. Idempotent."""
        global _RUNNING
        if self._closed:
            return
        self._closed = True
        try:
            if hasattr(self, "core"):
                self.core.shutdown()
        finally:
            self.group.stop()
            with _LOCK:
                if _RUNNING is self:
                    _RUNNING = None
            atexit.unregister(self.shutdown)
