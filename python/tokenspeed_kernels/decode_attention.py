"""Paged decode attention: GQA-grouped split-K (flash-decoding) Triton kernels plus the reduce."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenspeed_kernels._utils import dot_precision, num_sms, upcast_dot

LOG2E = 1.4426950408889634


@triton.jit
def _decode_split_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    page_table_ptr,
    seq_lens_ptr,
    part_out_ptr,
    part_lse_ptr,
    qk_scale,
    stride_qb,
    stride_qh,
    stride_kp,
    stride_ks,
    stride_kh,
    stride_vp,
    stride_vs,
    stride_vh,
    stride_pt,
    stride_ob,
    stride_oh,
    stride_os,
    stride_lb,
    stride_lh,
    num_splits,
    group,
    BLOCK_H: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    DOT_PREC: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """One program = one (request, kv head, split): all `group` q heads share each K/V tile."""
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    # Split length is a multiple of BLOCK_N so every split but the last runs full tiles.
    per_split = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * per_split
    end = tl.minimum(start + per_split, seq_len)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    mask_h = offs_h < group
    mask_d = offs_d < HEAD_DIM
    heads = kvh * group + offs_h

    q = tl.load(
        q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
        mask=mask_h[:, None] & mask_d[None, :],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)

    pt_row = page_table_ptr + b * stride_pt
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + offs_n
        mask_n = pos < end
        page = tl.load(pt_row + pos // PAGE_SIZE, mask=mask_n, other=0).to(tl.int64)
        in_page = pos % PAGE_SIZE
        k_off = page * stride_kp + in_page * stride_ks + kvh * stride_kh
        v_off = page * stride_vp + in_page * stride_vs + kvh * stride_vh
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k = tl.load(k_ptr + k_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + v_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)

        s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale  # [BLOCK_H, BLOCK_N], log2 units
        s = tl.where(mask_n[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
        m_i = m_new

    # Empty splits (start >= end) store lse = -inf and zeros; the reduce gives them weight 0.
    has = l_i > 0
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
    o_ptrs = part_out_ptr + b * stride_ob + heads[:, None] * stride_oh + split * stride_os + offs_d[None, :]
    tl.store(o_ptrs, out, mask=mask_h[:, None] & mask_d[None, :])
    tl.store(part_lse_ptr + b * stride_lb + heads * stride_lh + split, lse, mask=mask_h)


@triton.jit
def _decode_reduce_kernel(
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    stride_pb,
    stride_ph,
    stride_ps,
    stride_lb,
    stride_lh,
    stride_ob,
    stride_oh,
    num_splits,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    """One program = one (request, q head): log-sum-exp weighted sum of the split partials."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    mask_s = offs_s < num_splits
    mask_d = offs_d < HEAD_DIM
    lse = tl.load(part_lse_ptr + b * stride_lb + h * stride_lh + offs_s, mask=mask_s, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m)
    denom = tl.sum(w, 0)
    parts = tl.load(
        part_out_ptr + b * stride_pb + h * stride_ph + offs_s[:, None] * stride_ps + offs_d[None, :],
        mask=mask_s[:, None] & mask_d[None, :],
        other=0.0,
    )
    out = tl.sum(parts * w[:, None], 0) / tl.where(denom > 0, denom, 1.0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty), mask=mask_d)


def default_num_splits(batch: int, num_kv_heads: int, max_seq_len: int) -> int:
    """Splits per (request, kv head): ~3 programs per SM, >= 64 tokens per split, at most 64.

    Tuned on H200 (B=1/8/32, ctx 1024/8192, Llama-3.1-8B heads): see kernels/bench/NOTES.md.
    """
    by_occupancy = triton.cdiv(3 * num_sms(), max(1, batch * num_kv_heads))
    by_length = triton.cdiv(max(1, max_seq_len), 64)
    return max(1, min(by_occupancy, by_length, 64))


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    max_seq_len: int | None = None,
    block_n: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
) -> torch.Tensor:
    """Attention of one new token per request over its paged KV cache.

    q: [B, Hq, D]; k_cache/v_cache: [num_pages, page_size, Hkv, D]; page_table: [B, max_pages] int32;
    seq_lens: [B] int32 (tokens in cache, including the new one, >= 1). Returns out [B, Hq, D] in
    q.dtype. Pass num_splits (fixed) under CUDA graphs; else it is derived from max_seq_len
    (read from seq_lens, a host sync, when not given). block_n/num_warps/num_stages: tuning knobs.
    """
    batch, hq, head_dim = q.shape
    _, page_size, hkv, _ = k_cache.shape
    assert hq % hkv == 0, "Hq must be a multiple of Hkv"
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    group = hq // hkv
    if out is None:
        out = torch.empty_like(q)
    if batch == 0:
        return out
    if num_splits is None:
        if max_seq_len is None:
            max_seq_len = int(seq_lens.max().item())
        num_splits = default_num_splits(batch, hkv, max_seq_len)
    block_d = triton.next_power_of_2(head_dim)
    block_h = max(16, triton.next_power_of_2(group))
    if block_n is None:
        block_n = 64 if block_d <= 128 else 32
    part_out = torch.empty((batch, hq, num_splits, head_dim), dtype=torch.float32, device=q.device)
    part_lse = torch.empty((batch, hq, num_splits), dtype=torch.float32, device=q.device)
    _decode_split_kernel[(batch, hkv, num_splits)](
        q,
        k_cache,
        v_cache,
        page_table,
        seq_lens,
        part_out,
        part_lse,
        scale * LOG2E,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        page_table.stride(0),
        part_out.stride(0),
        part_out.stride(1),
        part_out.stride(2),
        part_lse.stride(0),
        part_lse.stride(1),
        num_splits,
        group,
        BLOCK_H=block_h,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_N=block_n,
        PAGE_SIZE=page_size,
        DOT_PREC=dot_precision(q.dtype),
        UPCAST=upcast_dot(q.dtype),
        num_warps=num_warps,
        num_stages=num_stages,
    )
    _decode_reduce_kernel[(batch, hq)](
        part_out,
        part_lse,
        out,
        part_out.stride(0),
        part_out.stride(1),
        part_out.stride(2),
        part_lse.stride(0),
        part_lse.stride(1),
        out.stride(0),
        out.stride(1),
        num_splits,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_S=triton.next_power_of_2(num_splits),
        num_warps=4 if block_d >= 128 else 2,
    )
    return out
