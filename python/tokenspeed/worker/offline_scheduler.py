"""A toy scheduler that drives ModelRunner with real StepPlans: page allocation, chunked
prefill, batched decode. For tests and benchmarks that run without the Rust core."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from tokenspeed.worker.plan import StepPlan


@dataclass
class _Req:
    slot: int
    prompt: list[int]
    max_new_tokens: int
    fed: int = 0  # tokens whose KV is in the cache
    pages: list[int] = field(default_factory=list)
    output: list[int] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)
    forced: list[int] | None = None  # teacher forcing: decode inputs, in place of the outputs

    @property
    def done(self) -> bool:
        return len(self.output) >= self.max_new_tokens

    @property
    def prefilling(self) -> bool:
        return self.fed < len(self.prompt)


@dataclass
class OfflineResult:
    tokens: list[list[int]]
    logits: list[list[torch.Tensor]]  # per request, per sampled token: float32 [vocab] (CPU)
    logprobs: list[list[float]]
    steps: int


def _f32(v: list[float]) -> np.ndarray:
    return np.asarray(v, dtype=np.float32)


class OfflineScheduler:
    """Pages are handed out from a shuffled free list so page tables are never contiguous."""

    def __init__(self, runner: object, *, seed: int = 0) -> None:
        self.runner = runner
        self.page_size: int = runner.page_size  # type: ignore[attr-defined]
        rng = np.random.default_rng(seed)
        self.free_pages = [int(p) for p in rng.permutation(runner.num_pages)]  # type: ignore[attr-defined]
        self.step_id = 0

    def generate(self, prompts: list[list[int]], max_new_tokens: int, *, chunk_size: int = 16,
                 decode_after_all_prefills: bool = True, keep_logits: bool = False,
                 sampling: dict[str, list[float]] | None = None,
                 teacher: list[list[int]] | None = None) -> OfflineResult:
        """Run every prompt to max_new_tokens: chunked prefill, then batched decode.

        `sampling` maps sampling field names (the plan's `new_*` arrays without the prefix,
        e.g. "temperature", "seed") to one value per prompt; greedy by default. `teacher` (teacher
        forcing): per prompt, the tokens fed as decode inputs (at least max_new_tokens - 1 of
        them) whatever the model samples; the result still reports what it sampled, so two
        models can be compared step by step.
        """
        reqs = [_Req(slot=i, prompt=list(p), max_new_tokens=max_new_tokens,
                     forced=list(teacher[i]) if teacher is not None else None)
                for i, p in enumerate(prompts)]
        sampling = {"temperature": [0.0] * len(reqs), **(sampling or {})}
        new: list[dict] = [{"slot": i, **{k: v[i] for k, v in sampling.items()}}
                           for i in range(len(reqs))]
        logprobs: list[list[float]] = [[] for _ in reqs]
        steps = 0
        while not all(r.done for r in reqs):
            any_prefill = any(r.prefilling for r in reqs)
            sched = [r for r in reqs if not r.done and (
                r.prefilling or not (decode_after_all_prefills and any_prefill))]
            plan = self._plan(sched, chunk_size, new)
            new = []
            logits = self.runner.forward(plan)  # type: ignore[attr-defined]
            out = self.runner.sample(plan, logits)  # type: ignore[attr-defined]
            by_slot = {r.slot: r for r in reqs}
            for row, (slot, tok, lp) in enumerate(zip(out.slots, out.tokens, out.logprobs)):
                r = by_slot[int(slot)]
                r.output.append(int(tok))
                logprobs[r.slot].append(float(lp))
                if keep_logits:
                    r.logits.append(logits[row].float().cpu())
            steps += 1
        self._release(reqs)
        return OfflineResult([r.output for r in reqs], [r.logits for r in reqs], logprobs, steps)

    def _plan(self, sched: list[_Req], chunk_size: int, new: list[dict]) -> StepPlan:
        scheduled, page_tables = [], []
        for r in sched:
            if r.prefilling:
                toks = r.prompt[r.fed:r.fed + chunk_size]
                last = r.fed + len(toks) == len(r.prompt)
            else:
                toks = [r.forced[len(r.output) - 1] if r.forced is not None else r.output[-1]]
                last = True
            end = r.fed + len(toks)
            need = -(-end // self.page_size) - len(r.pages)
            if need > 0:
                if need > len(self.free_pages):
                    raise RuntimeError("offline scheduler ran out of KV pages")
                got = [self.free_pages.pop() for _ in range(need)]
                page_tables.append((r.slot, len(r.pages), got))
                r.pages.extend(got)
            scheduled.append((r.slot, r.fed, toks, last))
            r.fed = end
        self.step_id += 1
        return StepPlan.build(self.step_id, new=new, page_tables=page_tables, scheduled=scheduled)

    def _release(self, reqs: list[_Req]) -> None:
        for r in reqs:
            self.free_pages.extend(r.pages)
            r.pages = []
        plan = StepPlan.build(self.step_id + 1, finished=[r.slot for r in reqs])
        self.step_id += 1
        self.runner.forward(plan)  # type: ignore[attr-defined]
