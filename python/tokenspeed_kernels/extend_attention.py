"""Paged extend (prefill over a cached prefix) attention: tiled flash-attention Triton kernel."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from tokenspeed_kernels._utils import dot_precision, upcast_dot
from tokenspeed_kernels.fp8 import is_fp8

LOG2E = 1.4426950408889634


@triton.jit
def _attn_tile(
    q,
    acc,
    m_i,
    l_i,
    k_ptr,
    v_ptr,
    pt_row,
    kvh,
    n0,
    qpos,
    seq_len,
    window,
    qk_scale,
    stride_kp,
    stride_ks,
    stride_kh,
    stride_vp,
    stride_vs,
    stride_vh,
    offs_n,
    offs_d,
    mask_d,
    PAGE_SIZE: tl.constexpr,
    MASKED: tl.constexpr,
    DOT_PREC: tl.constexpr,
    UPCAST: tl.constexpr,
    KV_CAST: tl.constexpr,
    SLIDING: tl.constexpr = False,
):
    """One online-softmax step over keys [n0, n0 + BLOCK_N) of the paged cache (KV_CAST: K/V of
    another dtype (fp8) converted to q's in registers, exact; scales applied by the caller).
    SLIDING (with MASKED): a query sees only keys within `window` positions of its own."""
    pos = n0 + offs_n
    if MASKED:
        mask_n = pos < seq_len
        page = tl.load(pt_row + pos // PAGE_SIZE, mask=mask_n, other=0).to(tl.int64)
    else:
        page = tl.load(pt_row + pos // PAGE_SIZE).to(tl.int64)
    in_page = pos % PAGE_SIZE
    k_off = page * stride_kp + in_page * stride_ks + kvh * stride_kh
    v_off = page * stride_vp + in_page * stride_vs + kvh * stride_vh
    if MASKED:
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k = tl.load(k_ptr + k_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + v_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
    else:
        k = tl.load(k_ptr + k_off[:, None] + offs_d[None, :], mask=mask_d[None, :], other=0.0)
        v = tl.load(v_ptr + v_off[:, None] + offs_d[None, :], mask=mask_d[None, :], other=0.0)
    if KV_CAST:
        k = k.to(q.dtype)
        v = v.to(q.dtype)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale
    if MASKED:
        s = tl.where((pos[None, :] <= qpos[:, None]) & mask_n[None, :], s, float("-inf"))
    if SLIDING:
        s = tl.where(pos[None, :] > qpos[:, None] - window, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
    return acc, m_new, l_i


@triton.jit
def _extend_keys(q, k_ptr, v_ptr, pt_row, kvh, qpos, prefix, seq_len, mblk, window, qk_scale, sink,
                 stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, offs_n, offs_d,
                 mask_d, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                 PAGE_SIZE: tl.constexpr, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr,
                 KV_CAST: tl.constexpr, SLIDING: tl.constexpr, HAS_SINKS: tl.constexpr):
    """Online softmax of the tile's q rows (positions qpos) over every key they see: (acc, m_i,
    l_i), unnormalised, log2 units. HAS_SINKS: it starts from the head's sink logit `sink`
    (log2 units: max = sink, sum = 1, no value)."""
    if HAS_SINKS:
        m_i = tl.full([BLOCK_M], 0.0, dtype=tl.float32) + sink
        l_i = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    diag_end = tl.minimum(seq_len, prefix + (mblk + 1) * BLOCK_M)
    if SLIDING:
        # From the tile holding the first row's oldest visible key, every tile masked.
        lo = tl.maximum(prefix + mblk * BLOCK_M - window + 1, 0) // BLOCK_N * BLOCK_N
        for n0 in range(lo, diag_end, BLOCK_N):
            acc, m_i, l_i = _attn_tile(
                q, acc, m_i, l_i, k_ptr, v_ptr, pt_row, kvh, n0, qpos, seq_len, window, qk_scale,
                stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
                offs_n, offs_d, mask_d, PAGE_SIZE, True, DOT_PREC, UPCAST, KV_CAST, True,
            )  # fmt: skip
    else:
        # Keys before the tile's first query position are visible to every row: no masks.
        full_end = (prefix + mblk * BLOCK_M) // BLOCK_N * BLOCK_N
        for n0 in range(0, full_end, BLOCK_N):
            acc, m_i, l_i = _attn_tile(
                q, acc, m_i, l_i, k_ptr, v_ptr, pt_row, kvh, n0, qpos, seq_len, window, qk_scale,
                stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
                offs_n, offs_d, mask_d, PAGE_SIZE, False, DOT_PREC, UPCAST, KV_CAST,
            )  # fmt: skip
        # Diagonal tiles: causal + sequence-end masks.
        for n0 in range(full_end, diag_end, BLOCK_N):
            acc, m_i, l_i = _attn_tile(
                q, acc, m_i, l_i, k_ptr, v_ptr, pt_row, kvh, n0, qpos, seq_len, window, qk_scale,
                stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
                offs_n, offs_d, mask_d, PAGE_SIZE, True, DOT_PREC, UPCAST, KV_CAST,
            )  # fmt: skip
    return acc, m_i, l_i


@triton.jit
def _extend_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, page_table_ptr, q_start_loc_ptr, prefix_lens_ptr, seq_lens_ptr,
    tiles_ptr, sinks_ptr, num_tiles, qk_scale, v_scale,
    stride_qt, stride_qh, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
    stride_ot, stride_oh, stride_pt, group, window,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr, KV_CAST: tl.constexpr,
    TILED: tl.constexpr, SLIDING: tl.constexpr, HAS_SINKS: tl.constexpr,
):
    """One program = one (request, q head, BLOCK_M new tokens). KV_CAST: the K scale is in
    qk_scale, v_scale multiplies the output. TILED: the grid is (q head, tile) and the tile
    table (`extend_tiles`) names each tile's request and block (-1: no work). HAS_SINKS:
    sinks_ptr [Hq] holds each head's sink logit (natural-log units)."""
    if TILED:
        h = tl.program_id(0)
        t = tl.program_id(1)
        b = tl.load(tiles_ptr + t)
        if b < 0:
            return
        mblk = tl.load(tiles_ptr + num_tiles + t)
    else:
        b = tl.program_id(0)
        h = tl.program_id(1)
        mblk = tl.num_programs(2) - 1 - tl.program_id(2)  # longest (most keys) tiles launch first
    q_start = tl.load(q_start_loc_ptr + b)
    n_new = tl.load(q_start_loc_ptr + b + 1) - q_start
    if mblk * BLOCK_M >= n_new:
        return
    prefix = tl.load(prefix_lens_ptr + b)
    seq_len = tl.load(seq_lens_ptr + b)
    kvh = h // group

    offs_m = mblk * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask_m = offs_m < n_new
    mask_d = offs_d < HEAD_DIM
    qpos = prefix + offs_m
    rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(
        q_ptr + rows[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
        mask=mask_m[:, None] & mask_d[None, :],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)
    sink = 0.0
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + h).to(tl.float32) * 1.4426950408889634  # log2 units (LOG2E)
    acc, _, l_i = _extend_keys(q, k_ptr, v_ptr, page_table_ptr + b * stride_pt, kvh, qpos, prefix, seq_len,
                               mblk, window, qk_scale, sink, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs,
                               stride_vh, offs_n, offs_d, mask_d, BLOCK_M, BLOCK_D, BLOCK_N, PAGE_SIZE,
                               DOT_PREC, UPCAST, KV_CAST, SLIDING, HAS_SINKS)

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    if KV_CAST:
        out = out * v_scale
    tl.store(
        out_ptr + rows[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=mask_m[:, None] & mask_d[None, :],
    )


@functools.cache
def _large_smem(device: torch.device) -> bool:
    """Whether a block may use Hopper-sized shared memory (227 KB on H100/H200): the deeper
    tile configs below need more than the 164 KB of an A100."""
    if device.type != "cuda":
        return False
    return torch.cuda.get_device_properties(device).shared_memory_per_block_optin >= 200 * 1024


def wide_head_config(device: torch.device | None) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) of the attention kernels for heads wider than
    128 (Gemma 3's 256): Q and two stages of K/V tiles in 160 KB, 96 KB where shared memory is
    smaller (correct on the H100, not tuned)."""
    return (64, 64, 4, 2) if device is not None and _large_smem(device) else (64, 32, 4, 2)


def extend_config(dtype: torch.dtype, head_dim: int, kv_dtype: torch.dtype | None = None,
                  device: torch.device | None = None) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) of the extend kernel for a q dtype, head size,
    cache dtype (default: q's) and the device it runs on (default: one without Hopper-sized
    shared memory)."""
    if dtype == torch.float32:
        return 64, 32, 4, 2
    if triton.next_power_of_2(head_dim) > 128:
        # D=256 (Gemma 3): the D=128 tiles need 320 KB of shared memory (the H100 has 227).
        return wide_head_config(device)
    if triton.next_power_of_2(head_dim) <= 64:
        return 128, 64, 4, 3
    # D=128 bf16/fp16 (bench_kernels.py --only extend --sweep, H100, 4 shapes from 4x1024 new
    # tokens to 4096 on an 8192 prefix): a third stage is 2-6% faster than (128, 128, 8, 2)
    # on every shape; an fp8 cache is fastest with (256, 64, 8, 2): 10-17% over the bf16 tiles.
    if device is not None and _large_smem(device):
        return (256, 64, 8, 2) if kv_dtype is not None and is_fp8(kv_dtype) else (128, 128, 8, 3)
    return 128, 128, 8, 2


def extend_tiles(q_start_loc: torch.Tensor, num_tiles: int, block_m: int,
                 skip_single: bool = False) -> torch.Tensor:
    """The tile table of a tiled launch: [2, num_tiles] int32, row 0 each tile's request (-1 past
    the last tile), row 1 its block of BLOCK_M new tokens, the last block of a request first
    (it has the most keys). Device ops of fixed shape, no host sync: CUDA graphs capture it.
    num_tiles must cover sum(ceil(new_i / block_m)) <= min(requests, tokens) + tokens // block_m.
    skip_single: no tiles for requests with exactly one new token (the decode kernel runs them:
    a tile of BLOCK_M rows would compute one)."""
    n_new = (q_start_loc[1:] - q_start_loc[:-1]).to(torch.int64)
    per_request = (n_new + block_m - 1) // block_m
    if skip_single:
        per_request = torch.where(n_new == 1, 0, per_request)
    ends = per_request.cumsum(0)
    t = torch.arange(num_tiles, device=q_start_loc.device, dtype=torch.int64)
    request = torch.searchsorted(ends, t, right=True)
    valid = request < n_new.shape[0]
    block = ends[request.clamp(max=n_new.shape[0] - 1)] - 1 - t
    return torch.stack([torch.where(valid, request, -1), torch.where(valid, block, 0)]).to(torch.int32)


def paged_extend_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    q_start_loc: torch.Tensor,
    prefix_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    max_new_tokens: int | None = None,
    config: tuple[int, int, int, int] | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    tiles: torch.Tensor | None = None,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of new tokens over their request's paged cache (their own K/V already written);
    window: each query sees only the keys within `window` positions (sliding window); sinks:
    [Hq] per-head sink logits (GPT-OSS), one more score per query in the softmax's denominator.

    q: [T, Hq, D], requests' new tokens concatenated; q_start_loc: [B+1] int32 cumulative offsets;
    prefix_lens: [B] int32 cached tokens before the new ones; seq_lens: [B] int32 = prefix + new.
    Causal within the new tokens, full over the prefix. Returns out [T, Hq, D] in q.dtype.
    max_new_tokens bounds the grid (read from q_start_loc, a host sync, when not given); pass it
    under CUDA graphs. config: (BLOCK_M, BLOCK_N, num_warps, num_stages) override for tuning.
    An fp8 cache (float8_e4m3fn / float8_e5m2) holds K / k_scale and V / v_scale.
    tiles: a tile table from `extend_tiles` (the BLOCK_M `extend_config` gives for q's and the
    cache's dtypes on q's device): the grid is its tiles instead of requests x the longest
    request's blocks, so that a launch sized for many requests and tokens (a CUDA graph's) runs
    no programs for absent ones.
    """
    total, hq, head_dim = q.shape
    _, page_size, hkv, _ = k_cache.shape
    assert hq % hkv == 0, "Hq must be a multiple of Hkv"
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    assert sinks is None or (sinks.shape == (hq,) and sinks.is_contiguous()), "sinks: [Hq]"
    batch = seq_lens.shape[0]
    # fp8 (or any other cache dtype than q's): converted to q's dtype in registers.
    kv_cast = k_cache.dtype != q.dtype
    assert v_cache.dtype == k_cache.dtype
    assert is_fp8(k_cache.dtype) or (k_scale == 1.0 and v_scale == 1.0), "scales need an fp8 cache"
    if out is None:
        out = torch.empty_like(q)
    if total == 0 or batch == 0:
        return out
    block_d = triton.next_power_of_2(head_dim)
    block_m, block_n, warps, stages = config or extend_config(q.dtype, head_dim, k_cache.dtype, q.device)
    if tiles is not None:
        grid: tuple[int, ...] = (hq, tiles.shape[1])
    else:
        if max_new_tokens is None:
            max_new_tokens = int((q_start_loc[1:] - q_start_loc[:-1]).max().item())
        grid = (batch, hq, triton.cdiv(max_new_tokens, block_m))
    _extend_kernel[grid](
        q, k_cache, v_cache, out, page_table, q_start_loc, prefix_lens, seq_lens,
        tiles if tiles is not None else q_start_loc,  # unread unless TILED
        q if sinks is None else sinks,  # unread unless HAS_SINKS
        tiles.shape[1] if tiles is not None else 0, scale * LOG2E * k_scale, v_scale,
        q.stride(0), q.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3], out.stride(0),
        out.stride(1), page_table.stride(0), hq // hkv, window or 0,
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_M=block_m, BLOCK_N=block_n, PAGE_SIZE=page_size,
        DOT_PREC=dot_precision(q.dtype), UPCAST=upcast_dot(q.dtype), KV_CAST=kv_cast,
        TILED=tiles is not None, SLIDING=bool(window), HAS_SINKS=sinks is not None,
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out
