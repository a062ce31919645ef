"""Replay or eager, measured, for the steps only a wide extend graph holds (a prompt chunk beside
hundreds of decodes, or a decode batch past the decode graphs).

Which way is faster depends on the machine. A replay saves the host its ~300-500 launches (an
H100 host measured S1's mixed steps host-bound when eager, 3600d93), but pads the step to the
graph's token count and runs the graph's generic tiled extend kernel, where eager launches the
prefill kernel for a new prompt. On an H200 with a fast host, eager was 7-10% faster at 820
decodes (benches/RESULTS.md, session 28). So each wide graph shape is timed both ways on the
GPU's clock, from before the step's first kernel to after its forward (the host's gaps count),
and the faster way is taken, with the other re-timed once every RETRY_EVERY steps of that shape.

Single rank only (the runner decides): ranks that timed differently would disagree on the path
of a step whose collectives they share.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

logger = logging.getLogger(__name__)

Shape = tuple[int, int]  # an extend graph's (tokens, request rows)
Mark = Any  # a timing-enabled CUDA event, or seconds on the host clock


class GraphChoice:
    """Per wide graph shape: the last TRIALS times of each way, and which way the next step takes."""

    TRIALS = 3  # times of each way before choosing (their median decides)
    RETRY_EVERY = 128  # steps of a shape between re-timings of the way not taken

    def __init__(self, new_event: Callable[[], Any] | None = None,
                 now: Callable[[], float] = time.perf_counter) -> None:
        """`new_event`: makes a timing-enabled event (the GPU's clock); None: `now` (seconds)."""
        self._new_event, self._now = new_event, now
        self._times: dict[tuple[Shape, bool], deque[float]] = {}
        self._steps: dict[Shape, int] = {}
        self._chosen: dict[Shape, bool] = {}
        self._open: tuple[Shape, bool, Mark] | None = None
        self._queued: deque[tuple[Shape, bool, Mark, Mark]] = deque()  # the GPU has not passed

    @classmethod
    def for_device(cls, device: torch.device) -> GraphChoice:
        if device.type == "cuda":
            return cls(lambda: torch.cuda.Event(enable_timing=True))
        return cls()

    def begin(self, shape: Shape) -> bool:
        """Before the step's first kernel: whether it replays the graph of `shape` (else it runs
        eagerly). Opens the step's timing, which `end` closes."""
        self._drain()
        n = self._steps.get(shape, 0)
        self._steps[shape] = n + 1
        if n < 2 * self.TRIALS:
            replay = n % 2 == 0  # replay, eager, replay, ...
        else:
            faster = self._faster(shape)
            replay = faster if n % self.RETRY_EVERY else not faster
        self._open = (shape, replay, self._mark())
        return replay

    def end(self) -> None:
        """After the step's forward is queued; nothing without an open timing."""
        if self._open is not None:
            shape, replay, start = self._open
            self._open = None
            self._queued.append((shape, replay, start, self._mark()))

    def median_ms(self, shape: Shape, replay: bool) -> float | None:
        times = self._times.get((shape, replay))
        return statistics.median(times) if times else None

    def _faster(self, shape: Shape) -> bool:
        """True: the replay (also while either way has no time yet)."""
        graph, eager = self.median_ms(shape, True), self.median_ms(shape, False)
        replay = graph is None or eager is None or graph <= eager
        if self._chosen.get(shape) != replay and graph is not None and eager is not None:
            logger.info("extend graph %s: replay %.2f ms, eager %.2f ms (median of the last %d): "
                        "%s", shape, graph, eager, self.TRIALS, "replays" if replay else "eager")
        self._chosen[shape] = replay
        return replay

    def _mark(self) -> Mark:
        if self._new_event is None:
            return self._now()
        event = self._new_event()
        event.record()
        return event

    def _drain(self) -> None:
        """Times of the steps the GPU has passed (in order; never blocks)."""
        while self._queued:
            shape, replay, start, end = self._queued[0]
            if isinstance(start, float):
                ms = 1e3 * (end - start)
            elif end.query():
                ms = start.elapsed_time(end)
            else:
                return
            self._queued.popleft()
            self._times.setdefault((shape, replay), deque(maxlen=self.TRIALS)).append(ms)
