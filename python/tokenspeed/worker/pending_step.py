"""PendingStep: a launched step whose sampled tokens are on their way to the host."""

from __future__ import annotations

import numpy as np

from tokenspeed.layers.host_copy import DeviceToHost
from tokenspeed.worker.gpu_idle import IdleClock, Span
from tokenspeed.worker.plan import StepOutput
from tokenspeed.worker.prompt_logprobs import PromptLogprobs
from tokenspeed.worker.spec_verify import Drafts

# `RequestEvent::error` of a request the worker could not run (plan.rs event_error::FAILED).
FAILED = 1


class PendingStep:
    """A launched step whose sampled tokens are on their way to the host."""

    def __init__(self, slots: np.ndarray, outputs: DeviceToHost | None,
                 top_k: np.ndarray | None = None,
                 prompt: dict[int, PromptLogprobs] | None = None,
                 idle_clock: IdleClock | None = None,
                 span: Span | None = None, drafts: Drafts | None = None,
                 failed: set[int] | None = None) -> None:
        self.slots = slots
        self.top_k = top_k
        self.prompt = prompt or {}
        self._outputs = outputs
        self._idle_clock = idle_clock
        self._span = span  # the step's marks on the idle clock (its run time)
        self._drafts = drafts  # rows are verified positions: accept on the host (spec_verify)
        self.failed = failed or set()  # slots whose request failed (a LoRA adapter unreadable)
        self._done: StepOutput | None = None

    @staticmethod
    def done(out: StepOutput) -> PendingStep:
        """A step whose output is already on the host (EAGLE-3 drafted after waiting for it)."""
        step = PendingStep(out.slots, None)
        step._done = out
        return step

    def ready(self) -> bool:
        """True once `wait()` would not block."""
        return self._outputs is None or self._outputs.ready()

    def wait(self) -> StepOutput:
        if self._done is not None:
            return self._done
        if self._outputs is None:
            out = StepOutput(slots=self.slots, tokens=np.zeros(0), logprobs=np.zeros(0),
                             prompt=self.prompt)
        else:
            tokens, logprobs, top_ids, top_logprobs = self._outputs.wait()
            slots, top_k, counts = self.slots, self.top_k, None
            if self._drafts is not None:
                keep, counts, tokens = self._drafts.accept(np.asarray(tokens))
                starts = np.cumsum(self._drafts.rows) - self._drafts.rows
                slots = self.slots[starts]
                top_k = None if top_k is None else top_k[starts]
                tokens, logprobs = np.asarray(tokens)[keep], np.asarray(logprobs)[keep]
                top_ids, top_logprobs = np.asarray(top_ids)[keep], np.asarray(top_logprobs)[keep]
            out = StepOutput(slots=slots, tokens=tokens, logprobs=logprobs, top_ids=top_ids,
                             top_logprobs=top_logprobs, top_k=top_k, prompt=self.prompt,
                             counts=counts)
        if self.failed:
            out.errors = np.asarray([FAILED if s in self.failed else 0
                                     for s in np.asarray(out.slots).tolist()], np.uint32)
        if self._idle_clock is not None:  # after the wait: this step's marks are passed
            out.gpu_idle_us = self._idle_clock.take_us()
            out.gpu_busy_us = IdleClock.busy_us(self._span) or 0
        return out
