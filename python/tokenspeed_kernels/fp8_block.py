"""Block-scaled FP8 GEMM (DeepSeek-V3's checkpoint format): activations quantised per token per
K-group, weights with one scale per [block_n, block_k] tile, and a Triton W8A8 matmul that applies
both scales once per K-block (as DeepGEMM and SGLang's w8a8_block_fp8_matmul do).

    a[m, k] ~= a_q[m, k] * a_s[m, k // group_k]            (per_token_group_quant_fp8)
    b[n, k] ~= b_q[n, k] * b_s[n // block_n, k // block_k]  (the checkpoint's weight_scale_inv)
    out[m, n] = sum over K-blocks j of (a_q[m, j] . b_q[n, j]) * a_s[m, j] * b_s[n // block_n, j]

group_k == block_k: each K-block's fp8 partial sum (exact products, fp32 on the interpreter;
tensor cores on a GPU, promoted to fp32 every block_k elements) is scaled and added in fp32.
K and N need not be multiples of the block: the last block is partial (masked loads), its scale
covers what there is.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenspeed_kernels._utils import interpreting
from tokenspeed_kernels.fp8 import cache_value, fp8_max, store_args
from tokenspeed_kernels.fp8_gemm import MIN_AMAX


@triton.jit
def _group_quant_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    K,
    groups,
    stride_x,
    stride_q,
    stride_s,
    FP8_MAX: tl.constexpr,
    MIN_AMAX_C: tl.constexpr,
    QUANT: tl.constexpr,
    MANT: tl.constexpr,
    BIAS: tl.constexpr,
    GROUP: tl.constexpr,
):
    """One program = one (row, group): scale = amax / FP8_MAX over the group, q = x / scale."""
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    offs = g * GROUP + tl.arange(0, GROUP)
    mask = offs < K
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    # IEEE-rounded divisions (a GPU's `/` is approximate): the scale and its inverse are
    # torch's to the bit, so every q is too (an inverse one ulp off flips ties).
    scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(x), 0), MIN_AMAX_C), FP8_MAX)
    tl.store(s_ptr + row * stride_s + g, scale)
    tl.store(q_ptr + row * stride_q + offs,
             cache_value(x, tl.math.div_rn(1.0, scale), q_ptr.dtype.element_ty, QUANT, FP8_MAX, MANT, BIAS),
             mask=mask)


def per_token_group_quant_fp8(x: torch.Tensor, group: int = 128, dtype: torch.dtype = torch.float8_e4m3fn
                              ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (contiguous last dim) -> (q [M, K] fp8, scales [M, ceil(K / group)] fp32) with
    x[m, k] ~= q[m, k] * scales[m, k // group]: each group's largest |x| maps to the format's max."""
    assert x.dim() == 2 and x.stride(1) == 1 and group & (group - 1) == 0
    m, k = x.shape
    groups = triton.cdiv(k, group)
    q = torch.empty((m, k), dtype=dtype, device=x.device)
    scale = torch.empty((m, groups), dtype=torch.float32, device=x.device)
    if m == 0 or k == 0:
        return q, scale
    q_arg, _, consts = store_args(q, 1.0)
    _group_quant_kernel[(m, groups)](x, q_arg, scale, k, groups, x.stride(0), q.stride(0), scale.stride(0),
                                     MIN_AMAX_C=MIN_AMAX, GROUP=group, **consts, num_warps=1)  # fmt: skip
    return q, scale


def ref_per_token_group_quant_fp8(x: torch.Tensor, group: int = 128, dtype: torch.dtype = torch.float8_e4m3fn
                                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of per_token_group_quant_fp8 (the same fp32 operations)."""
    m, k = x.shape
    groups = -(-k // group)
    padded = torch.nn.functional.pad(x.float(), (0, groups * group - k)).view(m, groups, group)
    scale = padded.abs().amax(dim=2).clamp_min(MIN_AMAX) / fp8_max(dtype)
    inv = scale.reciprocal().repeat_interleave(group, dim=1)[:, :k]
    q = (x.float() * inv).clamp(-fp8_max(dtype), fp8_max(dtype)).to(dtype)
    return q, scale


def dequantize_block(w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """w [..., N, K] fp8 with scale [..., ceil(N / bn), ceil(K / bk)] -> w * its tile's scale."""
    bn, bk = block
    n, k = w.shape[-2:]
    s = scale.float().repeat_interleave(bn, dim=-2)[..., :n, :].repeat_interleave(bk, dim=-1)[..., :k]
    return (w.float() * s).to(dtype)


def ref_w8a8_block_matmul(a_q: torch.Tensor, a_s: torch.Tensor, b_q: torch.Tensor, b_s: torch.Tensor,
                          block: tuple[int, int], out_dtype: torch.dtype) -> torch.Tensor:
    """Torch reference: both operands dequantised, fp32 matmul."""
    a = dequantize_block(a_q, a_s, (1, block[1]))
    return (a @ dequantize_block(b_q, b_s, block).T).to(out_dtype)


@triton.jit
def _block_matmul_kernel(
    a_ptr,
    b_ptr,
    as_ptr,
    bs_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_am,
    stride_bn,
    stride_om,
    stride_asm,
    stride_bsn,
    GROUP_N: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """One program = one [BLOCK_M, BLOCK_N] output tile; BLOCK_K == the scales' K-group."""
    pid = tl.program_id(0)
    grid_m = tl.cdiv(M, BLOCK_M)
    grid_n = tl.cdiv(N, BLOCK_N)
    group = GROUP_M * grid_n
    first_m = (pid // group) * GROUP_M
    size_m = tl.minimum(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group) % size_m
    pid_n = (pid % group) // size_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    rows_a = tl.minimum(offs_m, M - 1).to(tl.int64)  # clamped: loads stay unmasked in M/N
    rows_b = tl.minimum(offs_n, N - 1).to(tl.int64)
    a_ptrs = a_ptr + rows_a[:, None] * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + rows_b[:, None] * stride_bn + offs_k[None, :]
    as_ptrs = as_ptr + rows_a * stride_asm
    bs_ptrs = bs_ptr + (rows_b // GROUP_N) * stride_bsn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for kb in range(tl.cdiv(K, BLOCK_K)):
        mask_k = (kb * BLOCK_K + offs_k)[None, :] < K
        a = tl.load(a_ptrs, mask=mask_k, other=0.0)
        b = tl.load(b_ptrs, mask=mask_k, other=0.0)
        if UPCAST:  # the interpreter has no fp8 dot
            part = tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)))
        else:  # a fresh fp32 partial per K-block: promoted every BLOCK_K products
            part = tl.dot(a, tl.trans(b))
        acc += part * tl.load(as_ptrs + kb)[:, None] * tl.load(bs_ptrs + kb)[None, :]
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=mask)


def w8a8_block_matmul(a_q: torch.Tensor, a_s: torch.Tensor, b_q: torch.Tensor, b_s: torch.Tensor,
                      block: tuple[int, int], out_dtype: torch.dtype,
                      config: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """(a_q * a_s per [1, block_k] group) @ (b_q * b_s per [block_n, block_k] tile).T in out_dtype.

    a_q [M, K], b_q [N, K] fp8 (contiguous last dim); a_s [M, ceil(K / bk)], b_s [ceil(N / bn),
    ceil(K / bk)] fp32. config: (BLOCK_M, BLOCK_N, num_warps, num_stages) for tuning (BLOCK_K is
    the scale group bk)."""
    m, k = a_q.shape
    n = b_q.shape[0]
    bn, bk = block
    kb = triton.cdiv(k, bk)
    assert b_q.shape[1] == k and a_q.stride(1) == 1 and b_q.stride(1) == 1
    assert a_s.stride(1) == 1 and b_s.stride(1) == 1
    assert a_s.shape == (m, kb) and b_s.shape == (triton.cdiv(n, bn), kb), (a_s.shape, b_s.shape)
    out = torch.empty((m, n), dtype=out_dtype, device=a_q.device)
    if m == 0 or n == 0:
        return out
    if config is None:
        if interpreting():
            config = (16, 32, 4, 1)
        else:  # H100 starting points (DeepGEMM-like tiles); a bench would sweep them
            config = (64, 128, 4, 3) if m > 32 else (16, 64, 4, 4)
    block_m, block_n, warps, stages = config
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
    _block_matmul_kernel[grid](a_q, b_q, a_s, b_s, out, m, n, k, a_q.stride(0), b_q.stride(0), out.stride(0),
                               a_s.stride(0), b_s.stride(0), GROUP_N=bn, UPCAST=interpreting(),
                               BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=bk, GROUP_M=8,
                               num_warps=warps, num_stages=stages)  # fmt: skip
    return out
