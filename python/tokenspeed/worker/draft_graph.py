"""CUDA graphs for a draft head's work after a pure verify step (worker/draft_chain.py).

After a verify step the head runs `1 + (k - 1)` one-layer passes plus `k` greedy picks, dozens
of small kernels each: eagerly their host launches cost more than the target's verify graph
(~9 ms of an 8B target's 14.7 ms step on an H100, batch 1). `DraftGraphRunner` captures all of
it, one graph per batch size B of `capture_sizes(max_bs)` (the verify graphs' buckets):

- the verified-rows pass over B * (k + 1) rows, laid out as an extend graph's tokens
  (cuda_graph.py `pack_extend_step`: the real rows first, then padding rows that belong to no
  request and write no K/V), its attention through the head backend's
  `extend_graph_metadata` (tiled extend launch, decode kernel for one-row requests), its input
  the verify graph's static captured states (`VerifyGraphRunner.aux`, gathered by row);
- each request's last verified row, its first draft, then the chain's k - 1 decode-like steps
  over the head's page table with the chain's scratch pages (draft_rows.py `chain_layout`),
  their attention through the backend's decode graph metadata; the drafts land in a static
  [B, k] buffer.

The host still builds every index array with numpy (`step_rows`, `chain_layout`); here they are
packed at fixed offsets into one int64 buffer, one host → device transfer fills it, and one
device → host copy returns the drafts. Padding requests (b < B) read slot 0's pages and their
own scratch pages and write nothing. A step takes the graph when its target forward replayed a
verify graph (its `aux` is that graph's buffer, so the step was pure verify), every request
drafts or none does (speculation paused by the scheduler: a second graph per size, `passes`,
runs the verified pass alone, so the head's KV keeps up), none has a carried chunk row, and each has at most k + 1 verified rows (always, in a
pure verify step); otherwise the drafter runs eagerly. Not for latent (MLA) heads: the extend
graphs do not run MLA, and neither do the verify graphs they would follow.
"""

from __future__ import annotations

import bisect
import logging
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from tokenspeed.layers.attention import ForwardBatch
from tokenspeed.layers.host_copy import ALIGN, to_device_int64
from tokenspeed.worker.cuda_graph import capture_graphs, capture_sizes, pack_extend_step
from tokenspeed.worker.draft_rows import ChainLayout, HeadRows, scratch_pages
from tokenspeed.worker.verify_graph import VerifyGraphRunner, verify_graph_bytes, verify_graphs_for

if TYPE_CHECKING:
    from tokenspeed.worker.draft_chain import ChainDrafter

logger = logging.getLogger(__name__)


def draft_graphs_supported(drafter: Any) -> bool:
    """Whether the drafter's head can run in graphs behind the verify graphs (not MLA)."""
    return not drafter.head.kv_layout["v_from_k"]


def draft_graph_bytes(max_bs: int, num_steps: int, hidden_size: int, capture_width: int,
                      vocab_size: int, itemsize: int, table_cols: int) -> int:
    """Bytes the draft graphs need beyond the head: their pool (one layer's activations over
    the largest graph's rows, a generous 16 hidden-wide rows each, and a pick's logits, bounded
    by the target's vocabulary), the static inputs and drafts, and the head backend's
    gathered page-table rows."""
    t = max_bs * (num_steps + 1)
    pool = t * (capture_width + 16 * hidden_size) * itemsize + max_bs * vocab_size * (itemsize + 8)
    inputs = 8 * (4 * t + 6 * (max_bs + 1) + 5 * max_bs * (num_steps + 1) + 64 * ALIGN)
    return pool + inputs + max_bs * num_steps * 8 + max_bs * table_cols * 4 + (4 << 20)


def spec_graph_bytes(runner: Any, activations: int, profile_tokens: int) -> int:
    """Bytes a draft-head runner's graphs need (worker/kv_sizing.py): the verify graphs' (from
    a profiled forward of `profile_tokens` tokens) and, where captured, the head's."""
    c, drafter, bs = runner.config, runner.drafter, runner.cuda_graph_max_bs
    steps, width, itemsize = drafter.num_steps, drafter.head.capture_width, runner.dtype.itemsize
    out = verify_graph_bytes(bs, steps, c.hidden_size, width, itemsize, activations, profile_tokens)
    if draft_graphs_supported(drafter):
        cols = -(-runner.max_context_len // runner.page_size) + scratch_pages(steps, runner.page_size)
        out += draft_graph_bytes(bs, steps, c.hidden_size, width, c.vocab_size, itemsize, cols)
    return out


class DraftGraphRunner:
    """The head's graphs (see the module docstring). Before capture (CPU tests) `run` runs the
    graph's body eagerly, with its padding."""

    def __init__(self, drafter: ChainDrafter, aux: torch.Tensor, max_bs: int) -> None:
        """`aux`: the verify graphs' static captured states, which the verified pass reads."""
        pool, cache = drafter._caches()
        self.drafter, self.aux = drafter, aux
        self.pool, self.cache, self.backend = pool, cache, drafter.backend
        self.steps = drafter.num_steps
        self.per = scratch_pages(self.steps, pool.page_size)
        self.sizes = capture_sizes(max_bs)
        self.max_bs = self.sizes[-1]
        self.backend.init_graphs(self.sizes)  # the chain's decode metadata reads its rows
        # Fixed parts of one int64 buffer, each 128-byte aligned (Triton specializes on it):
        # per row (T = B(k+1)): next id, position, KV location, captured-state row;
        # per request (B + 1): head page-table row, first row, prefix, context, last row, slot;
        # the chain, per step and request: position, KV location; its page-table entries
        # (B * S: row, column, page); its page copies (B: source, destination).
        b, t, s = self.max_bs, self.max_bs * (self.steps + 1), max(self.steps - 1, 0)
        self.parts = {"tokens": (4, t), "requests": (6, b + 1), "chain": (2, s, b),
                      "table": (3, b * self.per), "copies": (2, b)}
        sizes = [int(np.prod(shape)) for shape in self.parts.values()]
        self.offsets = np.cumsum([0] + [-(-n // ALIGN) * ALIGN for n in sizes])
        self.inputs = torch.zeros(int(self.offsets[-1]), dtype=torch.int64, device=drafter.device)
        self.drafts = torch.zeros((b, self.steps), dtype=torch.int64, device=drafter.device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.passes: dict[int, torch.cuda.CUDAGraph] = {}  # the pass alone (drafting paused)
        self.replays = 0

    def _view(self, name: str) -> torch.Tensor:
        i = list(self.parts).index(name)
        shape = self.parts[name]
        return self.inputs[int(self.offsets[i]):int(self.offsets[i]) + int(np.prod(shape))].view(shape)

    def holds(self, rows: HeadRows, chain: ChainLayout, aux: torch.Tensor) -> bool:
        """Whether this step's drafting runs in a graph (see the module docstring)."""
        b = len(rows.slots)
        return (0 < b <= self.max_bs and aux.data_ptr() == self.aux.data_ptr()
                and not len(rows.carried_at) and not len(rows.new_carry_slots)
                and len(chain.rows) in (0, b) and int(rows.num_tokens.max()) <= self.steps + 1)

    def pack(self, bs: int, rows: HeadRows | None, chain: ChainLayout | None) -> np.ndarray:
        """The static inputs (the whole buffer) for a step in the graph of `bs` requests; no
        rows: padding only (what the graphs are captured with)."""
        b = 0 if rows is None else len(rows.slots)
        t, s, per = bs * (self.steps + 1), max(self.steps - 1, 0), self.per
        scratch = self.pool.num_pages + np.arange(self.max_bs, dtype=np.int64) * per
        host = {name: np.zeros(shape, np.int64) for name, shape in self.parts.items()}
        host["tokens"][2] = -1  # padding rows write no K/V
        ch = host["chain"]
        ch[0] = np.arange(1, s + 1, dtype=np.int64)[:, None]  # padding: drafts after position 0
        ch[1] = -1
        # Padding chain rows point at their own scratch pages and copy a page onto itself.
        host["table"][0] = np.repeat(np.arange(self.max_bs), per)[:self.max_bs * per]
        host["table"][1] = np.tile(np.arange(per), self.max_bs)
        host["table"][2] = (scratch[:, None] + np.arange(per)).reshape(-1)
        host["copies"][:] = scratch
        if rows is None or chain is None:
            return self._flat(host)
        tokens, requests = pack_extend_step((t, bs), rows.next_ids, rows.positions, rows.locs,
                                            np.arange(b), rows.start_pos, rows.query_start)
        tokens[3, :len(rows.positions)] = rows.aux_rows  # (the per-token slot is unused here)
        host["tokens"][:, :t] = tokens
        host["requests"][:5, :bs + 1] = requests
        host["requests"][5, :b] = rows.slots
        if s and len(chain.rows):  # else a chain-less pass (drafting paused): no chain
            ch[0, :, :b] = chain.positions.reshape(s, b)
            ch[1, :, :b] = chain.locs.reshape(s, b)
            n = b * per
            host["table"][:, :n] = chain.table_rows, chain.table_cols, chain.table_pages
            partial = np.flatnonzero((chain.last_pos + 1) % self.pool.page_size != 0)
            host["copies"][0, partial] = chain.copy_src
        return self._flat(host)

    def _flat(self, host: dict[str, np.ndarray]) -> np.ndarray:
        flat = np.zeros(int(self.offsets[-1]), np.int64)
        for i, a in enumerate(host.values()):
            flat[self.offsets[i]:self.offsets[i] + a.size] = a.reshape(-1)
        return flat

    def _run(self, bs: int, chain: bool = True) -> None:
        """The graph's body for `bs` requests: the verified pass, the picks and the chain (not
        `chain`: the pass alone, writing the head's KV while drafting is paused)."""
        head, cache, backend = self.drafter.head, self.cache, self.backend
        t = bs * (self.steps + 1)
        ids, positions, locs, aux_rows = self._view("tokens")[:, :t]
        rows, q_start, prefix, seq_lens, last, slots = self._view("requests")[:, :bs + 1]
        # The requests' rows of the head's page table: the target's, at full width.
        cache.page_table[:bs, :self.pool.max_pages_per_slot] = self.pool.page_table[slots[:bs]]
        hidden = head.from_target(self.aux.index_select(0, aux_rows).to(head.dtype))
        meta = backend.extend_graph_metadata(rows[:bs], q_start, prefix[:bs], seq_lens[:bs], t,
                                             head.dtype, head.kv_layout["head_dim"])
        outs = head.layer(ids, hidden, positions, self._batch(ids, positions, locs, meta))
        if not chain:
            return
        outs = outs.index_select(0, last[:bs])
        tokens = [head.draft_ids(outs)]
        if self.steps > 1:
            (pos, chain_locs), (t_rows, t_cols, t_pages), (src, dst) = (
                self._view("chain")[:, :, :bs], self._view("table")[:, :bs * self.per],
                self._view("copies")[:, :bs])
            cache.page_table[t_rows, t_cols] = t_pages.to(torch.int32)
            cache.k[0][dst] = cache.k[0][src]  # the verified entries of the first draft's page
            if not cache.v_from_k:
                cache.v[0][dst] = cache.v[0][src]
            backend.graph_page_table[:bs].copy_(cache.page_table[:bs])
        for j in range(self.steps - 1):
            meta = backend.graph_metadata(bs, pos[j])
            batch = self._batch(tokens[-1], pos[j], chain_locs[j], meta)
            outs = head.layer(tokens[-1], outs, pos[j], batch)
            tokens.append(head.draft_ids(outs))
        self.drafts[:bs].copy_(torch.stack(tokens, dim=1))

    def _batch(self, ids: torch.Tensor, positions: torch.Tensor, locs: torch.Tensor,
               meta: Any) -> ForwardBatch:
        empty = np.zeros(0, dtype=np.int64)
        return ForwardBatch(input_ids=ids, positions=positions, out_cache_loc=locs, slots=empty,
                            num_tokens=empty, start_pos=empty, query_start=empty,
                            kv_cache=self.cache, backend=self.backend, metadata=meta)

    @torch.inference_mode()
    def capture(self, pool: Any = None) -> Any:
        """Capture every batch size over padding-only inputs; returns the memory pool."""
        self.inputs.copy_(torch.from_numpy(self.pack(self.max_bs, None, None)))
        self.graphs, pool = capture_graphs("draft head", self.sizes, self._run,
                                           self.drafter.device, pool)
        self.passes, pool = capture_graphs("draft head pass (drafting paused)", self.sizes,
                                           lambda bs: self._run(bs, chain=False),
                                           self.drafter.device, pool)
        return pool

    def run(self, rows: HeadRows, chain: ChainLayout) -> np.ndarray:
        """The drafts [b, k] of the step's b requests (plan order; `holds` said yes): its
        inputs in one transfer, the replay (uncaptured: the body), one copy back."""
        b, drafting = len(rows.slots), len(chain.rows) > 0
        bs = self.sizes[bisect.bisect_left(self.sizes, b)]
        (dev,) = to_device_int64([self.pack(bs, rows, chain)], self.drafter.device)
        self.inputs.copy_(dev)
        graph = (self.graphs if drafting else self.passes).get(bs)
        if graph is None:
            self._run(bs, chain=drafting)
        else:
            graph.replay()
            self.replays += 1
        if not drafting:  # paused: the head's KV is written, nothing to bring back
            return np.zeros((0, self.steps), np.int64)
        return self.drafts[:b].cpu().numpy().copy()  # the buffer is the next step's


def capture_spec_graphs(runner: Any, pool: Any = None) -> VerifyGraphRunner:
    """A draft-head runner's graphs: the verify graphs, then the head's (where supported, as
    the drafter's `graphs`), in one memory pool; returns the verify graphs."""
    drafter = runner.drafter
    verify = verify_graphs_for(runner, drafter.head.capture_width, drafter.num_steps)
    pool = verify.capture(pool)
    drafter.graphs = draft_graphs_for(runner, verify)
    if drafter.graphs is not None:
        drafter.graphs.capture(pool)
    return verify


def draft_graphs_for(runner: Any, verify: VerifyGraphRunner) -> DraftGraphRunner | None:
    """The draft head's graphs (uncaptured) behind `verify`; None where the head stays eager."""
    if not draft_graphs_supported(runner.drafter):
        logger.info("draft head: eager after every step (no CUDA graphs for a latent head)")
        return None
    return DraftGraphRunner(runner.drafter, verify.aux, runner.cuda_graph_max_bs)
