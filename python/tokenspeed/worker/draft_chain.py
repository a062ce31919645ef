"""Chain drafting in the worker, for one-layer draft heads over the target's hidden states:
EAGLE-3 (models/eagle3.py) and DeepSeek's MTP layer (NEXTN, models/deepseek_mtp.py). After a
step the head proposes each sampled request's next `k` tokens, which ride back in the step's
result (`RequestEvent::draft_tokens`) and become the request's drafts in its next step,
verified by spec_verify.py like NGRAM's (the scheduler's path: exactness, KV rewind, radix
cache). The heads differ only in what they capture from the target, how they project it and
their layer (`DraftHead`); rows, KV and the chain are this module's.

The head's KV. The head is one attention layer over all earlier positions of the request, so
it keeps K/V per position (the same kind of cache as the target's layers: per-head K and V, or
MLA's latent). They live in a one-layer PagedKVCache beside the target's pool whose
first pages mirror the target's page ids, so position p of a request sits at the same flat
index as its target KV. Pages, their allocation, release and the radix cache's sharing then
hold for the head as they do for the target, with no second allocator (a cached prefix reused
by another request brings the head's KV with it; only its last position's entry was computed
with the first request's next token, which can cost a draft, never a wrong output). Only
*verified* positions are written there: the entry of position p needs the token at p + 1, so
after each step the head runs over the step's positions whose next token is now known (the
prompt's, the accepted ones; a prompt chunk's last position waits for the next chunk, its
target hidden state carried meanwhile).

The chain's own speculative positions never go into those pages: the scheduler allocates
pages only for the tokens it feeds (rust/engine scheduler/step.rs `schedule_chunk`), so after
a step the pages of positions past the last sampled token may not be the request's (their
page-table entries are stale, maybe another request's pages). They go to scratch pages after
the pool's, a few per chain row (draft_rows.py `chain_layout`): the chain reads through the
head cache's own page table, whose rows are the requests' rows with the page holding the first
draft position and those after it swapped for scratch pages (the verified entries of that page
copied in first). A rejected draft then leaves nothing behind, and nothing is overwritten.

Both passes (the step's verified rows, then each chain step over all drafting requests at once)
run the head's attention as one batched call of the configured attention backend, over that
cache, as the target's layers do. Host work is numpy over the whole step; one host → device
transfer carries every index array and one device → host copy brings the drafts back. It runs
once per step, after the step's tokens reach the host (the next plan, if the engine sent it
one step ahead, waits meanwhile; it does so only while speculation is paused): after a pure
verify step whose target forward replayed a verify graph
(worker/verify_graph.py), as CUDA graphs of the whole drafting (worker/draft_graph.py);
after any other step (prompt chunks, mixed steps, no graphs, MLA heads), eagerly.

While the scheduler has speculation turned off (`ScheduledRequest::pause_drafts`, its
spec_gate.rs), a row draws no chain: the head's pass over its verified positions still runs (a
"chain-less head pass", in the draft graphs' pass-alone graph where they hold), so its KV covers
every position when drafting resumes. Those paused steps may be planned one step ahead (the
overlap scheduler): a request's input is then `LAST_SAMPLED`, which the target's forward
resolves on the device; its head row reads only the token the step sampled.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from tokenspeed.distributed.groups import (
    dp_token_counts,
    group_counts,
    state,
    sync_sampled_tokens,
)
from tokenspeed.layers.attention import ForwardBatch, check_layers, padding_batch
from tokenspeed.layers.attention_backends import backend_memory_bytes, create_backend
from tokenspeed.layers.host_copy import to_device_int64
from tokenspeed.layers.kv_cache import PagedKVCache
from tokenspeed.layers.moe import FusedMoE
from tokenspeed.worker.draft_rows import ChainLayout, HeadRows, chain_layout, scratch_pages, step_rows
from tokenspeed.worker.pending_step import PendingStep
from tokenspeed.worker.plan import StepOutput, StepPlan

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DraftSpec:
    """Which head drafts (`--speculative-algorithm` EAGLE3 or NEXTN), where its weights are
    (NEXTN: the target's checkpoint unless given) and how many drafts it chains per step."""

    algorithm: str
    path: str | None
    num_steps: int


class DraftHead(Protocol):
    """What the drafter needs of a head (an nn.Module whose attention reads the batch's
    backend over its one-layer cache, layer 0)."""

    capture_width: int  # features per position of the target's captured hidden states
    kv_layout: dict  # num_kv_heads, head_dim, v_from_k, num_heads of its cache and backend
    dtype: torch.dtype

    def capture_layers(self, target_layers: int) -> tuple[int, ...]: ...
    def from_target(self, captured: torch.Tensor) -> torch.Tensor: ...
    def layer(self, ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
              batch: ForwardBatch) -> torch.Tensor: ...
    def draft_ids(self, out: torch.Tensor) -> torch.Tensor: ...
    def describe(self) -> str: ...


def load_head(spec: DraftSpec, target: torch.nn.Module, target_path: str, **kw: Any) -> DraftHead:
    """The head of `spec` for `target` (kw: dtype, device, max_positions, dummy, seed, fp8: the
    target's FP8 setup, which an FP8 checkpoint's MTP layer loads with too)."""
    fp8 = kw.pop("fp8", None)
    if spec.algorithm == "EAGLE3":  # its own checkpoint, in the dtype
        from tokenspeed.models.eagle3 import load_eagle3_head

        return load_eagle3_head(target, spec.path or "", **kw)
    if spec.algorithm == "NEXTN":
        from tokenspeed.models.deepseek_mtp import load_mtp_head

        return load_mtp_head(target, spec.path or target_path, fp8=fp8, **kw)
    raise ValueError(f"speculative algorithm {spec.algorithm!r} has no draft head")


def load_drafter(runner: Any, spec: DraftSpec | None, model_path: str, load_format: str,
                 seed: int) -> ChainDrafter | None:
    """The runner's drafter (None without a draft head). Built before the runner's memory
    profile, which then counts the head's weights, the captured hidden states, its KV per page
    (`runner.draft_page_bytes`) and its fixed buffers (`runner.draft_fixed_bytes`: chain
    scratch pages, carried hidden states, the head's attention backend); the runner replays
    verify graphs with it (worker/verify_graph.py) and attaches its KV later."""
    runner.draft_page_bytes = runner.draft_fixed_bytes = 0
    if spec is None:
        return None
    head = load_head(spec, runner.model, model_path, dtype=runner.dtype, device=runner.device,
                     max_positions=runner.max_context_len + spec.num_steps + 1,
                     dummy=load_format == "dummy", seed=seed, fp8=runner.fp8)
    drafter = ChainDrafter(head, runner.model, num_steps=spec.num_steps, device=runner.device)
    kv_dtype = runner.dtype if runner.kv_dtype.itemsize == 1 else runner.kv_dtype
    kv = head.kv_layout
    page = PagedKVCache.bytes_per_page(
        num_layers=1, page_size=runner.page_size, num_kv_heads=kv["num_kv_heads"],
        head_dim=kv["head_dim"], dtype=kv_dtype, v_from_k=bool(kv["v_from_k"]))
    runner.draft_page_bytes = page
    carry = head.capture_width * runner.dtype.itemsize
    runner.draft_fixed_bytes = runner.max_slots * (
        scratch_pages(spec.num_steps, runner.page_size) * page + carry
    ) + backend_memory_bytes(runner.attention_backend, 0)
    return drafter


class DraftGraphs(Protocol):
    """What the drafter asks of its CUDA graphs (worker/draft_graph.py `DraftGraphRunner`)."""

    def holds(self, rows: HeadRows, chain: ChainLayout, aux: torch.Tensor) -> bool: ...
    def run(self, rows: HeadRows, chain: ChainLayout) -> np.ndarray: ...


class ChainDrafter:
    """A draft head, its KV beside the target's pool, and the drafting after each step."""

    def __init__(self, head: DraftHead, target: torch.nn.Module, *, num_steps: int,
                 device: torch.device) -> None:
        """Sets the target's capture; `attach` gives the head its KV once the pool is sized
        (the head's weights and captured states count in the memory profile)."""
        self.head = head
        self.num_steps = num_steps
        self.device = device
        layers = head.capture_layers(len(target.model.layers))
        target.model.capture_layers = layers  # models/llama.py: the residual stream there
        self.aux: torch.Tensor | None = None  # the last forward's captured hidden states
        self.pool: PagedKVCache | None = None  # the target's (its page table)
        self.cache: PagedKVCache | None = None  # the head's, and its attention backend
        self.backend: Any = None
        # Its CUDA graphs after pure verify steps (worker/draft_graph.py's DraftGraphRunner,
        # which imports this module: so a Protocol here); None: eager only.
        self.graphs: DraftGraphs | None = None
        # Per slot: the position of a prompt chunk's last token (-1: none) whose next token is
        # the next chunk's first, and (`carry_aux`, on the device) its target hidden state.
        self.carry_pos = np.zeros(0, np.int64)
        self.carry_aux = torch.zeros(0, device=device)
        # Data-parallel attention with MoE layers (the target's and the head's): every
        # rank runs every draft pass together (`lockstep_passes`); `idle`: a one-page cache and
        # backend for a group's padding pass when it has no rows of its own.
        self.lockstep = False
        self.idle: tuple[PagedKVCache, Any] | None = None
        self.backend_kind = ""
        logger.info("draft head: %s; %d draft tokens per step (chain), target layers captured "
                    "%s", head.describe(), num_steps, layers)

    def attach(self, kv_cache: PagedKVCache, backend: str, lockstep: bool = False) -> None:
        """The head's KV (one layer: the pool's pages, then the chain's scratch pages) and
        its attention backend (`backend`, the target's kind); `lockstep`: the runner's (every
        rank runs every forward pass, draft passes included)."""
        kv, ps = self.head.kv_layout, kv_cache.page_size
        # Only a head with MoE layers (NEXTN's) meets the other attention groups.
        moe = any(isinstance(m, FusedMoE) for m in self.head.modules())  # type: ignore[attr-defined]
        self.lockstep, self.backend_kind = lockstep and moe, backend
        per = scratch_pages(self.num_steps, ps)
        dtype = kv_cache.dtype if kv_cache.k[0].element_size() > 1 else self.head.dtype
        self.pool = kv_cache
        self.cache = PagedKVCache(
            num_layers=1, num_pages=kv_cache.num_pages + kv_cache.max_slots * per, page_size=ps,
            num_kv_heads=kv["num_kv_heads"], head_dim=kv["head_dim"], dtype=dtype,
            device=self.device, max_slots=kv_cache.max_slots,
            max_context_len=(kv_cache.max_pages_per_slot + per) * ps, v_from_k=kv["v_from_k"])
        kv_cache.companions.append(self.cache)  # page copies (a shared prefix's) bring its KV
        self.backend = create_backend(backend, self.cache, num_heads=kv["num_heads"],
                                      head_dim=kv["head_dim"], q_dtype=self.head.dtype)
        check_layers(self.backend, self.head)  # type: ignore[arg-type]
        self.carry_pos = np.full(kv_cache.max_slots, -1, np.int64)
        self.carry_aux = torch.zeros(kv_cache.max_slots, self.head.capture_width,
                                     dtype=self.head.dtype, device=self.device)

    def _caches(self) -> tuple[PagedKVCache, PagedKVCache]:
        if self.pool is None or self.cache is None:
            raise RuntimeError("drafter used before attach(kv_cache)")
        return self.pool, self.cache

    def after(self, plan: StepPlan, step: PendingStep) -> PendingStep:
        """Waits for the step's tokens, then proposes each request's next drafts, which go
        back in the step's result."""
        out, aux = step.wait(), self.aux
        self.aux = None
        if aux is not None:
            out.draft_tokens = self.propose(plan, aux, out)
        return PendingStep.done(out)

    @torch.inference_mode()
    def propose(self, plan: StepPlan, aux: torch.Tensor, out: StepOutput) -> list[np.ndarray]:
        """Draft tokens per event of `out` (its order), after the step `plan` whose target
        forward captured `aux` [tokens, head.capture_width]; writes the head's KV of every
        position whose next token is now known."""
        pool, _ = self._caches()
        self.carry_pos[plan.finished_slot.astype(np.int64)] = -1
        rows = step_rows(plan, out, self.carry_pos, pool.page_table_host, pool.page_size)
        none = np.zeros(0, np.int64)
        counts = self.lockstep_passes(len(rows.positions), int(np.count_nonzero(rows.drafts)))
        if not len(rows.positions) and not len(rows.new_carry_slots):
            return [none] * len(out.slots)
        chain = chain_layout(rows, self.num_steps, pool.page_size, pool.num_pages,
                             pool.page_table_host)
        if self.graphs is not None and len(rows.positions) and self.graphs.holds(rows, chain, aux):
            return self._by_event(self.graphs.run(rows, chain), chain, out)
        d = self._upload(rows, chain)
        drafts = None
        if len(rows.positions):
            with dp_token_counts(counts[0]):
                outs = self._verified(rows, d, aux)
            if len(chain.rows):
                with dp_token_counts(counts[1]):
                    drafts = self._chain(chain, d, outs[d["last_row"]]).cpu().numpy()
        if len(rows.new_carry_slots):  # after the rows above read the slots' previous carry
            self.carry_aux[d["new_carry_slots"]] = aux[d["new_carry_rows"]].to(self.carry_aux.dtype)
        if drafts is None:
            return [none] * len(out.slots)
        return self._by_event(drafts, chain, out)

    def lockstep_passes(self, verified: int, chained: int) -> tuple[list[int] | None, ...]:
        """Data-parallel attention with MoE layers (`lockstep`): the MTP layer's MoE exchange
        spans the attention groups, so every rank runs each draft pass (the verified rows, then
        each chain step) when any group has rows for it: the groups' row counts are gathered
        here, and a group without rows runs the pass on one padding row (`_idle_pass`) while
        the others run theirs (which the caller does in each pass's returned counts). Returns
        the `dp_token_counts` of the verified pass and of the chain's (None: no lockstep)."""
        if not self.lockstep:
            return None, None
        chained = chained if self.num_steps > 1 else 0
        v, c = group_counts(verified, chained)
        mine = state().attn_group
        counts = ([max(n, 1) for n in v] if any(v) else None,
                  [max(n, 1) for n in c] if any(c) else None)
        if counts[0] is not None and not v[mine]:
            with dp_token_counts(counts[0]):
                self._idle_pass()
        if counts[1] is not None and not c[mine]:
            with dp_token_counts(counts[1]):
                for _ in range(1, self.num_steps):
                    self._idle_pass()
        return counts

    def _idle_pass(self) -> None:
        """The head's layer on one padding row over a one-page scratch cache (nothing kept):
        this rank's part of a lockstep draft pass its group has no rows for."""
        if self.idle is None:
            kv, cache = self.head.kv_layout, self._caches()[1]
            scratch = PagedKVCache(
                num_layers=1, num_pages=1, page_size=cache.page_size,
                num_kv_heads=kv["num_kv_heads"], head_dim=kv["head_dim"], dtype=cache.dtype,
                device=self.device, max_slots=1, max_context_len=cache.page_size,
                v_from_k=kv["v_from_k"])
            self.idle = (scratch, create_backend(self.backend_kind, scratch,
                                                 num_heads=kv["num_heads"],
                                                 head_dim=kv["head_dim"], q_dtype=self.head.dtype))
        batch = padding_batch(*self.idle, self.device)
        hidden = torch.zeros(1, self.head.capture_width, dtype=self.head.dtype, device=self.device)
        self.head.layer(batch.input_ids, self.head.from_target(hidden), batch.positions, batch)

    def _by_event(self, drafts: np.ndarray, chain: ChainLayout, out: StepOutput) -> list[np.ndarray]:
        """The chain rows' drafts [C, k] per event of `out` (none for a request that drew none)."""
        where = np.full(len(self.carry_pos), -1, np.int64)
        where[chain.slots] = np.arange(len(chain.rows))
        none = np.zeros(0, np.int64)
        return [drafts[i] if i >= 0 else none
                for i in where[np.asarray(out.slots, np.int64)].tolist()]

    def _upload(self, rows: HeadRows, chain: ChainLayout) -> dict[str, torch.Tensor]:
        """Every index array of the step's drafting, on the device in one transfer."""
        steps, c = self.num_steps, len(chain.rows)
        pos = chain.positions.reshape(max(steps - 1, 0), c)
        host = {
            "positions": rows.positions, "next_ids": rows.next_ids, "locs": rows.locs,
            "aux_rows": rows.aux_rows, "carried_at": rows.carried_at,
            "carried_slots": rows.carried_slots, "new_carry_slots": rows.new_carry_slots,
            "new_carry_rows": rows.new_carry_rows, "slots": rows.slots,
            # the verified pass's ForwardBatch.request_arrays (rows of the head's page table)
            "v_rows": np.arange(len(rows.slots)), "v_seq_lens": rows.start_pos + rows.num_tokens,
            "v_query_start": rows.query_start, "v_start_pos": rows.start_pos,
            "last_row": chain.last_row, "chain_slots": chain.slots,
            "chain_positions": chain.positions, "chain_locs": chain.locs,
            "table_rows": chain.table_rows, "table_cols": chain.table_cols,
            "table_pages": chain.table_pages, "copy_src": chain.copy_src,
            "copy_dst": chain.copy_dst, "c_rows": np.arange(c), "c_query_start": np.arange(c + 1),
            "c_seq_lens": (pos + 1).reshape(-1)}
        return dict(zip(host, to_device_int64(list(host.values()), self.device)))

    def _rows_of(self, slots: np.ndarray, slots_dev: torch.Tensor, width: int) -> None:
        """Rows 0 ... len(slots) - 1 of the head's page table (host and device) = the first
        `width` entries of these slots' rows in the target's."""
        pool, cache = self._caches()
        n = len(slots)
        cache.page_table_host[:n, :width] = pool.page_table_host[slots, :width]
        cache.page_table[:n, :width] = pool.page_table[slots_dev, :width]

    def _verified(self, rows: HeadRows, d: dict[str, torch.Tensor],
                  aux: torch.Tensor) -> torch.Tensor:
        """The head over the step's rows, their K/V written into the pool's pages, as one
        batch of the attention backend; the layer's output per row."""
        pool, cache = self._caches()
        head = self.head
        src = aux.index_select(0, d["aux_rows"])
        if len(rows.carried_at):
            src[d["carried_at"]] = self.carry_aux[d["carried_slots"]].to(src.dtype)
        hidden = head.from_target(src.to(head.dtype))
        last = rows.start_pos + rows.num_tokens  # context lengths after this pass
        self._rows_of(rows.slots, d["slots"], int(-(-last.max() // pool.page_size)))
        batch = ForwardBatch(
            input_ids=d["next_ids"], positions=d["positions"], out_cache_loc=d["locs"],
            slots=np.arange(len(rows.slots)), num_tokens=rows.num_tokens,
            start_pos=rows.start_pos, query_start=rows.query_start, kv_cache=cache,
            backend=self.backend, request_arrays=(d["v_rows"], d["v_seq_lens"],
                                                  d["v_query_start"], d["v_start_pos"]))
        self.backend.prepare(batch)
        return head.layer(d["next_ids"], hidden, d["positions"], batch)

    def _chain(self, chain: ChainLayout, d: dict[str, torch.Tensor],
               outs: torch.Tensor) -> torch.Tensor:
        """`num_steps` greedy drafts per drafting request [C, steps]: the first from the layer
        output at its last verified position, each next one by running the head one position
        further on the draft before it and that output, all requests in one backend call per
        step, their K/V in the scratch pages (see the module doc)."""
        _, cache = self._caches()
        head, c = self.head, len(chain.rows)
        # Every rank of the attention group keeps rank 0's drafts: the next chain step's
        # (vocab-parallel) embedding and sharded layer must see the same ids on every rank.
        tokens = [sync_sampled_tokens(head.draft_ids(outs))]
        if self.num_steps > 1:
            self._rows_of(chain.slots, d["chain_slots"], chain.width)
            cache.page_table_host[chain.table_rows, chain.table_cols] = chain.table_pages
            cache.page_table[d["table_rows"], d["table_cols"]] = d["table_pages"].to(torch.int32)
            if len(chain.copy_src):
                cache.k[0][d["copy_dst"]] = cache.k[0][d["copy_src"]]
                if not cache.v_from_k:  # else V is part of K, copied with it
                    cache.v[0][d["copy_dst"]] = cache.v[0][d["copy_src"]]
        rows, ones = np.arange(c), np.ones(c, np.int64)
        for j in range(1, self.num_steps):  # the scheduler cuts drafts past the context
            at = slice((j - 1) * c, j * c)
            pos, start = d["chain_positions"][at], chain.positions[at]
            batch = ForwardBatch(
                input_ids=tokens[-1], positions=pos, out_cache_loc=d["chain_locs"][at],
                slots=rows, num_tokens=ones, start_pos=start, query_start=np.arange(c + 1),
                kv_cache=cache, backend=self.backend,
                request_arrays=(d["c_rows"], d["c_seq_lens"][at], d["c_query_start"], pos))
            self.backend.prepare(batch)
            outs = head.layer(tokens[-1], outs, pos, batch)
            tokens.append(sync_sampled_tokens(head.draft_ids(outs)))
        return torch.stack(tokens, dim=1)
