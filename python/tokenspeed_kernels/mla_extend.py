"""Paged MLA extend (prefill over a cached prefix), weight-absorbed: tiled Triton kernel.

The cache is mla_attention's: one latent "head" per token, [latent (D_LAT) | k_pe (D_PE)], V =
the latent. One program = BLOCK_M new tokens of one request x BLOCK_H query heads, flattened
into BLOCK_M * BLOCK_H query rows (row r: token r // BLOCK_H, head r % BLOCK_H) that all
multiply the same latent tile: each tile is read once for every (token, head) row of the
program, where the one-row-per-token decode path re-reads a token's whole prefix per token.
Causal by position (token i of a chunk after a prefix of P keys sees keys 0 .. P + i): tiles
before the program's first token are unmasked, the diagonal ones masked. Online softmax in
fp32 (log2 units). The grid is (head block, tile) over `extend_attention.extend_tiles`' tile
table, built on the device: no host sync, a request's longest tiles first, and a tile's head
blocks side by side so their reads of its latents come from L2.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenspeed_kernels._utils import dot_precision, upcast_dot
from tokenspeed_kernels.decode_attention import LOG2E
from tokenspeed_kernels.extend_attention import extend_tiles


@triton.jit
def _mla_tile(q_lat, q_pe, acc, m_i, l_i, kv_ptr, pt_row, n0, qpos, seq_len, qk_scale,
              stride_kvp, stride_kvs, offs_n, offs_l, offs_p, mask_l, mask_p,
              D_LAT: tl.constexpr, PAGE_SIZE: tl.constexpr, MASKED: tl.constexpr,
              DOT_PREC: tl.constexpr, UPCAST: tl.constexpr):
    """One online-softmax step of the program's rows over keys [n0, n0 + BLOCK_N); MASKED: the
    sequence end and the causal mask (pos <= the row's position) apply."""
    pos = n0 + offs_n
    if MASKED:
        mask_n = pos < seq_len
    else:
        mask_n = pos >= 0
    page = tl.load(pt_row + pos // PAGE_SIZE, mask=mask_n, other=0).to(tl.int64)
    base = kv_ptr + page * stride_kvp + (pos % PAGE_SIZE) * stride_kvs
    lat = tl.load(base[:, None] + offs_l[None, :], mask=mask_n[:, None] & mask_l[None, :], other=0.0)
    pe = tl.load(base[:, None] + D_LAT + offs_p[None, :], mask=mask_n[:, None] & mask_p[None, :], other=0.0)
    if UPCAST:
        lat = lat.to(tl.float32)
        pe = pe.to(tl.float32)
    s = tl.dot(q_lat, tl.trans(lat), input_precision=DOT_PREC)
    s += tl.dot(q_pe, tl.trans(pe), input_precision=DOT_PREC)
    s = s * qk_scale  # [ROWS, BLOCK_N], log2 units
    if MASKED:
        s = tl.where((pos[None, :] <= qpos[:, None]) & mask_n[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(lat.dtype), lat, input_precision=DOT_PREC)
    return acc, m_new, l_i


@triton.jit
def _mla_extend_kernel(
    q_ptr, kv_ptr, out_ptr, page_table_ptr, q_start_loc_ptr, prefix_lens_ptr, tiles_ptr,
    num_tiles, qk_scale, num_heads,
    stride_qt, stride_qh, stride_kvp, stride_kvs, stride_pt, stride_ot, stride_oh,
    D_LAT: tl.constexpr, D_PE: tl.constexpr, BLOCK_DL: tl.constexpr, BLOCK_DP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr,
    DOT_PREC: tl.constexpr, UPCAST: tl.constexpr,
):
    """Rows = BLOCK_M tokens (block `mblk` of request b's new tokens) x heads of block hb."""
    hb = tl.program_id(0)
    t = tl.program_id(1)
    b = tl.load(tiles_ptr + t)
    if b < 0:
        return
    mblk = tl.load(tiles_ptr + num_tiles + t)
    q_start = tl.load(q_start_loc_ptr + b)
    n_new = tl.load(q_start_loc_ptr + b + 1) - q_start
    prefix = tl.load(prefix_lens_ptr + b)
    seq_len = prefix + n_new

    ROWS: tl.constexpr = BLOCK_M * BLOCK_H
    r = tl.arange(0, ROWS)
    tok = mblk * BLOCK_M + r // BLOCK_H
    heads = hb * BLOCK_H + r % BLOCK_H
    mask_r = (tok < n_new) & (heads < num_heads)
    qpos = prefix + tok
    offs_l = tl.arange(0, BLOCK_DL)
    offs_p = tl.arange(0, BLOCK_DP)
    mask_l = offs_l < D_LAT
    mask_p = offs_p < D_PE
    q_row = q_ptr + (q_start + tok).to(tl.int64)[:, None] * stride_qt + heads[:, None] * stride_qh
    q_lat = tl.load(q_row + offs_l[None, :], mask=mask_r[:, None] & mask_l[None, :], other=0.0)
    q_pe = tl.load(q_row + D_LAT + offs_p[None, :], mask=mask_r[:, None] & mask_p[None, :], other=0.0)
    if UPCAST:
        q_lat = q_lat.to(tl.float32)
        q_pe = q_pe.to(tl.float32)
    pt_row = page_table_ptr + b.to(tl.int64) * stride_pt
    offs_n = tl.arange(0, BLOCK_N)

    m_i = tl.full([ROWS], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([ROWS], dtype=tl.float32)
    acc = tl.zeros([ROWS, BLOCK_DL], dtype=tl.float32)
    # Keys before the program's first token are visible to every row: no masks.
    full_end = (prefix + mblk * BLOCK_M) // BLOCK_N * BLOCK_N
    for n0 in range(0, full_end, BLOCK_N):
        acc, m_i, l_i = _mla_tile(
            q_lat, q_pe, acc, m_i, l_i, kv_ptr, pt_row, n0, qpos, seq_len, qk_scale,
            stride_kvp, stride_kvs, offs_n, offs_l, offs_p, mask_l, mask_p,
            D_LAT, PAGE_SIZE, False, DOT_PREC, UPCAST,
        )  # fmt: skip
    diag_end = tl.minimum(seq_len, prefix + (mblk + 1) * BLOCK_M)
    for n0 in range(full_end, diag_end, BLOCK_N):
        acc, m_i, l_i = _mla_tile(
            q_lat, q_pe, acc, m_i, l_i, kv_ptr, pt_row, n0, qpos, seq_len, qk_scale,
            stride_kvp, stride_kvs, offs_n, offs_l, offs_p, mask_l, mask_p,
            D_LAT, PAGE_SIZE, True, DOT_PREC, UPCAST,
        )  # fmt: skip

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_ptrs = out_ptr + (q_start + tok).to(tl.int64)[:, None] * stride_ot + heads[:, None] * stride_oh
    tl.store(o_ptrs + offs_l[None, :], out.to(out_ptr.dtype.element_ty),
             mask=mask_r[:, None] & mask_l[None, :])


def mla_extend_config(dtype: torch.dtype, latent_dim: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M tokens, BLOCK_H heads, BLOCK_N keys, num_warps, num_stages). 64 query rows (4
    tokens x 16 heads) per program keep the fp32 accumulator of a 512-wide latent at 128
    registers a thread over 8 warps (ptxas for sm_90: 255 registers, ~100 bytes of spills; 4
    warps or 128 rows spill kilobytes). Not yet timed on a GPU: bench_mla_extend.py --sweep."""
    if triton.next_power_of_2(latent_dim) >= 512:
        return 4, 16, 32, 8, 2
    return 4, 16, 32, 4, 2


def mla_extend_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    page_table: torch.Tensor,
    q_start_loc: torch.Tensor,
    prefix_lens: torch.Tensor,
    scale: float,
    latent_dim: int,
    out: torch.Tensor | None = None,
    config: tuple[int, int, int, int, int] | None = None,
) -> torch.Tensor:
    """Absorbed MLA of the new tokens of several requests over their paged latent cache (their
    own latents already written): causal within the new tokens, full over the prefix.

    q: [T, H, latent_dim + D_PE], the requests' new tokens concatenated; kv_cache: [num_pages,
    page_size, 1, latent_dim + D_PE]; page_table: [B, max_pages] int32; q_start_loc: [B + 1]
    int32 cumulative new tokens; prefix_lens: [B] int32 cached tokens before them. Returns out
    [T, H, latent_dim] in q.dtype; no host sync (the tile table is built on the device, sized
    for T tokens). config: `mla_extend_config`'s tuple, for tuning.
    """
    total, heads, width = q.shape
    _, page_size, hkv, cache_width = kv_cache.shape
    assert hkv == 1 and cache_width == width, "one latent head as wide as the query"
    assert q.stride(-1) == 1 and kv_cache.stride(-1) == 1 and kv_cache.dtype == q.dtype
    d_pe = width - latent_dim
    out = q.new_empty(total, heads, latent_dim) if out is None else out
    if total == 0:
        return out
    block_m, block_h, block_n, warps, stages = config or mla_extend_config(q.dtype, latent_dim)
    # Few heads: a smaller head block and more tokens, still >= 16 rows (tl.dot's smallest tile).
    block_h = min(block_h, triton.next_power_of_2(heads))
    block_m = max(block_m, 16 // block_h)
    requests = q_start_loc.shape[0] - 1
    tiles = extend_tiles(q_start_loc, min(requests, total) + total // block_m, block_m)
    _mla_extend_kernel[(triton.cdiv(heads, block_h), tiles.shape[1])](
        q, kv_cache, out, page_table, q_start_loc, prefix_lens, tiles, tiles.shape[1],
        scale * LOG2E, heads, q.stride(0), q.stride(1), kv_cache.stride(0), kv_cache.stride(1),
        page_table.stride(0), out.stride(0), out.stride(1),
        D_LAT=latent_dim, D_PE=d_pe, BLOCK_DL=triton.next_power_of_2(latent_dim),
        BLOCK_DP=max(16, triton.next_power_of_2(d_pe)), BLOCK_M=block_m, BLOCK_H=block_h,
        BLOCK_N=block_n, PAGE_SIZE=page_size, DOT_PREC=dot_precision(q.dtype),
        UPCAST=upcast_dot(q.dtype), num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out
