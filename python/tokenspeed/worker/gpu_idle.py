"""How long the GPU sat idle between a worker's steps, measured where it happens.

The engine sees only whether a plan is in flight; with one-step-ahead scheduling one always is,
yet the GPU still waits whenever the worker's host starts queuing a step after the previous
one's GPU work has finished (receiving the plan, sending a result, a garbage collection...).
Each step (and each data-parallel idle forward) is bracketed by two marks: one before its first
kernel is queued and one after its last. The idle time before a step is
max(0, start(N) - end(N-1)). On CUDA the marks are timing-enabled events, read with
`Event.elapsed_time` only once the GPU has passed them (`query()`): recording, querying and
reading events never make the host wait for the GPU. On the CPU a step's work is done when its
launch returns, so the marks are host wall-clock times.

A gap is reported with the first result sent after the GPU has passed both its marks (the
`StepTiming.gpu_idle_us` of the step result): the sum over results is exact, the attribution
to one step may lag by one.

The same two marks give each step's run time on the GPU (`StepTiming.gpu_busy_us`): from its
start mark, which the GPU passes once the previous step's work is done, to its end mark. The
engine learns what a step costs from it (`--max-mixed-step-ms`): the intervals between results
cannot tell, as the worker sends step N's result only after queuing step N+1.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Protocol

import torch

U32_MAX = 2**32 - 1


class Event(Protocol):
    """What the clock needs of a CUDA event (a fake in tests)."""

    def record(self) -> None: ...
    def query(self) -> bool: ...
    def elapsed_time(self, end_event: Event) -> float: ...


Mark = Event | float
Span = tuple[Mark, Mark]  # a step's start and end marks


class IdleClock:
    """The marks of one worker's steps and the idle gaps between them not yet reported."""

    def __init__(self, new_event: Callable[[], Event] | None = None,
                 now: Callable[[], float] = time.perf_counter) -> None:
        """`new_event`: makes a timing-enabled event (the GPU's clock); None: `now` (seconds)."""
        self._new_event = new_event
        self._now = now
        self._last_end: Mark | None = None
        self._start: Mark | None = None  # of the step being queued
        self._gaps: deque[tuple[Mark, Mark]] = deque()  # the GPU has not passed them yet
        self._idle_ms = 0.0  # gaps passed, not yet taken

    @classmethod
    def for_device(cls, device: torch.device) -> IdleClock:
        if device.type == "cuda":
            return cls(lambda: torch.cuda.Event(enable_timing=True))
        return cls()

    def _mark(self) -> Mark:
        if self._new_event is None:
            return self._now()
        event = self._new_event()
        event.record()
        return event

    def begin(self) -> None:
        """Before a step's first kernel is queued."""
        self._drain()  # keeps only gaps still queued (idle forwards send no result to take them)
        start = self._mark()
        if self._last_end is not None:
            self._gaps.append((self._last_end, start))
        # A step that begins again without ending (a bare `forward`) opens no second gap.
        self._last_end = None
        self._start = start

    def end(self) -> Span | None:
        """After a step's last kernel is queued (on the CPU: its work is done). Returns the
        step's span (its start and end marks, for `busy_us`); None without a `begin`."""
        self._last_end = self._mark()
        start, self._start = self._start, None
        return None if start is None else (start, self._last_end)

    @staticmethod
    def busy_us(span: Span | None) -> int | None:
        """Microseconds of the step's span (saturating at u32); None while the GPU has not
        passed its end mark (it never blocks) or without a span."""
        if span is None:
            return None
        start, end = span
        if isinstance(start, float) or isinstance(end, float):
            ms = 1e3 * (float(end) - float(start))  # type: ignore[arg-type]
        elif end.query():
            ms = start.elapsed_time(end)
        else:
            return None
        return min(U32_MAX, max(0, round(1e3 * ms)))

    def take_us(self) -> int:
        """Microseconds of idle in the gaps the GPU has passed, since the last call (saturating at
        u32). Never blocks: a gap whose start mark is still queued waits for a later call."""
        self._drain()
        idle_ms, self._idle_ms = self._idle_ms, 0.0
        return min(U32_MAX, round(1e3 * idle_ms))

    def _drain(self) -> None:
        """Adds up the gaps the GPU has passed (in stream order: the first still queued ends it)."""
        while self._gaps:
            prev_end, start = self._gaps[0]
            if isinstance(start, float) or isinstance(prev_end, float):
                self._idle_ms += max(0.0, 1e3 * (float(start) - float(prev_end)))  # type: ignore[arg-type]
            elif start.query():  # prev_end, recorded before it on the same stream, is done too
                self._idle_ms += max(0.0, prev_end.elapsed_time(start))
            else:
                break
            self._gaps.popleft()
