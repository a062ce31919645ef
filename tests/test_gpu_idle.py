"""The GPU's idle time between a worker's steps (gpu_idle.py): the clock on fake timestamps and
fake CUDA events, the field in the step result, and the server's counter end to end on CPU."""

from __future__ import annotations

import os
import time

import httpx
import numpy as np
import openai

from server_harness import Server
from tokenspeed.worker.gpu_idle import U32_MAX, IdleClock
from tokenspeed.worker.plan import RESULT_DTYPES, StepOutput


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class FakeEvent:
    """A CUDA event on a fake GPU timeline: `stamp` (ms) once the GPU passed it, else None."""

    def __init__(self, gpu: list[FakeEvent]) -> None:
        self.stamp: float | None = None
        gpu.append(self)

    def record(self) -> None:
        pass

    def query(self) -> bool:
        return self.stamp is not None

    def elapsed_time(self, end_event: FakeEvent) -> float:
        if self.stamp is None or end_event.stamp is None:
            raise RuntimeError("Both events must be completed before calculating elapsed time.")
        return end_event.stamp - self.stamp


def test_wall_clock_idle_is_the_time_from_one_step_end_to_the_next_start() -> None:
    now = FakeClock()
    clock = IdleClock(now=now)
    now.t = 1.0
    clock.begin()
    now.t = 2.0
    clock.end()
    assert clock.take_us() == 0  # no step before the first
    now.t = 2.25
    clock.begin()
    now.t = 3.0
    clock.end()
    now.t = 3.5
    clock.begin()  # a bare forward that never ends opens no gap for the step after it
    now.t = 4.0
    clock.begin()
    clock.end()
    assert clock.take_us() == 750_000
    assert clock.take_us() == 0  # reported once


def test_event_gaps_are_read_only_once_the_gpu_passed_them() -> None:
    gpu: list[FakeEvent] = []
    clock = IdleClock(new_event=lambda: FakeEvent(gpu))
    clock.begin()
    clock.end()
    clock.begin()  # queued while the GPU still ran the first step: no idle
    clock.end()
    clock.begin()  # the GPU ran dry 2.5 ms before this step's first kernel
    clock.end()
    s0, e0, s1, e1, s2, e2 = gpu
    s0.stamp, e0.stamp, s1.stamp, e1.stamp = 0.0, 4.0, 4.0, 9.0
    # s2 still queued: elapsed_time on it would raise; the gap waits for a later call.
    assert clock.take_us() == 0
    s2.stamp, e2.stamp = 11.5, 14.0
    assert clock.take_us() == 2500
    assert clock.take_us() == 0


def test_gaps_the_gpu_passed_are_added_up_at_once_so_idle_forwards_hold_no_events() -> None:
    gpu: list[FakeEvent] = []
    clock = IdleClock(new_event=lambda: FakeEvent(gpu))
    for i in range(100):  # data-parallel idle forwards: no result takes their gaps for a while
        clock.begin()
        gpu[-1].stamp = 10.0 * i
        clock.end()
        gpu[-1].stamp = 10.0 * i + 9.0  # 1 ms idle before the next one
    assert len(clock._gaps) <= 1
    assert clock.take_us() == 99 * 1000


def test_idle_saturates_at_u32_and_never_goes_negative() -> None:
    now = FakeClock()
    clock = IdleClock(now=now)
    clock.begin()
    now.t = 10.0
    clock.end()
    now.t = 9.0  # a clock that went back: no negative idle
    clock.begin()
    clock.end()
    assert clock.take_us() == 0
    now.t = 1e5  # 27 hours later
    clock.begin()
    assert clock.take_us() == U32_MAX


def test_a_steps_run_time_spans_its_marks_once_the_gpu_passed_them() -> None:
    now = FakeClock()
    wall = IdleClock(now=now)
    now.t = 1.0
    wall.begin()
    now.t = 1.03
    assert wall.busy_us(wall.end()) == 30_000
    assert wall.busy_us(None) is None

    gpu: list[FakeEvent] = []
    clock = IdleClock(new_event=lambda: FakeEvent(gpu))
    clock.begin()
    first = clock.end()
    clock.begin()  # queued behind the first: the GPU starts it when the first is done
    second = clock.end()
    s0, e0, s1, e1 = gpu
    s0.stamp, e0.stamp = 0.0, 4.0
    assert clock.busy_us(first) == 4000
    assert clock.busy_us(second) is None, "still running: never blocks"
    s1.stamp, e1.stamp = 4.0, 11.5
    assert clock.busy_us(second) == 7500


def test_the_idle_time_crosses_the_result_channel_only_when_measured() -> None:
    from tokenspeed import _core
    from tokenspeed.worker.plan import StepPlan

    name = f"ts-pytest-{os.getpid()}-gpu-idle"
    w = _core.PlanWriter.create(name, 1)
    ch = _core.WorkerChannel.attach(name, 0)
    try:
        w.send_plan(1, StepPlan.build(1).arrays())
        assert ch.recv(1000) is not None
        out = StepOutput(slots=np.array([1]), tokens=np.array([5]), logprobs=np.array([-0.5]))
        ch.send_result(1, out.arrays())
        assert len(w.recv_result(1000)["timing_gpu_idle_us"]) == 0  # no timing row
        out.gpu_idle_us = 1234
        out.gpu_busy_us = 25_000
        ch.send_result(2, out.arrays())
        res = w.recv_result(1000)
        got = np.frombuffer(res["timing_gpu_idle_us"], RESULT_DTYPES["timing_gpu_idle_us"])
        assert got.tolist() == [1234]
        busy = np.frombuffer(res["timing_gpu_busy_us"], RESULT_DTYPES["timing_gpu_busy_us"])
        assert busy.tolist() == [25_000]
    finally:
        w.close()


def _engine(server: Server) -> dict:
    return httpx.get(f"{server.url}/get_server_info", timeout=10).json()["engine"]


def _wait_idle(server: Server, timeout_s: float = 60) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        engine = _engine(server)
        if engine["running_requests"] == 0 and engine["waiting_requests"] == 0:
            return engine
        time.sleep(0.05)
    raise AssertionError("the engine never went idle")


def test_the_server_counts_the_gpu_idle_between_two_requests(server: Server, client: openai.OpenAI,
                                                            model: str) -> None:
    def ask() -> None:
        client.completions.create(model=model, prompt="Hello", max_tokens=2, temperature=0)

    _wait_idle(server)
    started = time.monotonic()
    ask()  # the first gap after a quiet spell of unknown length is reported before `before`
    before = _wait_idle(server)
    ask()
    time.sleep(0.3)  # no request in the server: the GPU idles, the engine books nothing
    ask()
    after = _wait_idle(server)
    elapsed = time.monotonic() - started
    idle = after["gpu_idle_s"] - before["gpu_idle_s"]
    busy = after["busy_s"] - before["busy_s"]
    stalled = after["stalled_s"] - before["stalled_s"]
    assert 0.25 <= idle <= elapsed, (idle, elapsed)
    assert busy > 0 and busy + stalled <= elapsed
    assert stalled < 0.25, stalled  # the client's sleep is no engine stall
