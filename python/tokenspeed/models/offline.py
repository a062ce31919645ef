"""A toy scheduler that drives ModelRunner with real StepPlans: page allocation, chunked
prefill, batched decode. For tests and benchmarks that run without the Rust core."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from tokenspeed.plan import StepPlan


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

        `sampling` maps StepPlan `new_*` field suffixes (e.g. "temperature", "seed") to one value
        per prompt; greedy by default. `teacher` (teacher forcing): per prompt, the tokens fed as
        decode inputs (at least max_new_tokens - 1 of them) whatever the model samples; the
        result still reports what it sampled, so two models can be compared step by step.
        """
        reqs = [_Req(slot=i, prompt=list(p), max_new_tokens=max_new_tokens,
                     forced=list(teacher[i]) if teacher is not None else None)
                for i, p in enumerate(prompts)]
        n = len(reqs)
        sampling = sampling or {}
        new: dict[str, np.ndarray] = {
            "new_slots": np.arange(n, dtype=np.uint32),
            "new_temperature": _f32(sampling.get("temperature", [0.0] * n)),
            "new_top_p": _f32(sampling.get("top_p", [1.0] * n)),
            "new_top_k": np.asarray(sampling.get("top_k", [0] * n), np.int32),
            "new_min_p": _f32(sampling.get("min_p", [0.0] * n)),
            "new_repetition_penalty": _f32(sampling.get("repetition_penalty", [1.0] * n)),
            "new_frequency_penalty": _f32(sampling.get("frequency_penalty", [0.0] * n)),
            "new_presence_penalty": _f32(sampling.get("presence_penalty", [0.0] * n)),
            "new_seed": np.asarray(sampling.get("seed", [-1] * n), np.int64),
            "new_top_logprobs": np.asarray(sampling.get("top_logprobs", [0] * n), np.uint32),
        }
        logprobs: list[list[float]] = [[] for _ in reqs]
        steps = 0
        while not all(r.done for r in reqs):
            any_prefill = any(r.prefilling for r in reqs)
            sched = [r for r in reqs if not r.done and (
                r.prefilling or not (decode_after_all_prefills and any_prefill))]
            plan = self._plan(sched, chunk_size, new)
            new = {}
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

    def _plan(self, sched: list[_Req], chunk_size: int, new: dict[str, np.ndarray]) -> StepPlan:
        slots, num, start, sample, ids = [], [], [], [], []
        pt_slots, pt_first, pt_count, pt_pages = [], [], [], []
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
                pt_slots.append(r.slot)
                pt_first.append(len(r.pages))
                pt_count.append(need)
                pt_pages.extend(got)
                r.pages.extend(got)
            slots.append(r.slot)
            num.append(len(toks))
            start.append(r.fed)
            sample.append(int(last))
            ids.extend(toks)
            r.fed = end
        self.step_id += 1
        u32 = np.uint32
        return StepPlan(
            step_id=self.step_id, **new,
            pt_slots=np.asarray(pt_slots, u32), pt_first=np.asarray(pt_first, u32),
            pt_count=np.asarray(pt_count, u32), pt_pages=np.asarray(pt_pages, u32),
            slots=np.asarray(slots, u32), num_tokens=np.asarray(num, u32),
            start_pos=np.asarray(start, u32), sample=np.asarray(sample, np.uint8),
            input_ids=np.asarray(ids, u32))

    def _release(self, reqs: list[_Req]) -> None:
        for r in reqs:
            self.free_pages.extend(r.pages)
            r.pages = []
        plan = StepPlan(step_id=self.step_id + 1,
                        finished_slots=np.asarray([r.slot for r in reqs], np.uint32))
        self.step_id += 1
        self.runner.forward(plan)  # type: ignore[attr-defined]
