"""EAGLE-3 drafting in the worker: after a step, the draft head (models/eagle3.py) proposes
each sampled request's next `k` tokens, which ride back in the step's result
(`RequestEvent::draft_tokens`) and become the request's drafts in its next step, verified by
spec_verify.py like NGRAM's (the scheduler's path: exactness, KV rewind, radix cache).

The head's KV. The head is one attention layer over all earlier positions of the request, so
it keeps K/V per position. They live in a one-layer PagedKVCache beside the target's pool whose
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
the pool's, a few per chain row (eagle3_rows.py `chain_layout`): the chain reads through the
head cache's own page table, whose rows are the requests' rows with the page holding the first
draft position and those after it swapped for scratch pages (the verified entries of that page
copied in first). A rejected draft then leaves nothing behind, and nothing is overwritten.

Both passes (the step's verified rows, then each chain step over all drafting requests at once)
run the head's attention as one batched call of the configured attention backend, over that
cache, as the target's layers do. Host work is numpy over the whole step; one host → device
transfer carries every index array and one device → host copy brings the drafts back. It runs
eagerly, once per step, after the step's tokens reach the host: no CUDA graphs yet, no overlap
(the launcher turns overlap off).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tokenspeed.layers.attention import Attention, ForwardBatch
from tokenspeed.layers.attention_backends import backend_memory_bytes, create_backend
from tokenspeed.layers.host_copy import to_device_int64
from tokenspeed.layers.kv_cache import PagedKVCache
from tokenspeed.models.eagle3 import Eagle3Config, Eagle3Head
from tokenspeed.models.weights import init_dummy_weights
from tokenspeed.worker.eagle3_rows import ChainLayout, HeadRows, chain_layout, scratch_pages, step_rows
from tokenspeed.worker.pending_step import PendingStep
from tokenspeed.worker.plan import StepOutput, StepPlan

logger = logging.getLogger(__name__)


def read_head_tensors(path: str | Path) -> dict[str, torch.Tensor] | None:
    """The head's tensors (*.safetensors, else pytorch_model.bin); None: the directory has
    only a config (a dummy head)."""
    root = Path(path)
    files = sorted(root.glob("*.safetensors"))
    if files:
        from safetensors.torch import load_file

        out: dict[str, torch.Tensor] = {}
        for f in files:
            out.update(load_file(str(f)))
        return out
    if (root / "pytorch_model.bin").exists():
        return torch.load(root / "pytorch_model.bin", map_location="cpu", weights_only=True)
    return None


def load_drafter(runner: Any, eagle3: tuple[str, int] | None, load_format: str,
                 seed: int) -> Eagle3Drafter | None:
    """The runner's EAGLE-3 drafter (`eagle3`: the head's path and its drafts per step), or
    None. Built before the runner's memory profile, which then counts the head's weights, the
    captured hidden states, its KV per page (`runner.draft_page_bytes`) and its fixed buffers
    (`runner.draft_fixed_bytes`: chain scratch pages, carried hidden states, the head's
    attention backend); the runner runs eagerly with it (no graph captures the hidden states)
    and attaches its KV later."""
    runner.draft_page_bytes = runner.draft_fixed_bytes = 0
    if eagle3 is None:
        return None
    drafter = Eagle3Drafter(eagle3[0], runner.model, num_steps=eagle3[1], dtype=runner.dtype,
                            device=runner.device, max_positions=runner.max_context_len,
                            dummy=load_format == "dummy", seed=seed)
    kv_dtype = runner.dtype if runner.kv_dtype.itemsize == 1 else runner.kv_dtype
    page = Eagle3Drafter.bytes_per_page(drafter.cfg, runner.page_size, kv_dtype)
    runner.draft_page_bytes = page
    carry = 3 * drafter.cfg.target_hidden_size * runner.dtype.itemsize
    runner.draft_fixed_bytes = runner.max_slots * (
        scratch_pages(drafter.num_steps, runner.page_size) * page + carry
    ) + backend_memory_bytes(runner.attention_backend, 0)
    return drafter


class Eagle3Drafter:
    """The head, its KV beside the target's pool, and the drafting after each step."""

    def __init__(self, path: str, target: torch.nn.Module, *, num_steps: int,
                 dtype: torch.dtype, device: torch.device, max_positions: int, dummy: bool,
                 seed: int) -> None:
        """Loads the head and sets the target's capture; `attach` gives it its KV once the
        pool is sized (the head's weights and captured states count in the memory profile)."""
        self.cfg = cfg = Eagle3Config.load(path)
        self.num_steps = num_steps
        self.target = target
        self.max_positions = max_positions
        self.device = device
        with torch.device(device):
            head = Eagle3Head(cfg, max_positions + num_steps + 1)
        tensors = read_head_tensors(path)
        if tensors is None:
            if not dummy:
                raise ValueError(f"--speculative-draft-model-path {path}: no *.safetensors or "
                                 "pytorch_model.bin (a config alone needs --load-format dummy)")
            init_dummy_weights(head, seed + 1)
        else:
            head.load(tensors)
        for name, module in head.named_children():
            if name != "rotary":  # RoPE tables stay float32
                module.to(dtype)
        self.head = head.eval().requires_grad_(False)
        self.attn = Attention(0, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.head_dim ** -0.5)
        layers = cfg.capture_layers(len(target.model.layers))
        target.model.capture_layers = layers  # models/llama.py: the residual stream there
        self.aux: torch.Tensor | None = None  # the last forward's captured hidden states
        self.pool: PagedKVCache | None = None  # the target's (its page table)
        self.cache: PagedKVCache | None = None  # the head's, and its attention backend
        self.backend: Any = None
        # Per slot: the position of a prompt chunk's last token (-1: none) whose next token is
        # the next chunk's first, and (`carry_aux`, on the device) its target hidden state.
        self.carry_pos = np.zeros(0, np.int64)
        self.carry_aux = torch.zeros(0, device=device)
        logger.info("EAGLE-3 head %s: %d draft tokens per step (chain), draft vocabulary %d, "
                    "target layers %s", path, num_steps, cfg.draft_vocab_size, layers)

    def attach(self, kv_cache: PagedKVCache, backend: str) -> None:
        """The head's KV (one layer: the pool's pages, then the chain's scratch pages) and
        its attention backend (`backend`, the target's kind)."""
        c, ps = self.cfg, kv_cache.page_size
        per = scratch_pages(self.num_steps, ps)
        dtype = kv_cache.dtype if kv_cache.k[0].element_size() > 1 else self.head.fc.weight.dtype
        self.pool = kv_cache
        self.cache = PagedKVCache(
            num_layers=1, num_pages=kv_cache.num_pages + kv_cache.max_slots * per, page_size=ps,
            num_kv_heads=c.num_kv_heads, head_dim=c.head_dim, dtype=dtype, device=self.device,
            max_slots=kv_cache.max_slots, max_context_len=(kv_cache.max_pages_per_slot + per) * ps)
        kv_cache.companions.append(self.cache)  # page copies (a shared prefix's) bring its KV
        self.backend = create_backend(backend, self.cache, num_heads=c.num_heads,
                                      head_dim=c.head_dim, q_dtype=self.head.fc.weight.dtype)
        self.carry_pos = np.full(kv_cache.max_slots, -1, np.int64)
        self.carry_aux = torch.zeros(kv_cache.max_slots, 3 * c.target_hidden_size,
                                     dtype=self.head.fc.weight.dtype, device=self.device)

    @staticmethod
    def bytes_per_page(cfg: Eagle3Config, page_size: int, dtype: torch.dtype) -> int:
        """The head's share of one KV page (its one layer's K and V)."""
        elem = torch.empty(0, dtype=dtype).element_size()
        return 2 * page_size * cfg.num_kv_heads * cfg.head_dim * elem

    def _caches(self) -> tuple[PagedKVCache, PagedKVCache]:
        if self.pool is None or self.cache is None:
            raise RuntimeError("EAGLE-3 drafter used before attach(kv_cache)")
        return self.pool, self.cache

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        e = self.head.embed_tokens
        return e(ids) if e is not None else self.target.model.embed_tokens(ids)

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
        forward captured `aux` [tokens, 3 * target_hidden]; writes the head's KV of every
        position whose next token is now known."""
        pool, _ = self._caches()
        self.carry_pos[plan.finished_slot.astype(np.int64)] = -1
        rows = step_rows(plan, out, self.carry_pos, pool.page_table_host, pool.page_size)
        none = np.zeros(0, np.int64)
        if not len(rows.positions) and not len(rows.new_carry_slots):
            return [none] * len(out.slots)
        chain = chain_layout(rows, self.num_steps, pool.page_size, pool.num_pages,
                             pool.page_table_host)
        d = self._upload(rows, chain)
        drafts = None
        if len(rows.positions):
            outs = self._verified(rows, d, aux)
            if len(chain.rows):
                drafts = self._chain(chain, d, outs[d["last_row"]]).cpu().numpy()
        if len(rows.new_carry_slots):  # after the rows above read the slots' previous carry
            self.carry_aux[d["new_carry_slots"]] = aux[d["new_carry_rows"]].to(self.carry_aux.dtype)
        if drafts is None:
            return [none] * len(out.slots)
        where = np.full(len(self.carry_pos), -1, np.int64)
        where[chain.slots] = np.arange(len(chain.rows))
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
        hidden = head.fc(src.to(head.fc.weight.dtype))
        q, k, v = head.qkv(self.embed(d["next_ids"]), hidden, d["positions"])
        last = rows.start_pos + rows.num_tokens  # context lengths after this pass
        self._rows_of(rows.slots, d["slots"], int(-(-last.max() // pool.page_size)))
        batch = ForwardBatch(
            input_ids=d["next_ids"], positions=d["positions"], out_cache_loc=d["locs"],
            slots=np.arange(len(rows.slots)), num_tokens=rows.num_tokens,
            start_pos=rows.start_pos, query_start=rows.query_start, kv_cache=cache,
            backend=self.backend, request_arrays=(d["v_rows"], d["v_seq_lens"],
                                                  d["v_query_start"], d["v_start_pos"]))
        self.backend.prepare(batch)
        return head.finish(self.attn(q, k, v, batch), hidden)

    def _chain(self, chain: ChainLayout, d: dict[str, torch.Tensor],
               outs: torch.Tensor) -> torch.Tensor:
        """`num_steps` greedy drafts per drafting request [C, steps]: the first from the layer
        output at its last verified position, each next one by running the head one position
        further on the draft before it and that output, all requests in one backend call per
        step, their K/V in the scratch pages (see the module doc)."""
        _, cache = self._caches()
        head, c = self.head, len(chain.rows)
        tokens = [head.draft_ids(outs)]
        if self.num_steps > 1:
            self._rows_of(chain.slots, d["chain_slots"], chain.width)
            cache.page_table_host[chain.table_rows, chain.table_cols] = chain.table_pages
            cache.page_table[d["table_rows"], d["table_cols"]] = d["table_pages"].to(torch.int32)
            if len(chain.copy_src):
                cache.k[0][d["copy_dst"]] = cache.k[0][d["copy_src"]]
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
            q, k, v = head.qkv(self.embed(tokens[-1]), outs, pos)
            outs = head.finish(self.attn(q, k, v, batch), outs)
            tokens.append(head.draft_ids(outs))
        return torch.stack(tokens, dim=1)
