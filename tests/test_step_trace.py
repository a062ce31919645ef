"""The worker's step trace (TOKENSPEED_STEP_TRACE), its step profiles (TOKENSPEED_STEP_PROFILE) and
the bench's GPU-idle share."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import pytest

from tokenspeed.bench.serve import gpu_idle_share
from tokenspeed.diagnostics.step_profile import summarize
from tokenspeed.diagnostics.step_trace import StepTrace
from tokenspeed.worker.plan import StepPlan


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
    with caplog.at_level(logging.INFO, logger="tokenspeed.diagnostics.step_trace"):
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


def test_profile_summary_names_gaps_and_what_the_host_did() -> None:
    def x(cat: str, name: str, ts: float, dur: float) -> dict:
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}

    trace = {"traceEvents": [
        x("cpu_op", "prepare", 0, 500), x("kernel", "gemm", 400, 1000),
        x("cpu_op", "aten::item", 1400, 2000),  # the host is here while the GPU waits
        x("kernel", "attn", 3000, 300), x("kernel", "gemm", 3300, 1000),
        x("cuda_runtime", "cudaStreamSynchronize", 1500, 1500)]}
    lines = summarize(trace, top=4)
    assert lines[0] == "  kernels: 2.30 ms GPU in 3 launches"
    assert lines[1].split() == ["2.000", "ms", "2x", "gemm"]
    gpu = next(line for line in lines if line.startswith("  GPU:"))
    assert "first kernel 0.40 ms" in gpu and "idle between kernels 1.60 ms" in gpu
    assert "1.60 ms at 1.40: after gemm / before attn; host in aten::item" in "\n".join(lines)
    assert lines[-1].startswith("  host CUDA calls (ms, count): cudaStreamSynchronize 1.50/1")


def test_profiler_traces_steps_with_new_requests(monkeypatch: pytest.MonkeyPatch,
                                                 tmp_path: Path,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    import torch

    monkeypatch.delenv("TOKENSPEED_STEP_TRACE", raising=False)
    monkeypatch.setenv("TOKENSPEED_STEP_PROFILE", str(tmp_path))
    monkeypatch.setenv("TOKENSPEED_STEP_PROFILE_LIMIT", "1")
    trace = StepTrace.from_env()
    assert trace is not None and trace.profiler is not None
    with caplog.at_level(logging.INFO, logger="tokenspeed.diagnostics.step_profile"):
        for step, new in ((0, False), (1, True), (2, True)):  # only step 1: the limit is 1
            trace.received(_plan(step, new))
            torch.ones(64, 64) @ torch.ones(64, 64)
            trace.sent(step)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-1.json"]
    assert any(r.getMessage().startswith("step 1 profiled") for r in caplog.records)
