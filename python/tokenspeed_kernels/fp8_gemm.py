"""FP8 GEMM pieces: dynamic per-token activation quantisation and a Triton W8A8 matmul with row
(token) and column (output channel) scales, the alternative to cuBLAS's torch._scaled_mm.

out[M, N] = (a_q[M, K] * a_scale[M, None]) @ (b_q[N, K] * b_scale[N, None]).T (+ bias), fp32
accumulation: the scales factor out of the K sum, so they are applied once to the accumulator.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenspeed_kernels._utils import interpreting
from tokenspeed_kernels.fp8 import cache_value, fp8_max, store_args

# A row whose largest |x| is below this gets this as its amax: the scale never reaches 0.
MIN_AMAX = 1e-12
# K elements per fp8 partial sum before it is added to the fp32 accumulator (see the kernel): one
# wgmma's K. DeepSeek-V3 promotes every 128; the GPU diagnostic (kernels/bench/diag_fp8_matmul.py)
# measures error and time for 32, 128 and no promotion.
PROMOTE_K = 32


@triton.jit
def _per_token_quant_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    K,
    stride_x,
    stride_q,
    FP8_MAX: tl.constexpr,
    MIN_AMAX_C: tl.constexpr,
    QUANT: tl.constexpr,
    MANT: tl.constexpr,
    BIAS: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ONE_PASS: tl.constexpr,
):
    """One program = one row: amax over K, scale = amax / FP8_MAX, q = x / scale. ONE_PASS (the
    row fits one block): the row is read once and held in registers; else read twice."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_K)
    if ONE_PASS:
        mask = offs < K
        x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
        scale = tl.maximum(tl.max(tl.abs(x.to(tl.float32)), 0), MIN_AMAX_C) / FP8_MAX
        tl.store(s_ptr + row, scale)
        tl.store(q_ptr + row * stride_q + offs,
                 cache_value(x, 1.0 / scale, q_ptr.dtype.element_ty, QUANT, FP8_MAX, MANT, BIAS), mask=mask)
    else:
        amax = tl.zeros([BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            x = tl.load(x_ptr + row * stride_x + k0 + offs, mask=k0 + offs < K, other=0.0)
            amax = tl.maximum(amax, tl.abs(x.to(tl.float32)))
        scale = tl.maximum(tl.max(amax, 0), MIN_AMAX_C) / FP8_MAX
        inv = 1.0 / scale
        tl.store(s_ptr + row, scale)
        for k0 in range(0, K, BLOCK_K):
            mask = k0 + offs < K
            x = tl.load(x_ptr + row * stride_x + k0 + offs, mask=mask, other=0.0)
            tl.store(q_ptr + row * stride_q + k0 + offs,
                     cache_value(x, inv, q_ptr.dtype.element_ty, QUANT, FP8_MAX, MANT, BIAS), mask=mask)


# Rows up to this many elements are quantised in one pass from registers (64 values a thread at
# 8 warps): an 8B model's down_proj input (14,336) is read once instead of twice.
ONE_PASS_MAX_K = 16384


def per_token_quant_fp8(x: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (bf16/fp16/fp32, contiguous last dim) -> (q [M, K] fp8, scale [M] fp32) with
    x ~= q * scale[:, None]: each row's largest |x| maps to the format's max."""
    assert x.dim() == 2 and x.stride(1) == 1
    m, k = x.shape
    q = torch.empty((m, k), dtype=dtype, device=x.device)
    scale = torch.empty(m, dtype=torch.float32, device=x.device)
    if m == 0:
        return q, scale
    q_arg, _, consts = store_args(q, 1.0)
    one_pass = k <= ONE_PASS_MAX_K
    block = triton.next_power_of_2(k) if one_pass else 4096
    _per_token_quant_kernel[(m,)](x, q_arg, scale, k, x.stride(0), q.stride(0), MIN_AMAX_C=MIN_AMAX,
                                  BLOCK_K=block, ONE_PASS=one_pass, **consts,
                                  num_warps=8 if block > 4096 else 4)  # fmt: skip
    return q, scale


def ref_per_token_quant_fp8(x: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of per_token_quant_fp8."""
    m = fp8_max(dtype)
    scale = x.float().abs().amax(dim=1).clamp_min(MIN_AMAX) / m
    q = (x.float() * (1.0 / scale)[:, None]).clamp(-m, m).to(dtype)
    return q, scale


@triton.jit
def _fp8_matmul_kernel(
    a_ptr,
    b_ptr,
    as_ptr,
    bs_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_am,
    stride_bn,
    stride_om,
    HAS_BIAS: tl.constexpr,
    UPCAST: tl.constexpr,
    PROMOTE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """One program = one [BLOCK_M, BLOCK_N] output tile (grouped ordering for L2 reuse of B)."""
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
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        mask_k = (k0 + offs_k)[None, :] < K
        a = tl.load(a_ptrs, mask=mask_k, other=0.0)
        b = tl.load(b_ptrs, mask=mask_k, other=0.0)
        if UPCAST:  # the interpreter has no fp8 dot
            acc = tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)), acc)
        else:
            # Hopper's fp8 wgmma adds into its accumulator with ~14 significant bits unless told
            # otherwise (Triton's default there: never promote). PROMOTE K-elements at a time go
            # through a zeroed partial accumulator, which is then added in full fp32.
            acc = tl.dot(a, tl.trans(b), acc, max_num_imprecise_acc=PROMOTE)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    acc *= tl.load(as_ptr + rows_a)[:, None]
    acc *= tl.load(bs_ptr + rows_b)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rows_b).to(tl.float32)[None, :]
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=mask)


def fp8_matmul(a_q: torch.Tensor, a_scale: torch.Tensor, b_q: torch.Tensor, b_scale: torch.Tensor,
               out_dtype: torch.dtype, bias: torch.Tensor | None = None,
               config: tuple[int, int, int, int, int] | None = None,
               promote: int | None = None) -> torch.Tensor:
    """(a_q * a_scale[:, None]) @ (b_q * b_scale[:, None]).T (+ bias) in out_dtype.

    a_q [M, K], b_q [N, K] fp8 (contiguous last dim); a_scale [M], b_scale [N] fp32; bias [N].
    config: (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) override for tuning.
    promote: K elements per imprecise fp8 partial sum on Hopper (default PROMOTE_K; BLOCK_K or
    more: one partial per K step, promoted; 0: Triton's default, never promoted).
    """
    m, k = a_q.shape
    n = b_q.shape[0]
    assert b_q.shape[1] == k and a_q.stride(1) == 1 and b_q.stride(1) == 1
    assert a_scale.shape == (m,) and b_scale.shape == (n,)
    out = torch.empty((m, n), dtype=out_dtype, device=a_q.device)
    if m == 0 or n == 0:
        return out
    if config is None:
        if interpreting():
            config = (16, 32, 32, 4, 1)
        else:  # H100-friendly default for prefill-sized M; bench_fp8.py sweeps alternatives
            config = (128, 128, 128, 8, 3) if m > 64 else (64, 128, 128, 4, 4)
    bm, bn, bk, warps, stages = config
    promote = PROMOTE_K if promote is None else promote
    promote = min(promote, bk) if promote > 0 else None
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    _fp8_matmul_kernel[grid](a_q, b_q, a_scale, b_scale, bias if bias is not None else b_scale, out, m, n, k,
                             a_q.stride(0), b_q.stride(0), out.stride(0), HAS_BIAS=bias is not None,
                             UPCAST=interpreting(), PROMOTE=promote, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8,
                             num_warps=warps, num_stages=stages)  # fmt: skip
    return out
