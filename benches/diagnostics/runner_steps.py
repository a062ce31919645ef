"""For bench scripts that drive a ModelRunner directly (no engine): the Llama-3.1-8B config as a
model directory for dummy weights, and step plans in which a request gets a fresh run of
`ctx // page` pages the first time it is scheduled and its position advances by the tokens each
plan runs for it. Used by profile_mixed_launch.py and mixed_step_gpu.py."""

from __future__ import annotations

import json
import tempfile
from collections.abc import Sequence

from tokenspeed.bench.model_configs import LLAMA31_8B
from tokenspeed.worker.plan import StepPlan


def llama31_8b_dir(layers: int | None = None) -> str:
    """A temporary model directory holding the Llama-3.1-8B config (first `layers` layers)."""
    cfg = dict(LLAMA31_8B)
    if layers:
        cfg["num_hidden_layers"] = layers
    path = tempfile.mkdtemp(prefix="llama31-8b-")
    with open(f"{path}/config.json", "w") as f:
        json.dump(cfg, f)
    return path


class PlanBuilder:
    def __init__(self, ctx: int, page: int) -> None:
        self.ctx, self.page = ctx, page
        self.lens: dict[int, int] = {}  # slot -> tokens in its cache
        self._next_page = 0
        self._step = 0

    def plan(self, reqs: Sequence[tuple[int, list[int]]], finished: Sequence[int] = ()) -> StepPlan:
        """One step running `tokens` for each (slot, tokens) in reqs, greedy sampling."""
        page_tables, new = [], []
        for slot, _ in reqs:
            if slot not in self.lens:
                new.append({"slot": slot, "temperature": 0.0})
                n = self.ctx // self.page
                page_tables.append((slot, 0, range(self._next_page, self._next_page + n)))
                self._next_page += n
                self.lens[slot] = 0
        p = StepPlan.build(self._step, finished=list(finished), new=new, page_tables=page_tables,
                           scheduled=[(s, self.lens[s], t, True) for s, t in reqs])
        self._step += 1
        for slot, toks in reqs:
            self.lens[slot] += len(toks)
        return p
