"""The step of a pooling model (`--is-embedding`): prefill-only, nothing sampled.

Every request of the step has its whole prompt in it (the scheduler never chunks a pooling
request), so the forward's hidden states of request i are its rows of the step; the model pools
those of the requests that end in this step (`sched_sample`) into one float32 vector each, which
go back as the result's `pooled` lists (rust/engine/src/plan.rs `RequestEvent::pooled`).
Eager only: a step's shape is the prompts', there is no decode to replay as a graph.
"""

from __future__ import annotations

from typing import Any  # the runner: a ModelRunner (model_runner.py imports this module)

import numpy as np
import torch

from tokenspeed.layers.host_copy import DeviceToHost
from tokenspeed.worker.pending_step import PendingStep
from tokenspeed.worker.plan import StepOutput, StepPlan, new_request_rows


def token_types(plan: StepPlan, segment_b: dict[int, int], device: torch.device) -> torch.Tensor:
    """Per token: 1 from its request's second segment on (a text pair), else 0."""
    starts = plan.sched_start_pos.astype(np.int64)
    lens = plan.sched_tokens_len.astype(np.int64)
    types = [((np.arange(n) + s) >= b).astype(np.int64) if (b := segment_b.get(slot, 0)) > 0
             else np.zeros(n, np.int64)
             for slot, s, n in zip(plan.sched_slot.tolist(), starts.tolist(), lens.tolist())]
    flat = np.concatenate(types) if types else np.zeros(0, np.int64)
    return torch.from_numpy(flat).to(device)


@torch.inference_mode()
def pool_step(runner: Any, plan: StepPlan) -> PendingStep:
    segment_b: dict[int, int] = runner.__dict__.setdefault("_segment_b", {})
    for slot, params, _ in new_request_rows(plan):
        segment_b[slot] = int(params.get("segment_b", 0))
    runner.idle_clock.begin()
    runner._apply_state(plan)
    sample = plan.sched_sample.astype(bool)
    slots = plan.sched_slot[sample].astype(np.uint32)
    if len(slots) == 0:
        return PendingStep(slots, None, idle_clock=runner.idle_clock, span=runner.idle_clock.end())
    positions, out_loc, query_start = runner._token_indices(plan)
    batch = runner._build_batch(plan, positions, out_loc, query_start)
    runner.backend.prepare(batch)
    types = token_types(plan, segment_b, runner.device)
    hidden = runner.model(batch.input_ids, batch.positions, batch, token_types=types)
    vectors = runner.model.pool(hidden, batch, np.flatnonzero(sample)).float()
    return PooledStep(slots, DeviceToHost([vectors]), runner.idle_clock.end(), runner)


class PooledStep(PendingStep):
    """A launched pooling step: its vectors on their way to the host."""

    def __init__(self, slots: np.ndarray, vectors: DeviceToHost, span: object,
                 runner: Any) -> None:
        super().__init__(slots, None, idle_clock=runner.idle_clock, span=span)  # type: ignore[arg-type]
        self._vectors = vectors

    def ready(self) -> bool:
        return self._vectors.ready()

    def wait(self) -> StepOutput:
        (vectors,) = self._vectors.wait()
        out = super().wait()
        out.pooled = np.asarray(vectors, np.float32)
        return out
