"""Rotary embedding fused with the paged KV-cache write: one kernel instead of two per layer.

q is rotated in place; k is rotated in registers and written (with v) to the paged cache. Each
value is computed exactly as `rotary_embedding` followed by `write_kv_to_pages` computes it
(fp32 rotation, rounded to k's dtype, then cast to the cache dtype), so caches and q match the
two-kernel path bit for bit. k itself is left unrotated unless rotate_k=True: the attention
kernels (decode and extend) read every key, the new tokens' too, from the cache.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenspeed_kernels.fp8 import cache_value, store_args
from tokenspeed_kernels.rotary import _as_heads, _rope_heads


@triton.jit
def _write_kv_slot(k_cache_ptr, v_cache_ptr, v_ptr, k_row, slot, t, offs_h, mask_h, c1, c2, o1, o2, mask,
                   stride_kc_slot, stride_kc_h, stride_vt, stride_vh, stride_vc_slot, stride_vc_h,
                   inv_k_scale, inv_v_scale, HALF: tl.constexpr, HEAD_DIM: tl.constexpr,
                   BLOCK_TAIL: tl.constexpr, BLOCK_D: tl.constexpr, QUANT: tl.constexpr,
                   FP8_MAX: tl.constexpr, MANT: tl.constexpr, BIAS: tl.constexpr):
    """Token t's rotated k (o1, o2 at columns c1, c2) and its v into KV cache slot `slot`."""
    kc_row = k_cache_ptr + slot * stride_kc_slot + offs_h[:, None] * stride_kc_h
    kc_ty = k_cache_ptr.dtype.element_ty
    tl.store(kc_row + c1, cache_value(o1, inv_k_scale, kc_ty, QUANT, FP8_MAX, MANT, BIAS), mask=mask)
    tl.store(kc_row + c2, cache_value(o2, inv_k_scale, kc_ty, QUANT, FP8_MAX, MANT, BIAS), mask=mask)
    if BLOCK_TAIL > 0:  # partial rotary: features [2 * HALF, HEAD_DIM) are copied unrotated
        offs_t = 2 * HALF + tl.arange(0, BLOCK_TAIL)[None, :]
        mask_t = mask_h & (offs_t < HEAD_DIM)
        tail = tl.load(k_row + offs_t, mask=mask_t)
        tl.store(kc_row + offs_t, cache_value(tail, inv_k_scale, kc_ty, QUANT, FP8_MAX, MANT, BIAS), mask=mask_t)
    offs_d = tl.arange(0, BLOCK_D)[None, :]
    mask_v = mask_h & (offs_d < HEAD_DIM)
    v = tl.load(v_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_d, mask=mask_v)
    vc = v_cache_ptr + slot * stride_vc_slot + offs_h[:, None] * stride_vc_h + offs_d
    tl.store(vc, cache_value(v, inv_v_scale, v_cache_ptr.dtype.element_ty, QUANT, FP8_MAX, MANT, BIAS), mask=mask_v)


@triton.jit
def _rotary_kv_kernel(
    pos_ptr,
    q_ptr,
    k_ptr,
    v_ptr,
    cache_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_c,
    stride_kc_slot,
    stride_kc_h,
    stride_vc_slot,
    stride_vc_h,
    n_q_heads,
    inv_k_scale,
    inv_v_scale,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_KH: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_TAIL: tl.constexpr,
    IS_NEOX: tl.constexpr,
    ROTATE_K: tl.constexpr,
    QUANT: tl.constexpr,
    FP8_MAX: tl.constexpr,
    MANT: tl.constexpr,
    BIAS: tl.constexpr,
):
    """One program = one token: rotate its q heads in place, write rotated k and v to its slot."""
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < HALF
    cos = tl.load(cache_ptr + pos * stride_c + offs_r, mask=mask_r, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(cache_ptr + pos * stride_c + HALF + offs_r, mask=mask_r, other=0.0).to(tl.float32)[None, :]
    # q of padding rows (slot -1) is rotated too, exactly like the unfused path does.
    _rope_heads(q_ptr + t * stride_qt, stride_qh, n_q_heads, cos, sin, tl.arange(0, BLOCK_H), offs_r,
                mask_r, HALF, IS_NEOX, BLOCK_H)  # fmt: skip

    offs_h = tl.arange(0, BLOCK_KH)
    mask_h = offs_h[:, None] < NUM_KV_HEADS
    k_row = k_ptr + t * stride_kt + offs_h[:, None] * stride_kh
    if IS_NEOX:
        c1 = offs_r[None, :]
        c2 = HALF + offs_r[None, :]
    else:
        c1 = 2 * offs_r[None, :]
        c2 = 2 * offs_r[None, :] + 1
    mask = mask_h & mask_r[None, :]
    x1 = tl.load(k_row + c1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(k_row + c2, mask=mask, other=0.0).to(tl.float32)
    # Same expressions and roundings as _rope_heads; the cache stores add write_kv_to_pages' cast.
    o1 = (x1 * cos - x2 * sin).to(k_ptr.dtype.element_ty)
    o2 = (x2 * cos + x1 * sin).to(k_ptr.dtype.element_ty)
    if ROTATE_K:
        tl.store(k_row + c1, o1, mask=mask)
        tl.store(k_row + c2, o2, mask=mask)

    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:  # negative slot: CUDA-graph padding row, nothing goes to the cache
        _write_kv_slot(k_cache_ptr, v_cache_ptr, v_ptr, k_row, slot, t, offs_h, mask_h, c1, c2, o1, o2, mask,
                       stride_kc_slot, stride_kc_h, stride_vt, stride_vh, stride_vc_slot, stride_vc_h,
                       inv_k_scale, inv_v_scale, HALF, HEAD_DIM, BLOCK_TAIL, BLOCK_D, QUANT, FP8_MAX, MANT,
                       BIAS)

def rotary_embedding_write_kv(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    is_neox: bool = True,
    rotate_k: bool = False,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """RoPE on q (in place) and k, then k and v into the paged cache, in one launch.

    q: [T, Hq*D] or [T, Hq, D]; k, v: the same for Hkv (token/head strides free: views into a
    fused qkv tensor are fine); cos_sin_cache: [max_pos, rotary_dim] as for rotary_embedding;
    caches: [num_pages, page_size, Hkv, D]; slot_mapping: [T] int flat slot (negative = skip the
    cache write; q is still rotated). rotate_k: also store the rotated k back into k.
    An fp8 cache stores k / k_scale and v / v_scale (tokenspeed_kernels.fp8.quantize_fp8).
    Equivalent to rotary_embedding(positions, q, k, ...) + write_kv_to_pages(k, v, ..., slots).
    """
    head_dim = k_cache.shape[-1]
    qh, kh, vh = _as_heads(q, head_dim), _as_heads(k, head_dim), _as_heads(v, head_dim)
    total, hkv = kh.shape[0], kh.shape[1]
    assert qh.shape[0] == total == vh.shape[0] == slot_mapping.shape[0]
    assert vh.shape[1] == hkv == k_cache.shape[2] and v_cache.shape == k_cache.shape
    assert qh.shape[1] % hkv == 0, "Hq must be a multiple of Hkv"
    rotary_dim = cos_sin_cache.shape[1]
    assert rotary_dim <= head_dim and rotary_dim % 2 == 0 and cos_sin_cache.stride(1) == 1
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    assert k_cache.stride(0) == k_cache.shape[1] * k_cache.stride(1), "pages must be contiguous"
    assert v_cache.stride(0) == v_cache.shape[1] * v_cache.stride(1), "pages must be contiguous"
    if total == 0:
        return
    assert k_cache.dtype == v_cache.dtype
    k_cache, inv_k, quant = store_args(k_cache, k_scale)
    v_cache, inv_v, _ = store_args(v_cache, v_scale)
    half = rotary_dim // 2
    block_r = triton.next_power_of_2(half)
    tail = head_dim - rotary_dim
    _rotary_kv_kernel[(total,)](
        positions,
        qh,
        kh,
        vh,
        cos_sin_cache,
        k_cache,
        v_cache,
        slot_mapping,
        qh.stride(0),
        qh.stride(1),
        kh.stride(0),
        kh.stride(1),
        vh.stride(0),
        vh.stride(1),
        cos_sin_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(1),
        v_cache.stride(2),
        qh.shape[1],
        inv_k,
        inv_v,
        NUM_KV_HEADS=hkv,
        HEAD_DIM=head_dim,
        HALF=half,
        BLOCK_R=block_r,
        BLOCK_H=max(1, min(triton.next_power_of_2(qh.shape[1]), 4096 // block_r)),
        BLOCK_KH=triton.next_power_of_2(hkv),
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_TAIL=triton.next_power_of_2(tail) if tail else 0,
        IS_NEOX=is_neox,
        ROTATE_K=rotate_k,
        **quant,
        num_warps=4,
    )
