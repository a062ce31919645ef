"""Per-step timestamps of the worker loop, logged when TOKENSPEED_STEP_TRACE is set (a debug aid,
off by default: it costs a few perf_counter calls and one log line per step).

For each step it logs, in milliseconds:
- `idle`: time the worker had no step in flight before this plan arrived (the GPU sat idle
  waiting for the engine: scheduling, the result path, or no work),
- `launch`: plan received → every kernel of the step queued (host time of the step: plan to
  tensors, eager launches, sampler); on the CPU this is the whole step,
- `gpu_wait`: launched → outputs on the host (0 when the host was slower than the GPU),
- `send`: outputs on the host → result written to the ring,
- `total`: plan received → result sent,
- `at`: when the result was sent, in seconds of `time.monotonic()` (one clock for every process
  on the machine: a benchmark can cut the trace to its own run and take the intervals between
  results, i.e. the step times running streams see; benches/diagnostics/step_intervals.py).
TOKENSPEED_STEP_TRACE=N logs every N-th step (1: all); steps that carry new requests are always
logged (prefill latency is what this is for). TOKENSPEED_STEP_PROFILE=DIR also profiles the steps
that carry new requests (step_profile.py).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sized
from typing import Protocol

from tokenspeed.diagnostics.step_profile import StepProfiler

logger = logging.getLogger("tokenspeed.diagnostics.step_trace")


class TracedPlan(Protocol):
    """What a trace reads of a step's plan (the worker's `StepPlan`, worker/plan.py)."""

    step_id: int
    new_slot: Sized
    sched_slot: Sized
    sched_tokens: Sized


class StepTrace:
    def __init__(self, every: int, profiler: StepProfiler | None = None) -> None:
        self.every = max(1, every)
        self.profiler = profiler
        self._steps: dict[int, dict[str, float]] = {}
        self._idle_since: float | None = time.perf_counter()
        self.count = 0

    @classmethod
    def from_env(cls) -> StepTrace | None:
        raw = os.environ.get("TOKENSPEED_STEP_TRACE", "")
        profiler = StepProfiler.from_env()
        if (not raw or raw == "0") and profiler is None:
            return None
        try:
            every = int(raw or 0) or 2**62  # profiling alone: log only steps with new requests
        except ValueError:
            every = 1
        return cls(every, profiler)

    def received(self, plan: TracedPlan) -> None:
        if self.profiler is not None:
            self.profiler.received(int(plan.step_id), len(plan.new_slot))
        now = time.perf_counter()
        idle = 0.0
        if self._idle_since is not None:
            idle = now - self._idle_since
            self._idle_since = None
        self._steps[int(plan.step_id)] = {
            "recv": now, "idle": idle, "tokens": float(len(plan.sched_tokens)),
            "batch": float(len(plan.sched_slot)), "new": float(len(plan.new_slot)),
        }

    def launched(self, step_id: int) -> None:
        s = self._steps.get(int(step_id))
        if s is not None:
            s["launched"] = time.perf_counter()

    def done(self, step_id: int) -> None:
        s = self._steps.get(int(step_id))
        if s is not None:
            s["done"] = time.perf_counter()

    def sent(self, step_id: int) -> None:
        now = time.perf_counter()
        s = self._steps.pop(int(step_id), None)
        if not self._steps:  # nothing in flight any more: the GPU idles until the next plan
            self._idle_since = now
        if self.profiler is not None:
            self.profiler.sent(int(step_id))
        if s is None:
            return
        self.count += 1
        if s["new"] == 0 and self.count % self.every:
            return
        launched = s.get("launched", s["recv"])
        done = s.get("done", launched)
        ms = 1e3
        logger.info("step %d: batch %d tokens %d new %d | idle %.2f launch %.2f gpu_wait %.2f "
                    "send %.2f total %.2f ms at %.4f s", step_id, s["batch"], s["tokens"],
                    s["new"], s["idle"] * ms, (launched - s["recv"]) * ms,
                    max(0.0, done - launched) * ms, (now - done) * ms, (now - s["recv"]) * ms,
                    time.monotonic())
