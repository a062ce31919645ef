"""Scatter of new tokens' K/V into the paged KV cache ([num_pages, page_size, Hkv, D] per layer)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenspeed_kernels.fp8 import cache_value, store_args


@triton.jit
def _write_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kc_slot,
    stride_kc_h,
    stride_vc_slot,
    stride_vc_h,
    inv_k_scale,
    inv_v_scale,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    QUANT: tl.constexpr,
    FP8_MAX: tl.constexpr,
    MANT: tl.constexpr,
    BIAS: tl.constexpr,
):
    """One program = one token: copies its [Hkv, D] K and V rows to slot_mapping[token]
    (QUANT: scaled by inv_k_scale / inv_v_scale into an fp8 cache)."""
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < NUM_HEADS) & (offs_d[None, :] < HEAD_DIM)
    k = tl.load(k_ptr + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(v_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    kc = k_cache_ptr + slot * stride_kc_slot + offs_h[:, None] * stride_kc_h + offs_d[None, :]
    vc = v_cache_ptr + slot * stride_vc_slot + offs_h[:, None] * stride_vc_h + offs_d[None, :]
    tl.store(kc, cache_value(k, inv_k_scale, k_cache_ptr.dtype.element_ty, QUANT, FP8_MAX, MANT, BIAS), mask=mask)
    tl.store(vc, cache_value(v, inv_v_scale, v_cache_ptr.dtype.element_ty, QUANT, FP8_MAX, MANT, BIAS), mask=mask)


def write_kv_to_pages(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """k, v: [T, Hkv, D] (token/head strides free); caches [num_pages, page_size, Hkv, D];
    slot_mapping: [T] int64 flat slot = page * page_size + offset (negative = skip).
    An fp8 cache stores k / k_scale and v / v_scale (tokenspeed_kernels.fp8.quantize_fp8)."""
    total, hkv, head_dim = k.shape
    assert k.stride(-1) == 1 and v.stride(-1) == 1
    assert k_cache.stride(0) == k_cache.shape[1] * k_cache.stride(1), "pages must be contiguous"
    assert v_cache.stride(0) == v_cache.shape[1] * v_cache.stride(1), "pages must be contiguous"
    if total == 0:
        return
    assert k_cache.dtype == v_cache.dtype
    k_cache, inv_k, quant = store_args(k_cache, k_scale)
    v_cache, inv_v, _ = store_args(v_cache, v_scale)
    _write_kv_kernel[(total,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(1),
        v_cache.stride(2),
        inv_k,
        inv_v,
        NUM_HEADS=hkv,
        HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(hkv),
        BLOCK_D=triton.next_power_of_2(head_dim),
        **quant,
        num_warps=4,
    )
