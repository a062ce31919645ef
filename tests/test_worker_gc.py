"""The worker's garbage-collector set-up: start-up objects frozen, slow collections logged."""

from __future__ import annotations

import gc
import logging

import pytest

from tokenspeed.worker import loop


def test_startup_objects_frozen_and_slow_collections_logged(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    callbacks = list(gc.callbacks)
    try:
        loop._quiet_garbage_collector()
        assert gc.get_freeze_count() > 0
        (timed,) = [cb for cb in gc.callbacks if cb not in callbacks]
        clock = iter([10.0, 10.005, 20.0, 20.035])
        monkeypatch.setattr(loop.time, "perf_counter", lambda: next(clock))
        with caplog.at_level(logging.WARNING, logger="tokenspeed.worker.loop"):
            for _ in range(2):  # 5 ms: quiet; 35 ms: logged
                timed("start", {"generation": 2, "collected": 0})
                timed("stop", {"generation": 2, "collected": 7})
        assert [r.getMessage() for r in caplog.records] == [
            "garbage collection of generation 2 took 35 ms (7 collected)"]
    finally:
        gc.callbacks[:] = callbacks
        gc.unfreeze()
