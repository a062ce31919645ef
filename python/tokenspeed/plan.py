"""The step plan as the worker sees it: flat numpy arrays (views into shared memory).

`tokenspeed._core.PlanChannel.recv()` returns the fields below as a dict; `StepPlan.from_dict`
wraps them. Tests build a `StepPlan` directly. The arrays stay valid until the next `recv()`.
Mirrors `rust/engine/src/plan.rs`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

# An input id meaning "the token this slot sampled in its latest sampling step" (one-step-ahead
# scheduling: the engine plans the next decode before it knows that token). Mirrors
# `LAST_SAMPLED` in rust/engine/src/plan.rs.
LAST_SAMPLED = 0xFFFFFFFF


def _u32(values: list[int] | None = None) -> np.ndarray:
    return np.asarray(values or [], dtype=np.uint32)


@dataclass
class StepPlan:
    step_id: int = 0
    # Slots to drop before anything else (finished, aborted or retracted requests).
    finished_slots: np.ndarray = field(default_factory=_u32)
    # New requests: slot and sampling parameters, one entry per new request.
    new_slots: np.ndarray = field(default_factory=_u32)
    new_temperature: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))
    new_top_p: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))
    new_top_k: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    new_min_p: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))
    new_repetition_penalty: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))
    new_frequency_penalty: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))
    new_presence_penalty: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))
    # -1 = no per-request seed.
    new_seed: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    new_top_logprobs: np.ndarray = field(default_factory=_u32)
    # Page-table updates: slot's entries [first, first + count) = the next `count` of pt_pages.
    pt_slots: np.ndarray = field(default_factory=_u32)
    pt_first: np.ndarray = field(default_factory=_u32)
    pt_count: np.ndarray = field(default_factory=_u32)
    pt_pages: np.ndarray = field(default_factory=_u32)
    # Scheduled requests, in the order of their tokens in input_ids.
    slots: np.ndarray = field(default_factory=_u32)
    num_tokens: np.ndarray = field(default_factory=_u32)
    start_pos: np.ndarray = field(default_factory=_u32)
    sample: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint8))
    input_ids: np.ndarray = field(default_factory=_u32)

    @classmethod
    def from_dict(cls, d: dict) -> StepPlan:
        return cls(**d)


@dataclass
class StepOutput:
    """One entry per scheduled request with sample=1, in plan order."""

    slots: np.ndarray  # uint32
    tokens: np.ndarray  # uint32
    logprobs: np.ndarray  # float32
    # [n, k] top-k token ids and logprobs (k = max requested this step; 0 columns if none).
    top_ids: np.ndarray | None = None
    top_logprobs: np.ndarray | None = None
