"""The worker's step trace (TOKENSPEED_STEP_TRACE) and the bench's GPU-idle share."""

from __future__ import annotations

import logging
import math

import pytest

from tokenspeed.bench.serve import gpu_idle_share
from tokenspeed.plan import StepPlan
from tokenspeed.step_trace import StepTrace


def _plan(step: int, new: bool) -> StepPlan:
    return StepPlan.build(step, new=[{"slot": 0}] if new else [], page_tables=[(0, 0, [1])],
                          scheduled=[(0, 0, [5, 6, 7], True)])


def test_trace_is_off_unless_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TOKENSPEED_STEP_TRACE", raising=False)
    assert StepTrace.from_env() is None
    monkeypatch.setenv("TOKENSPEED_STEP_TRACE", "0")
    assert StepTrace.from_env() is None
    monkeypatch.setenv("TOKENSPEED_STEP_TRACE", "5")
    trace = StepTrace.from_env()
    assert trace is not None and trace.every == 5


def test_steps_with_new_requests_are_always_logged(caplog: pytest.LogCaptureFixture) -> None:
    trace = StepTrace(every=1000)
    with caplog.at_level(logging.INFO, logger="tokenspeed.step_trace"):
        for step, new in ((0, True), (1, False), (2, False)):
            trace.received(_plan(step, new))
            trace.launched(step)
            trace.done(step)
            trace.sent(step)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and lines[0].startswith("step 0: batch 1 tokens 3 new 1 | idle ")
    for field in ("launch", "gpu_wait", "send", "total"):
        assert f" {field} " in lines[0]
    assert trace.count == 3


def test_gpu_idle_share_from_engine_counters() -> None:
    before = {"busy_s": 1.0, "stalled_s": 0.5, "gpu_idle_s": 2.0, "at_s": 10.0}
    after = {"busy_s": 4.0, "stalled_s": 1.5, "gpu_idle_s": 3.0, "at_s": 14.0}
    # The worker's GPU idle over the wall time between the reads; the engine's stall over its
    # serving time.
    assert gpu_idle_share(before, after) == {
        "busy_s": 3.0, "stalled_s": 1.0, "engine_stalled_share": 0.25,
        "gpu_idle_s": 1.0, "window_s": 4.0, "gpu_idle_share": 0.25}
    assert gpu_idle_share(None, after) is None
    idle = gpu_idle_share(before, before)
    assert idle is not None and math.isnan(idle["engine_stalled_share"]) and math.isnan(idle["gpu_idle_share"])
    # A server without the worker's count: only the engine's view.
    old = gpu_idle_share({"busy_s": 1.0, "stalled_s": 0.0}, {"busy_s": 2.0, "stalled_s": 1.0})
    assert old == {"busy_s": 1.0, "stalled_s": 1.0, "engine_stalled_share": 0.5}
