"""Paged multi-head latent attention (DeepSeek MLA, weight-absorbed): split-K Triton kernel.

The cache holds one latent "head" per token, [latent (D_LAT) | roped key part (D_PE)], e.g.
512 + 64 for DeepSeek-V3; every query head attends to it (MQA): the absorbed query is
[q_nope @ W_UK (D_LAT) | q_pe (D_PE)], the scores are q_lat . latent + q_pe . k_pe, and V is the
latent itself, so each head's output is D_LAT wide (W_UV maps it to v_head_dim afterwards).

One program = one (block of BLOCK_H heads, query row, split): it reads each tile of the latent
once for all its heads (the latent is the bandwidth: D_LAT + D_PE values per token, shared by
all heads; a row's head blocks are adjacent in the grid, so their re-reads of its tiles should
come from L2), online softmax over its split's keys, a partial output and lse per head; the
decode kernel's reduce (decode_attention._decode_reduce_kernel) combines the splits.

Every query row names its page-table row (`rows`, default: row i) and the number of keys it
sees (`kv_lens`), so the same kernel serves decode (one row per request, kv_lens = seq_lens)
and, as a simple reference path, prefill chunks (one row per new token, kv_lens = its position
+ 1: causal by construction; each token re-reads its prefix, O(n^2) reads). The triton backend
runs prefill through the tiled `mla_extend.mla_extend_attention` instead.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenspeed_kernels._utils import dot_precision, num_sms, upcast_dot
from tokenspeed_kernels.decode_attention import LOG2E, _decode_reduce_kernel


@triton.jit
def _mla_split_kernel(
    q_ptr, kv_ptr, page_table_ptr, rows_ptr, kv_lens_ptr, part_out_ptr, part_lse_ptr,
    qk_scale, num_heads, num_splits,
    stride_qt, stride_qh, stride_kvp, stride_kvs, stride_pt,
    stride_ot, stride_oh, stride_os, stride_lt, stride_lh,
    D_LAT: tl.constexpr, D_PE: tl.constexpr, BLOCK_DL: tl.constexpr, BLOCK_DP: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr,
    HAS_ROWS: tl.constexpr, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr,
):
    """Partial (output / sum, lse in log2 units) of BLOCK_H heads of query row t over the keys
    of its split; empty splits store lse -inf (weight 0 in the reduce)."""
    hb = tl.program_id(0)  # fastest: a row's head blocks run side by side and share its tiles in L2
    t = tl.program_id(1)
    split = tl.program_id(2)
    if HAS_ROWS:  # a prefill chunk's tokens share their request's page-table row
        row = tl.load(rows_ptr + t)
    else:
        row = t
    kv_len = tl.load(kv_lens_ptr + t)
    per_split = tl.cdiv(tl.cdiv(kv_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * per_split
    end = tl.minimum(start + per_split, kv_len)

    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_l = tl.arange(0, BLOCK_DL)
    offs_p = tl.arange(0, BLOCK_DP)
    offs_n = tl.arange(0, BLOCK_N)
    mask_h = heads < num_heads
    mask_l = offs_l < D_LAT
    mask_p = offs_p < D_PE
    q_row = q_ptr + t.to(tl.int64) * stride_qt + heads[:, None] * stride_qh
    q_lat = tl.load(q_row + offs_l[None, :], mask=mask_h[:, None] & mask_l[None, :], other=0.0)
    q_pe = tl.load(q_row + D_LAT + offs_p[None, :], mask=mask_h[:, None] & mask_p[None, :], other=0.0)
    if UPCAST:
        q_lat = q_lat.to(tl.float32)
        q_pe = q_pe.to(tl.float32)
    pt_row = page_table_ptr + row.to(tl.int64) * stride_pt

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DL], dtype=tl.float32)
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + offs_n
        mask_n = pos < end
        page = tl.load(pt_row + pos // PAGE_SIZE, mask=mask_n, other=0).to(tl.int64)
        base = kv_ptr + page * stride_kvp + (pos % PAGE_SIZE) * stride_kvs
        lat = tl.load(base[:, None] + offs_l[None, :], mask=mask_n[:, None] & mask_l[None, :], other=0.0)
        pe = tl.load(base[:, None] + D_LAT + offs_p[None, :], mask=mask_n[:, None] & mask_p[None, :],
                     other=0.0)  # fmt: skip
        if UPCAST:
            lat = lat.to(tl.float32)
            pe = pe.to(tl.float32)
        s = tl.dot(q_lat, tl.trans(lat), input_precision=DOT_PREC)
        s += tl.dot(q_pe, tl.trans(pe), input_precision=DOT_PREC)
        s = tl.where(mask_n[None, :], s * qk_scale, float("-inf"))  # [BLOCK_H, BLOCK_N], log2 units
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(lat.dtype), lat, input_precision=DOT_PREC)
        m_i = m_new

    has = l_i > 0
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
    o_ptrs = part_out_ptr + t.to(tl.int64) * stride_ot + heads[:, None] * stride_oh + split * stride_os
    tl.store(o_ptrs + offs_l[None, :], out, mask=mask_h[:, None] & mask_l[None, :])
    tl.store(part_lse_ptr + t.to(tl.int64) * stride_lt + heads * stride_lh + split, lse, mask=mask_h)


def mla_num_splits(rows: int, head_blocks: int, max_kv_len: int) -> int:
    """Splits per (row, head block): ~3 programs per SM, >= 64 keys per split, at most 64."""
    by_occupancy = triton.cdiv(3 * num_sms(), max(1, rows * head_blocks))
    by_length = triton.cdiv(max(1, max_kv_len), 64)
    return max(1, min(by_occupancy, by_length, 64))


def mla_decode_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    page_table: torch.Tensor,
    kv_lens: torch.Tensor,
    scale: float,
    latent_dim: int,
    out: torch.Tensor | None = None,
    rows: torch.Tensor | None = None,
    num_splits: int | None = None,
    block_h: int = 16,
    block_n: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
) -> torch.Tensor:
    """Absorbed MLA over a paged latent cache.

    q: [T, H, latent_dim + D_PE] (the absorbed query); kv_cache: [num_pages, page_size, 1,
    latent_dim + D_PE] ([latent | k_pe] per token); page_table: [B, max_pages] int32;
    kv_lens: [T] int32, the keys (positions 0 .. kv_lens[t] - 1 of its request) row t attends to;
    rows: [T] int32, row t's page-table row (None: row t). Returns out [T, H, latent_dim] in
    q.dtype: the softmax-weighted latents. num_splits: fixed under CUDA graphs, else derived from
    kv_lens (a host read). Unlike paged_decode_attention this has no fp8 cache path yet.
    """
    total, heads, width = q.shape
    _, page_size, hkv, cache_width = kv_cache.shape
    assert hkv == 1 and cache_width == width, "one latent head as wide as the query"
    assert q.stride(-1) == 1 and kv_cache.stride(-1) == 1 and kv_cache.dtype == q.dtype
    assert kv_cache.stride(0) == page_size * kv_cache.stride(1), "pages must be contiguous"
    d_pe = width - latent_dim
    out = q.new_empty(total, heads, latent_dim) if out is None else out
    if total == 0:
        return out
    block_h = max(16, block_h)  # tl.dot's smallest tile
    head_blocks = triton.cdiv(heads, block_h)
    if num_splits is None:
        num_splits = mla_num_splits(total, head_blocks, int(kv_lens.max().item()))
    block_dl = triton.next_power_of_2(latent_dim)
    block_n = block_n or (16 if block_dl >= 512 else 32)
    part_out = torch.empty((total, heads, num_splits, latent_dim), dtype=torch.float32, device=q.device)
    part_lse = torch.empty((total, heads, num_splits), dtype=torch.float32, device=q.device)
    assert total < 65536, "query rows ride the grid's second axis"
    _mla_split_kernel[(head_blocks, total, num_splits)](
        q, kv_cache, page_table, rows if rows is not None else kv_lens, kv_lens, part_out, part_lse,
        scale * LOG2E, heads, num_splits,
        q.stride(0), q.stride(1), kv_cache.stride(0), kv_cache.stride(1), page_table.stride(0),
        *part_out.stride()[:3], *part_lse.stride()[:2],
        D_LAT=latent_dim, D_PE=d_pe, BLOCK_DL=block_dl,
        BLOCK_DP=max(16, triton.next_power_of_2(d_pe)), BLOCK_H=block_h, BLOCK_N=block_n,
        PAGE_SIZE=page_size, HAS_ROWS=rows is not None, DOT_PREC=dot_precision(q.dtype),
        UPCAST=upcast_dot(q.dtype), num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    _decode_reduce_kernel[(total, heads)](
        part_out, part_lse, out, *part_out.stride()[:3], *part_lse.stride()[:2], out.stride(0),
        out.stride(1), num_splits, HEAD_DIM=latent_dim, BLOCK_D=block_dl,
        BLOCK_S=triton.next_power_of_2(num_splits), num_warps=4,
    )  # fmt: skip
    return out
