"""triton attention backend: tokenspeed_kernels' paged kernels (decode split-K, extend over prefix)
and, for fresh prompts, `prefill_attention`.

Pure-decode steps run `paged_decode_attention`; steps with prefill chunks run
`paged_extend_attention` for the chunks (`prefill_attention` over the QKV output instead when
they are all fresh prompts, eager, on Hopper or newer) and the decode kernel for the one-token
requests leading the step (the scheduler runs decodes first). The metadata is a few small device
tensors plus Python ints, so a decode step can be captured in a CUDA graph: the graph runner
builds `TritonMetadata` over its static buffers and the kernels never read sizes back to the host.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tokenspeed.layers import batch_invariant
from tokenspeed.layers.attention import Attention, AttentionBackend, ForwardBatch
from tokenspeed.layers.kv_cache import PagedKVCache
from tokenspeed.layers.rotary import Rope


@dataclass
class TritonMetadata:
    page_table: torch.Tensor  # [B, W] int32: request i's page-table row (W pages cover its context)
    seq_lens: torch.Tensor  # [B] int32: tokens in the cache after this step's writes
    decode: bool  # one new token per request: split-K decode kernel
    num_splits: int = 1  # decode: fixed split count (graph-safe)
    q_start_loc: torch.Tensor | None = None  # extend: [B + 1] int32 cumulative new tokens
    prefix_lens: torch.Tensor | None = None  # extend: [B] int32 cached tokens before the new ones
    max_new_tokens: int = 1  # extend: bounds the grid without a host sync
    # extend: the step's leading one-token requests, run by the decode kernel; the fields above
    # then describe only the requests after them (q_start_loc counts from their first token).
    leading_decodes: TritonMetadata | None = None
    # extend under a CUDA graph: the tile table of a launch sized for the graph (extend_tiles).
    tiles: torch.Tensor | None = None
    # extend under a CUDA graph: the one-token requests (decodes, wherever they sit among the
    # graph's request rows) as decode-kernel metadata over every row, and each row's q row in
    # the step (one past the last token for the other rows: a scratch row of the output).
    singles: tuple[TritonMetadata, torch.Tensor] | None = None
    # extend, eager: every request after the leading decodes is a fresh prompt (no cached
    # prefix), so where `prefill_supported` its attention reads K/V from the QKV output itself.
    fresh: bool = False


@dataclass
class InvariantMetadata:
    """Batch-invariant mode: the step's page-table rows and request layout
    (tokenspeed_kernels.batch_invariant.attention)."""

    page_table: torch.Tensor  # [B, W] int32
    num_tokens: np.ndarray  # [B] host
    start_pos: np.ndarray  # [B] host
    query_start: np.ndarray  # [B + 1] host
    blocks: torch.Tensor | None = None  # [4, n] int32 on the device (attention_blocks)


class TritonBackend(AttentionBackend):
    """Fast path on CUDA; also runs on the CPU under TRITON_INTERPRET=1 (tests)."""

    name = "triton"
    fuses_rope = True  # rotary_embedding_write_kv: RoPE and the KV write in one kernel
    supports_sinks = True  # GPT-OSS: every kernel starts its online softmax from the sink
    supports_mla = True  # tokenspeed_kernels.mla_attention (decode graphs; extend eager)

    def __init__(self, kv_cache: PagedKVCache, max_context_len: int,
                 sliding_window: int | None = None) -> None:
        """sliding_window: unused (each layer's window is `Attention.sliding_window`)."""
        import tokenspeed_kernels  # noqa: F401  (fail at start-up, not at the first step)

        self.kv_cache = kv_cache
        self.max_context_len = max_context_len
        self.num_kv_heads = int(kv_cache.k[0].shape[2]) if kv_cache.k else 1
        self.sliding_window = sliding_window

    def decode_num_splits(self, batch_size: int) -> int:
        """Splits of the decode kernel for a batch: sized for the longest context the runner
        admits, so the eager path and every captured graph use the same split (and numerics)."""
        from tokenspeed_kernels import default_num_splits

        return default_num_splits(batch_size, self.num_kv_heads, self.max_context_len)

    def prepare(self, batch: ForwardBatch) -> None:
        if batch_invariant.enabled():
            batch.metadata = self._invariant_metadata(batch)
            return
        seq_lens = batch.seq_lens.astype(np.int64)
        bsz = len(seq_lens)
        max_seq = int(seq_lens.max()) if bsz else 0
        slots, seq_lens_d, query_start, start_pos = batch.device_arrays()
        # The leading one-token requests (decodes; the scheduler runs them before prefill chunks)
        # go through the decode kernel even in a mixed step: it reads each K/V head once for all
        # its query heads, where the extend kernel reads it once per query head.
        single = batch.num_tokens == 1
        d = bsz if single.all() else int(np.argmin(single))
        decodes = None
        if d:
            # Full-width page-table rows and fresh tensors: the launch matches the one the CUDA
            # graphs compiled (Triton specializes on strides and alignment), so no step pays for
            # a compile.
            decodes = TritonMetadata(
                page_table=self.kv_cache.page_table[slots[:d]], seq_lens=seq_lens_d[:d].to(torch.int32),
                decode=True, num_splits=self.decode_num_splits(d))
        if d == bsz:
            batch.metadata = decodes
            return
        # Columns rounded up to 16 (one stride specialization) and tensors of their own for the
        # requests after the decodes (aligned, whatever d is).
        pages = -(-max_seq // self.kv_cache.page_size)
        cols = min(-(-pages // 16) * 16, self.kv_cache.max_pages_per_slot)
        batch.metadata = TritonMetadata(
            page_table=self.kv_cache.page_table[slots[d:], :cols],
            seq_lens=seq_lens_d[d:].to(torch.int32), decode=False,
            q_start_loc=(query_start[d:] - d).to(torch.int32), prefix_lens=start_pos[d:].to(torch.int32),
            max_new_tokens=int(batch.num_tokens.max()), leading_decodes=decodes,
            fresh=not batch.start_pos[d:].any())

    def _invariant_metadata(self, batch: ForwardBatch) -> InvariantMetadata:
        """Batch-invariant mode: the step's page-table rows and request layout; the kernel's
        token blocks are cut at the first layer (they depend on the query heads per KV head)."""
        slots, *_ = batch.device_arrays()
        return InvariantMetadata(self.kv_cache.page_table[slots],
                                 batch.num_tokens.astype(np.int64),
                                 batch.start_pos.astype(np.int64),
                                 batch.query_start.astype(np.int64))

    def init_graphs(self, sizes: list[int]) -> None:
        # The page-table rows of a graph's requests, gathered before each replay.
        self.graph_page_table = torch.zeros((max(sizes), self.kv_cache.max_pages_per_slot),
                                            dtype=torch.int32, device=self.kv_cache.page_table.device)

    def graph_metadata(self, bs: int,
                       positions: torch.Tensor) -> TritonMetadata | InvariantMetadata:
        if batch_invariant.enabled():  # one token per row, its blocks built inside the graph
            rows = torch.arange(bs, dtype=torch.int32, device=positions.device)
            blocks = torch.stack([rows, rows, torch.ones_like(rows), positions.to(torch.int32)])
            empty = np.zeros(0, dtype=np.int64)
            return InvariantMetadata(self.graph_page_table[:bs], empty, empty, empty, blocks)
        return TritonMetadata(page_table=self.graph_page_table[:bs],
                              seq_lens=positions.add(1).to(torch.int32), decode=True,
                              num_splits=self.decode_num_splits(bs))

    def prepare_replay(self, bs: int, slots: np.ndarray, positions: np.ndarray,
                       slots_dev: torch.Tensor) -> None:
        cols = max(1, -(-(int(positions.max()) + 1) // self.kv_cache.page_size))
        # Only the columns the longest context needs, gathered on the device.
        self.graph_page_table[:bs, :cols] = self.kv_cache.page_table[slots_dev, :cols]

    def extend_graph_metadata(self, slots: torch.Tensor, q_start_loc: torch.Tensor,
                              prefix_lens: torch.Tensor, seq_lens: torch.Tensor,
                              num_tokens: int, q_dtype: torch.dtype,
                              head_dim: int) -> TritonMetadata:
        """The metadata an extend CUDA graph is captured with, built on the device from its
        static [R] request buffers (int64; absent requests: no new tokens). Requests with several
        new tokens go through the extend kernel in a tiled launch; those with one (decodes)
        through the decode kernel, launched over all R rows (the others attend to one key and
        are dropped), as in an eager mixed step: it reads each K/V head once for all its query
        heads. Page-table rows are gathered at full width inside the graph."""
        from tokenspeed_kernels import extend_config, extend_tiles

        block_m = extend_config(q_dtype, head_dim, self.kv_cache.dtype,
                                self.kv_cache.page_table.device)[0]
        num_tiles = min(int(slots.shape[0]), num_tokens) + num_tokens // block_m
        page_table = self.kv_cache.page_table[slots]
        seq_lens32 = seq_lens.to(torch.int32)
        single = (q_start_loc[1:] - q_start_loc[:-1]) == 1
        singles = TritonMetadata(
            page_table=page_table, seq_lens=torch.where(single, seq_lens32, 1), decode=True,
            num_splits=self.decode_num_splits(int(slots.shape[0])))
        q_rows = torch.where(single, q_start_loc[:-1], num_tokens)
        return TritonMetadata(
            page_table=page_table, seq_lens=seq_lens32, decode=False,
            q_start_loc=q_start_loc.to(torch.int32), prefix_lens=prefix_lens.to(torch.int32),
            max_new_tokens=num_tokens, tiles=extend_tiles(q_start_loc, num_tiles, block_m, True),
            singles=(singles, q_rows))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: Attention,
                batch: ForwardBatch, rope: Rope | None = None,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        """rope: rotate q (in place) and k on their way into the cache, one kernel for both. k
        itself stays unrotated (the paged kernels read every key from the cache) unless the
        step's prompts are all fresh: `prefill_attention` then reads the rotated k in place.
        sinks: [Hq] per-head sink logits (GPT-OSS), passed to every kernel."""
        from tokenspeed_kernels import (
            paged_decode_attention,
            paged_extend_attention,
            prefill_attention,
            prefill_layout_ok,
            prefill_supported,
        )

        if layer.latent:
            return self._forward_mla(q, k, layer, batch)
        if isinstance(batch.metadata, InvariantMetadata):
            return self._forward_invariant(q, k, v, layer, batch, rope, sinks)
        m: TritonMetadata = batch.metadata
        window = layer.sliding_window  # per layer (Gemma 3, GPT-OSS interleave)
        fresh = (m.fresh and window is None and prefill_supported(q.device, q.dtype, q.shape[-1])
                 and prefill_layout_ok(q, k, v))
        k_cache, v_cache = store_kv(self.kv_cache, layer.layer_id, q, k, v, batch.out_cache_loc,
                                    rope, rotate_k=fresh)
        # fp8 cache: K/V dequantised in the kernels' registers with the layer's scales (1.0 else);
        # the layer's sliding window (None: full attention) and sinks (None: none).
        kw: dict[str, Any] = {"k_scale": self.kv_cache.k_scale[layer.layer_id],
                              "v_scale": self.kv_cache.v_scale[layer.layer_id], "window": window,
                              "sinks": sinks}
        if m.singles is not None:
            return self._forward_graph_step(q, k_cache, v_cache, m, layer.scaling, kw)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if m.decode:
            paged_decode_attention(q, k_cache, v_cache, m.page_table, m.seq_lens, layer.scaling,
                                   out=out, num_splits=m.num_splits, **kw)
            return out.flatten(1)
        d = 0
        if m.leading_decodes is not None:
            lead = m.leading_decodes
            d = lead.page_table.shape[0]
            paged_decode_attention(q[:d], k_cache, v_cache, lead.page_table, lead.seq_lens,
                                   layer.scaling, out=out[:d], num_splits=lead.num_splits, **kw)
        if fresh:
            prefill_attention(q[d:], k[d:], v[d:], m.q_start_loc, layer.scaling,
                              m.max_new_tokens, out=out[d:], sinks=sinks)
        else:
            paged_extend_attention(q[d:], k_cache, v_cache, m.page_table, m.q_start_loc,
                                   m.prefix_lens, m.seq_lens, layer.scaling, out=out[d:],
                                   max_new_tokens=m.max_new_tokens, tiles=m.tiles, **kw)
        return out.flatten(1)

    def _forward_mla(self, q: torch.Tensor, k: torch.Tensor, layer: Attention,
                     batch: ForwardBatch) -> torch.Tensor:
        """Absorbed MLA: k [T, 1, latent + rope] into the latent cache (V is its first features,
        written with it), then mla_decode_attention for decode rows (a pure-decode step or a
        mixed step's leading decodes) and the tiled mla_extend_attention for prefill chunks.
        The split count follows the longest admitted context, as for the other kernels, so
        eager and graph-replayed decodes agree."""
        from tokenspeed_kernels import (
            mla_decode_attention,
            mla_extend_attention,
            mla_num_splits,
            write_kv_to_pages,
        )

        m = batch.metadata
        if isinstance(m, InvariantMetadata) or m.singles is not None:
            raise NotImplementedError("multi-head latent attention under deterministic inference "
                                      "or extend CUDA graphs is not supported yet")
        k_cache = self.kv_cache.k[layer.layer_id]
        write_kv_to_pages(k, k, k_cache, k_cache, batch.out_cache_loc)
        head_blocks = -(-q.shape[1] // 16)
        lead = m if m.decode else m.leading_decodes
        d = 0 if lead is None else lead.page_table.shape[0]
        out = q.new_empty(q.shape[0], q.shape[1], layer.v_head_dim)
        if lead is not None:
            splits = mla_num_splits(d, head_blocks, self.max_context_len)
            mla_decode_attention(q[:d], k_cache, lead.page_table, lead.seq_lens, layer.scaling,
                                 layer.v_head_dim, out=out[:d], num_splits=splits)
        if not m.decode:
            assert m.q_start_loc is not None and m.prefix_lens is not None
            mla_extend_attention(q[d:], k_cache, m.page_table, m.q_start_loc, m.prefix_lens,
                                 layer.scaling, layer.v_head_dim, out=out[d:])
        return out.flatten(1)

    def _forward_invariant(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           layer: Attention, batch: ForwardBatch, rope: Rope | None,
                           sinks: torch.Tensor | None) -> torch.Tensor:
        """--enable-deterministic-inference: one kernel for every row (layers/batch_invariant.py)."""
        from tokenspeed_kernels.batch_invariant import attention, attention_blocks

        m: InvariantMetadata = batch.metadata
        if m.blocks is None:
            group = layer.num_heads // layer.num_kv_heads
            m.blocks = torch.from_numpy(attention_blocks(
                m.num_tokens, m.start_pos, m.query_start[:-1], group)).to(q.device)
        k_cache, v_cache = store_kv(self.kv_cache, layer.layer_id, q, k, v, batch.out_cache_loc,
                                    rope)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        attention(q, k_cache, v_cache, m.page_table, m.blocks, layer.scaling,
                  out, self.kv_cache.k_scale[layer.layer_id],
                  self.kv_cache.v_scale[layer.layer_id], layer.sliding_window, sinks)
        return out.flatten(1)

    @staticmethod
    def _forward_graph_step(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            m: TritonMetadata, scale: float,
                            kw: dict[str, Any]) -> torch.Tensor:
        """An extend graph's attention: the tiled extend launch for requests with several new
        tokens, the decode kernel for those with one, its rows copied into place (the other
        rows' land in a scratch row past the step's tokens)."""
        from tokenspeed_kernels import paged_decode_attention, paged_extend_attention

        assert m.singles is not None
        lone, q_rows = m.singles
        t = q.shape[0]
        out = torch.empty((t + 1, *q.shape[1:]), dtype=q.dtype, device=q.device)
        paged_extend_attention(q, k_cache, v_cache, m.page_table, m.q_start_loc, m.prefix_lens,
                               m.seq_lens, scale, out=out[:t], max_new_tokens=m.max_new_tokens,
                               tiles=m.tiles, **kw)
        lone_q = q.index_select(0, q_rows.clamp(max=t - 1))
        lone_out = paged_decode_attention(lone_q, k_cache, v_cache, lone.page_table,
                                          lone.seq_lens, scale, num_splits=lone.num_splits,
                                          **kw)
        out.index_copy_(0, q_rows, lone_out)
        return out[:t].flatten(1)


def store_kv(kv_cache: PagedKVCache, layer_id: int, q: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor, out_cache_loc: torch.Tensor, rope: Rope | None,
             rotate_k: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Write a layer's new K/V into the paged cache (slots with out_cache_loc -1 are skipped);
    with `rope`, rotate q in place and k on its way in, in the same kernel (`rotate_k`: k in
    place too). An fp8 cache stores K / k_scale and V / v_scale of the layer. Returns the
    layer's (k_cache, v_cache)."""
    from tokenspeed_kernels import rotary_embedding_write_kv, write_kv_to_pages

    k_cache, v_cache = kv_cache.k[layer_id], kv_cache.v[layer_id]
    scales = {"k_scale": kv_cache.k_scale[layer_id], "v_scale": kv_cache.v_scale[layer_id]}
    if rope is None:
        write_kv_to_pages(k, v, k_cache, v_cache, out_cache_loc, **scales)
    else:
        rotary_embedding_write_kv(rope.positions, q, k, v, rope.cos_sin_cache(), k_cache, v_cache,
                                  out_cache_loc, is_neox=True, rotate_k=rotate_k, **scales)
    return k_cache, v_cache
