"""Rotary position embedding (neox and GPT-J styles) in place, plus a llama3-scaled cos/sin cache."""

from __future__ import annotations

import math
from typing import Any

import torch
import triton
import triton.language as tl


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1 frequency rescaling (same formula as HF transformers' _compute_llama3_parameters)."""
    factor = float(scaling["factor"])
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    old_ctx = float(scaling.get("original_max_position_embeddings", 8192))
    low_wavelen = old_ctx / low
    high_wavelen = old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def build_cos_sin_cache(
    rotary_dim: int,
    max_position: int,
    base: float = 10000.0,
    rope_scaling: dict[str, Any] | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """[max_position, rotary_dim] cache: cos in the first rotary_dim/2 columns, sin in the rest.

    rope_scaling: None, {"rope_type": "llama3", factor, low_freq_factor, high_freq_factor,
    original_max_position_embeddings}, or {"rope_type": "linear", factor}.
    """
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
    positions = torch.arange(max_position, dtype=torch.float64)
    if rope_scaling is not None:
        kind = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
        if kind == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, rope_scaling)
        elif kind == "linear":
            positions = positions / float(rope_scaling["factor"])
        elif kind != "default":
            raise ValueError(f"unsupported rope scaling type {kind!r}")
    freqs = torch.outer(positions, inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(dtype=dtype, device=device)


@triton.jit
def _rope_heads(
    base_ptr,
    stride_h,
    n_heads,
    cos,
    sin,
    offs_h,
    offs_r,
    mask_r,
    HALF: tl.constexpr,
    IS_NEOX: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """Rotate heads [0, n_heads) of one token, BLOCK_H heads at a time."""
    for h0 in range(0, n_heads, BLOCK_H):
        heads = h0 + offs_h
        mask = (heads[:, None] < n_heads) & mask_r[None, :]
        row = base_ptr + heads[:, None] * stride_h
        if IS_NEOX:
            p1 = row + offs_r[None, :]
            p2 = row + HALF + offs_r[None, :]
        else:
            p1 = row + 2 * offs_r[None, :]
            p2 = row + 2 * offs_r[None, :] + 1
        x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(p2, mask=mask, other=0.0).to(tl.float32)
        o1 = x1 * cos - x2 * sin
        o2 = x2 * cos + x1 * sin
        tl.store(p1, o1.to(base_ptr.dtype.element_ty), mask=mask)
        tl.store(p2, o2.to(base_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    pos_ptr,
    q_ptr,
    k_ptr,
    cache_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_c,
    n_q_heads,
    n_k_heads,
    HALF: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr,
    IS_NEOX: tl.constexpr,
):
    """One program = one token: all q heads and all k heads rotated by that token's position."""
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_R)
    offs_h = tl.arange(0, BLOCK_H)
    mask_r = offs_r < HALF
    cos = tl.load(cache_ptr + pos * stride_c + offs_r, mask=mask_r, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(cache_ptr + pos * stride_c + HALF + offs_r, mask=mask_r, other=0.0).to(tl.float32)[None, :]
    _rope_heads(q_ptr + t * stride_qt, stride_qh, n_q_heads, cos, sin, offs_h, offs_r, mask_r,
                HALF, IS_NEOX, BLOCK_H)  # fmt: skip
    _rope_heads(k_ptr + t * stride_kt, stride_kh, n_k_heads, cos, sin, offs_h, offs_r, mask_r,
                HALF, IS_NEOX, BLOCK_H)  # fmt: skip


def _as_heads(x: torch.Tensor, head_dim: int) -> torch.Tensor:
    """View [T, H*head_dim] or [T, H, head_dim] as [T, H, head_dim] without copying."""
    if x.dim() == 2:
        x = x.unflatten(1, (-1, head_dim))
    assert x.dim() == 3 and x.shape[-1] == head_dim and x.stride(-1) == 1
    return x


def rotary_embedding(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    head_dim: int,
    is_neox: bool = True,
) -> None:
    """Rotate q [T, Hq*head_dim] or [T, Hq, head_dim] and k (same for Hkv) in place.

    positions: [T] int; cos_sin_cache: [max_pos, rotary_dim] (cos | sin halves, see
    build_cos_sin_cache); the first rotary_dim (<= head_dim) features of each head rotate.
    Token and head strides are free (q and k may be views into a fused qkv tensor).
    """
    qh, kh = _as_heads(q, head_dim), _as_heads(k, head_dim)
    total = qh.shape[0]
    rotary_dim = cos_sin_cache.shape[1]
    assert rotary_dim <= head_dim and rotary_dim % 2 == 0 and cos_sin_cache.stride(1) == 1
    if total == 0:
        return
    half = rotary_dim // 2
    block_r = triton.next_power_of_2(half)
    block_h = max(1, min(triton.next_power_of_2(max(qh.shape[1], kh.shape[1])), 4096 // block_r))
    _rotary_kernel[(total,)](
        positions,
        qh,
        kh,
        cos_sin_cache,
        qh.stride(0),
        qh.stride(1),
        kh.stride(0),
        kh.stride(1),
        cos_sin_cache.stride(0),
        qh.shape[1],
        kh.shape[1],
        HALF=half,
        BLOCK_R=block_r,
        BLOCK_H=block_h,
        IS_NEOX=is_neox,
        num_warps=4,
    )
