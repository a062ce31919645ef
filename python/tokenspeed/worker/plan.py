"""The step plan and result as the worker sees them: flat arrays named and typed by the schema
declared once in Rust (`rust/engine/src/plan.rs`), read here from `tokenspeed._core`.

A plan arrives from `WorkerChannel.recv()` as a dict of numpy views into shared memory (valid
until the next `recv()`); `StepPlan` gives attribute access to it. Array names are
`{section}_{field}`; a list field `f` comes as `{section}_f_len` (one length per row) and
`{section}_f` (all rows' elements). A result goes back as `StepOutput.arrays()`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from tokenspeed._core import LAST_SAMPLED, NO_SEED, neutral_sampling, plan_schema, result_schema

__all__ = [
    "LAST_SAMPLED",
    "NEUTRAL_SAMPLING",
    "NO_SEED",
    "PLAN_DTYPES",
    "RESULT_DTYPES",
    "StepOutput",
    "StepPlan",
]

PLAN_DTYPES: dict[str, np.dtype] = {name: np.dtype(dt) for name, dt in plan_schema()}
RESULT_DTYPES: dict[str, np.dtype] = {name: np.dtype(dt) for name, dt in result_schema()}
# What a request that sets nothing samples with (SamplingParams::neutral in Rust).
NEUTRAL_SAMPLING: dict[str, Any] = dict(neutral_sampling())


def _lists(rows: Iterable[Iterable[int]], dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    rows = [list(r) for r in rows]
    lens = np.asarray([len(r) for r in rows], np.uint32)
    flat = np.asarray([x for r in rows for x in r], dtype)
    return lens, flat


def new_request_rows(plan: StepPlan) -> list[tuple[int, dict[str, Any], dict[str, list]]]:
    """Per new request: its slot, its scalar sampling fields and its list fields, by schema name
    (`new_temperature` → "temperature"), so a field added to the schema reaches the sampler
    without a change here."""
    names = [n.removeprefix("new_") for n in PLAN_DTYPES if n.startswith("new_") and n != "new_slot"]
    lists = [n.removesuffix("_len") for n in names if n.endswith("_len")]
    scalars = [n for n in names if not n.endswith("_len") and n not in lists]
    ends = {f: np.cumsum(getattr(plan, f"new_{f}_len").astype(np.int64)) for f in lists}
    rows = []
    for i, slot in enumerate(plan.new_slot.tolist()):
        params = {f: getattr(plan, f"new_{f}")[i].item() for f in scalars}
        row_lists = {f: getattr(plan, f"new_{f}")[ends[f][i] - getattr(plan, f"new_{f}_len")[i]:ends[f][i]].tolist()
                     for f in lists}
        rows.append((slot, params, row_lists))
    return rows


class StepPlan:
    """One received plan: `plan.sched_slot`, `plan.new_temperature`, ... (see the module doc)."""

    def __init__(self, arrays: Mapping[str, Any]) -> None:
        self.__dict__.update(arrays)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> StepPlan:
        return cls(d)

    def copy(self) -> StepPlan:
        """A plan that owns its arrays (a received plan's are views into shared memory, valid
        until the next recv)."""
        return StepPlan({k: (np.array(v) if isinstance(v, np.ndarray) else v)
                         for k, v in self.__dict__.items()})

    @classmethod
    def of(cls, step_id: int = 0, **arrays: Any) -> StepPlan:
        """A plan from arrays by schema name; missing ones are empty. Unknown names are an
        error (a misspelt array would otherwise be silently empty)."""
        unknown = set(arrays) - set(PLAN_DTYPES)
        if unknown:
            raise KeyError(f"not plan arrays: {sorted(unknown)}")
        full = {n: np.asarray(arrays.get(n, ()), dt) for n, dt in PLAN_DTYPES.items()}
        return cls({"step_id": step_id, **full})

    @classmethod
    def build(cls, step_id: int = 0, *, finished: Iterable[int] = (),
              new: Iterable[Mapping[str, Any]] = (),
              page_tables: Iterable[tuple[int, int, Iterable[int]]] = (),
              copies: Iterable[tuple[int, ...]] = (),
              scheduled: Iterable[tuple[Any, ...]] = ()) -> StepPlan:
        """A plan from rows, for tests and offline drivers: `new` rows are dicts of sampling
        fields (unset ones are neutral, `slot` required); `page_tables` rows are
        (slot, first, pages) or (slot, first, pages, pool); `copies` rows are (src, dst) or (src, dst, kind) (kind 0: device
        to device); `scheduled` rows are (slot, start_pos, tokens, sample) or
        (slot, start_pos, tokens, sample, num_draft_tokens[, pause_drafts])."""
        a: dict[str, np.ndarray] = {n: np.zeros(0, dt) for n, dt in PLAN_DTYPES.items()}
        a["finished_slot"] = np.asarray(list(finished), PLAN_DTYPES["finished_slot"])
        new = [{**NEUTRAL_SAMPLING, **row} for row in new]
        lists = {n.removesuffix("_len") for n in PLAN_DTYPES if n.startswith("new_") and n.endswith("_len")}
        for name, dt in PLAN_DTYPES.items():
            field = name.removeprefix("new_")
            if name in lists:
                a[f"{name}_len"], a[name] = _lists((row.get(field, ()) for row in new), dt)
            elif name.startswith("new_") and not name.endswith("_len"):
                a[name] = np.asarray([row[field] for row in new], dt)
        pts = list(page_tables)
        a["pt_slot"] = np.asarray([p[0] for p in pts], PLAN_DTYPES["pt_slot"])
        a["pt_first"] = np.asarray([p[1] for p in pts], PLAN_DTYPES["pt_first"])
        a["pt_pages_len"], a["pt_pages"] = _lists((p[2] for p in pts), PLAN_DTYPES["pt_pages"])
        # An optional fourth element: the page table (1: the sliding-window layers').
        a["pt_pool"] = np.asarray([p[3] if len(p) > 3 else 0 for p in pts], PLAN_DTYPES["pt_pool"])
        cps = list(copies)
        a["copy_src"] = np.asarray([c[0] for c in cps], PLAN_DTYPES["copy_src"])
        a["copy_dst"] = np.asarray([c[1] for c in cps], PLAN_DTYPES["copy_dst"])
        a["copy_kind"] = np.asarray([c[2] if len(c) > 2 else 0 for c in cps], PLAN_DTYPES["copy_kind"])
        a["copy_key"] = np.asarray([c[3] if len(c) > 3 else 0 for c in cps], PLAN_DTYPES["copy_key"])
        sch = list(scheduled)
        a["sched_slot"] = np.asarray([r[0] for r in sch], PLAN_DTYPES["sched_slot"])
        a["sched_start_pos"] = np.asarray([r[1] for r in sch], PLAN_DTYPES["sched_start_pos"])
        a["sched_sample"] = np.asarray([bool(r[3]) for r in sch], PLAN_DTYPES["sched_sample"])
        # An optional fifth element: the row's draft tokens (the last ones of its tokens).
        a["sched_num_draft_tokens"] = np.asarray([r[4] if len(r) > 4 else 0 for r in sch],
                                                 PLAN_DTYPES["sched_num_draft_tokens"])
        # An optional sixth: speculation paused (a draft head drafts nothing after the step).
        a["sched_pause_drafts"] = np.asarray([bool(r[5]) if len(r) > 5 else False for r in sch],
                                             PLAN_DTYPES["sched_pause_drafts"])
        a["sched_tokens_len"], a["sched_tokens"] = _lists(
            (r[2] for r in sch), PLAN_DTYPES["sched_tokens"])
        return cls({"step_id": step_id, **a})

    def arrays(self) -> dict[str, bytes]:
        """The plan as {array name: little-endian bytes} (what the test writer sends)."""
        return {n: np.ascontiguousarray(getattr(self, n), dt).tobytes()
                for n, dt in PLAN_DTYPES.items()}


class StepOutput:
    """What one step produced: one event per scheduled request that sampled, in plan order.
    `top_ids`/`top_logprobs` are [n, k] (k = the most top logprobs any of them asked for;
    each event reports its own `top_k` columns). `prompt` maps a slot to its prompt logprobs
    (prompt_logprobs.PromptLogprobs): they join the slot's event, or make one without tokens for a
    prompt chunk that did not sample."""

    def __init__(self, slots: np.ndarray, tokens: np.ndarray, logprobs: np.ndarray,
                 top_ids: np.ndarray | None = None, top_logprobs: np.ndarray | None = None,
                 top_k: np.ndarray | None = None, prompt: Mapping[int, Any] | None = None,
                 counts: np.ndarray | None = None) -> None:
        n = len(slots)
        # Tokens per event (speculative decoding: accepted drafts + 1); None: one each. The
        # token, logprob and top rows are flat, event after event.
        self.counts = np.ones(n, np.int64) if counts is None else np.asarray(counts, np.int64)
        self.slots = np.asarray(slots, RESULT_DTYPES["event_slot"])
        self.tokens = np.asarray(tokens, RESULT_DTYPES["event_tokens"])
        self.logprobs = np.asarray(logprobs, RESULT_DTYPES["event_logprobs"])
        self.top_ids = np.zeros((n, 0), np.int64) if top_ids is None else top_ids
        self.top_logprobs = np.zeros((n, 0), np.float32) if top_logprobs is None else top_logprobs
        self.top_k = np.zeros(n, np.int64) if top_k is None else np.asarray(top_k)
        self.prompt = dict(prompt or {})
        # `RequestEvent::error` per event (None: all NONE); set by the worker's grammar backend.
        self.errors: np.ndarray | None = None
        # `StepTiming::gpu_idle_us`: the GPU's idle time between steps the worker measured
        # since its previous result (gpu_idle.py); None: no timing row.
        self.gpu_idle_us: int | None = None
        # `StepTiming::gpu_busy_us`: this step's run time on the GPU (0: not measured).
        self.gpu_busy_us = 0
        # A pooling step's vectors, [n, dim] float32 (`RequestEvent::pooled`; no tokens then).
        self.pooled: np.ndarray | None = None
        # `RequestEvent::draft_tokens` per event (EAGLE-3's proposal; None: no drafter).
        self.draft_tokens: list[np.ndarray] | None = None

    def arrays(self) -> dict[str, bytes]:
        """{result array name: bytes}: one accepted token per event; each event's top-k rows
        cut to the k it asked for."""
        n = len(self.slots)
        k = np.minimum(self.top_k.astype(np.int64), self.top_ids.shape[1] if self.top_ids.ndim == 2 else 0)
        row_k = np.repeat(k, self.counts)  # per token row
        keep = np.arange(self.top_ids.shape[1] if self.top_ids.ndim == 2 else 0)[None, :] < row_k[:, None]
        ones = self.counts.astype(np.uint32).tobytes()
        d = RESULT_DTYPES
        out = {
            "event_slot": self.slots.tobytes(),
            "event_top_k": k.astype(d["event_top_k"]).tobytes(),
            "event_tokens_len": ones,
            "event_tokens": self.tokens.tobytes(),
            "event_logprobs_len": ones,
            "event_logprobs": self.logprobs.tobytes(),
            "event_top_ids_len": (k * self.counts).astype(np.uint32).tobytes(),
            "event_top_ids": np.asarray(self.top_ids[keep], d["event_top_ids"]).tobytes(),
            "event_top_logprobs_len": (k * self.counts).astype(np.uint32).tobytes(),
            "event_top_logprobs": np.asarray(self.top_logprobs[keep], d["event_top_logprobs"]).tobytes(),
        }
        if self.pooled is not None:
            out = self._with_pooled(out)
        out = self._with_prompt(out, k) if self.prompt else out
        if self.errors is not None:  # prompt-only events (appended) have none
            events = len(out["event_slot"]) // RESULT_DTYPES["event_slot"].itemsize
            errors = np.zeros(events, d["event_error"])
            errors[:n] = self.errors
            out["event_error"] = errors.tobytes()
        if self.draft_tokens is not None:  # prompt-only events (appended) have none
            events = len(out["event_slot"]) // RESULT_DTYPES["event_slot"].itemsize
            lens = [len(t) for t in self.draft_tokens] + [0] * (events - n)
            out["event_draft_tokens_len"] = np.asarray(lens, np.uint32).tobytes()
            out["event_draft_tokens"] = np.concatenate(
                [np.zeros(0, d["event_draft_tokens"]), *self.draft_tokens]).astype(
                d["event_draft_tokens"]).tobytes()
        if self.gpu_idle_us is not None:
            out["timing_gpu_idle_us"] = np.asarray([self.gpu_idle_us], d["timing_gpu_idle_us"]).tobytes()
            out["timing_gpu_busy_us"] = np.asarray([self.gpu_busy_us], d["timing_gpu_busy_us"]).tobytes()
        return out

    def _with_pooled(self, out: dict[str, bytes]) -> dict[str, bytes]:
        """A pooling step's events: each request's vector, no tokens."""
        assert self.pooled is not None
        n, dim = self.pooled.shape if self.pooled.ndim == 2 else (len(self.slots), 0)
        none = np.zeros(n, np.uint32).tobytes()
        return out | {
            "event_tokens_len": none, "event_tokens": b"",
            "event_logprobs_len": none, "event_logprobs": b"",
            "event_pooled_len": np.full(n, dim, np.uint32).tobytes(),
            "event_pooled": np.ascontiguousarray(self.pooled, RESULT_DTYPES["event_pooled"]).tobytes(),
        }

    def _with_prompt(self, out: dict[str, bytes], k: np.ndarray) -> dict[str, bytes]:
        """Adds the prompt logprobs: on the slot's sampled event, or on a new token-less event
        (whose top_k is the prompt's own)."""
        d = RESULT_DTYPES
        slots = self.slots.tolist()
        extra = [s for s in self.prompt if s not in slots]
        ks = k.astype(np.int64).tolist() + [self.prompt[s].top_ids.shape[1] for s in extra]
        order = slots + extra

        def cols(name: str, dtype: Any) -> np.ndarray:
            return np.frombuffer(out[name], dtype)

        lens = {name: cols(f"{name}_len", np.uint32).tolist() + [0] * len(extra)
                for name in ("event_tokens", "event_logprobs", "event_top_ids", "event_top_logprobs")}
        res = dict(out)
        res["event_slot"] = np.asarray(order, d["event_slot"]).tobytes()
        res["event_top_k"] = np.asarray(ks, d["event_top_k"]).tobytes()
        for name, values in lens.items():
            res[f"{name}_len"] = np.asarray(values, np.uint32).tobytes()
        p_lp, p_ids, p_tlp, p_rank, p_lens, p_top_lens = [], [], [], [], [], []
        for slot, kk in zip(order, ks):
            p = self.prompt.get(slot)
            if p is None:
                p_lens.append(0)
                p_top_lens.append(0)
                continue
            m = len(p.logprobs)
            p_lp.append(np.asarray(p.logprobs, d["event_prompt_logprobs"]))
            p_ids.append(np.asarray(p.top_ids[:, :kk], d["event_prompt_top_ids"]).reshape(-1))
            p_tlp.append(np.asarray(p.top_logprobs[:, :kk], d["event_prompt_top_logprobs"]).reshape(-1))
            p_rank.append(np.asarray(p.ranks, d["event_prompt_ranks"]))
            p_lens.append(m)
            p_top_lens.append(m * min(kk, p.top_ids.shape[1]))
        res["event_prompt_logprobs_len"] = np.asarray(p_lens, np.uint32).tobytes()
        res["event_prompt_logprobs"] = np.concatenate(p_lp).tobytes() if p_lp else b""
        res["event_prompt_top_ids_len"] = np.asarray(p_top_lens, np.uint32).tobytes()
        res["event_prompt_top_ids"] = np.concatenate(p_ids).tobytes() if p_ids else b""
        res["event_prompt_top_logprobs_len"] = np.asarray(p_top_lens, np.uint32).tobytes()
        res["event_prompt_top_logprobs"] = np.concatenate(p_tlp).tobytes() if p_tlp else b""
        res["event_prompt_ranks_len"] = res["event_prompt_logprobs_len"]
        res["event_prompt_ranks"] = np.concatenate(p_rank).tobytes() if p_rank else b""
        return res
