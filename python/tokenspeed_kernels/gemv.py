"""Skinny matmul (GEMV for 1..16 rows): out[M, N] = x[M, K] @ weight[N, K].T (+ bias), fp32 accumulation.

Batch-1..8 decode is weight-bandwidth bound: every weight byte is read once per step and each feeds
only M multiply-adds. So the kernel is built to stream W at DRAM speed:

* One program owns BLOCK_N rows of W (= BLOCK_N output columns) for all M rows of x at once, and walks
  K in BLOCK_K steps. A [BLOCK_N, BLOCK_K] tile is BLOCK_N contiguous row segments: 16-byte vector loads,
  fully coalesced. x (at most a few KB) stays in L1/L2.
* Out-of-range rows/columns are clamped to the last valid index instead of masked, so the main loop has
  no masks at all (the duplicate results are simply not stored); only a K tail step is masked.
* Two inner products, picked per shape class: "fma" (broadcast multiply + in-register reduction over K,
  CUDA cores) and "dot" (tl.dot with M padded to 16: tensor cores, whose waste is free here because the
  kernel is memory bound, and whose shared-memory staging gives Triton's software pipeliner deep
  prefetch).
* Optional split-K for shapes with too few row blocks to fill the GPU (e.g. down_proj N=4096,
  K=14336): each (row block, K slice) program writes an fp32 partial, a second tiny kernel sums the
  slices in a fixed order (deterministic: no atomics) and adds the bias.

* FP8 weights (weight_scale=): W is float8 with one fp32 scale per output row; tiles are converted
  to x's dtype in registers (exact) and the scale multiplies the fp32 accumulator: weight-only
  FP8 (W8A16), half the bytes streamed, no activation quantisation.

* Optional programmatic dependent launch (GemvConfig.pdl, Hopper): the kernel is launched with
  launch_pdl, so its grid may start while the previous kernel drains; each program loads its first
  W tile (W is never written by a producer), then waits (griddepcontrol.wait) before it reads x or
  writes anything. That hides the launch gap and the first DRAM round trip behind the producer's
  tail, a fixed ~µs per GEMV that matters at batch 1, where a whole FP8 o_proj streams in ~6 µs.

Everything is CUDA-graph safe: no host syncs, the config is a pure function of (M, N, K, dtype, SM count)
and the only allocations are torch.empty (output, split-K workspace).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

try:  # griddepcontrol (programmatic dependent launch), Triton >= 3.5 on Hopper
    from triton.language.extra.cuda import gdc_wait as _cuda_gdc_wait

    HAS_PDL = True
except (ImportError, AttributeError):  # pragma: no cover - older Triton: GemvConfig.pdl is refused on CUDA
    HAS_PDL = False

if HAS_PDL and os.environ.get("TRITON_INTERPRET", "0") != "1":
    gdc_wait = _cuda_gdc_wait
else:  # the interpreter runs the PDL code path (its peeled first step) with a no-op wait

    @triton.jit
    def gdc_wait() -> None:
        pass

MAX_M = 16  # larger batches are compute-shaped: cuBLAS (F.linear) handles them


@dataclass(frozen=True)
class GemvConfig:
    """Launch configuration of skinny_linear (see _pick_config for the defaults)."""

    block_n: int = 8
    block_k: int = 512
    num_warps: int = 4
    num_stages: int = 1
    use_dot: bool = False
    split_k: int = 1
    reduce_once: bool = False  # fma only: keep a [BLOCK_N, BLOCK_M, BLOCK_K] accumulator, reduce K at the end
    pdl: bool = False  # programmatic dependent launch (CUDA, Hopper+): first W tile before x is ready
    flat: bool = False  # fma with M == 1 only: a 2D [BLOCK_N, BLOCK_K] product, no M axis (see _gemv_step)


def _interpreting() -> bool:
    """TRITON_INTERPRET=1: kernels run on the CPU through numpy."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.cache
def _num_sms(device_index: int) -> int:
    """Multiprocessor count (8 without CUDA, i.e. under the interpreter)."""
    if not torch.cuda.is_available():
        return 8
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@triton.jit
def _load_w(w_ptrs, k_rem, offs_k, MASKED: tl.constexpr):
    """One [BLOCK_N, BLOCK_K] tile of W (masked past k_rem on the tail step)."""
    if MASKED:
        return tl.load(w_ptrs, mask=offs_k[None, :] < k_rem, other=0.0)
    return tl.load(w_ptrs)


@triton.jit
def _gemv_step(
    acc,
    w,
    x_ptrs,
    k_rem,
    offs_k,
    MASKED: tl.constexpr,
    USE_DOT: tl.constexpr,
    DOT_PREC: tl.constexpr,
    UPCAST: tl.constexpr,
    W_FP8: tl.constexpr,
    REDUCE_ONCE: tl.constexpr,
    FLAT: tl.constexpr,
):
    """acc[BLOCK_N, BLOCK_M] += w[BLOCK_N, BLOCK_K] @ X^T[BLOCK_K, BLOCK_M] for one K step, w already
    loaded (REDUCE_ONCE: acc is [BLOCK_N, BLOCK_M, BLOCK_K], += the products; no shuffles per step).
    FLAT (fma, M == 1): x is one row, broadcast over w's rows in 2D, acc [BLOCK_N, 1] (REDUCE_ONCE:
    [BLOCK_N, BLOCK_K]). Why: at 3 TB/s an H100 SM must take ~13 fp8 weights per clock, and the 3D
    form's loop spends ~7.7 SASS instructions on each (sm_90 build of the n2 k1024 w1 tile: 120
    byte permutes per step to reach the 3D layout), ~78% of the SM's issue slots; the 2D loop
    spends 5.4 (4.5 reducing once, at twice the registers)."""
    if USE_DOT:
        # x_ptrs is laid out [BLOCK_K, BLOCK_M] (x transposed) for the dot's B operand.
        if MASKED:
            xt = tl.load(x_ptrs, mask=offs_k[:, None] < k_rem, other=0.0)
        else:
            xt = tl.load(x_ptrs)
        if W_FP8:  # fp8 -> x's dtype is exact; the row scales are applied to the accumulator
            w = w.to(xt.dtype)
        if UPCAST:  # the interpreter's dot mishandles bf16
            w = w.to(tl.float32)
            xt = xt.to(tl.float32)
        acc = tl.dot(w, xt, acc, input_precision=DOT_PREC)
    else:
        # x_ptrs is [BLOCK_M, BLOCK_K]; the product is [BLOCK_N, BLOCK_M, BLOCK_K], reduced over K in registers.
        if MASKED:
            x = tl.load(x_ptrs, mask=offs_k[None, :] < k_rem, other=0.0)
        else:
            x = tl.load(x_ptrs)
        if FLAT:  # x is [1, BLOCK_K]
            prod2 = w.to(tl.float32) * x.to(tl.float32)
            if REDUCE_ONCE:
                acc += prod2
            else:
                acc += tl.sum(prod2, axis=1, keep_dims=True)
        else:
            prod = w.to(tl.float32)[:, None, :] * x.to(tl.float32)[None, :, :]
            if REDUCE_ONCE:
                acc += prod
            else:
                acc += tl.sum(prod, axis=2)
    return acc


@triton.jit
def _gemv_acc(BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              REDUCE_ONCE: tl.constexpr, FLAT: tl.constexpr):
    """The fp32 accumulator _gemv_step adds to: [BLOCK_N, BLOCK_M], or with REDUCE_ONCE the
    unreduced products [BLOCK_N, BLOCK_M, BLOCK_K] ([BLOCK_N, BLOCK_K] when FLAT)."""
    if REDUCE_ONCE and FLAT:
        acc3 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    elif REDUCE_ONCE:
        acc3 = tl.zeros([BLOCK_N, BLOCK_M, BLOCK_K], dtype=tl.float32)
    else:
        acc3 = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    return acc3


@triton.jit
def _gemv_store(acc3, out_ptr, s_ptr, b_ptr, rows_w, pid_s, stride_os, offs_m, offs_n, M, N, stride_om,
                W_FP8: tl.constexpr, HAS_BIAS: tl.constexpr, REDUCE_ONCE: tl.constexpr,
                FLAT: tl.constexpr):
    """The epilogue: reduce what REDUCE_ONCE left unreduced, apply W's row scales (W_FP8) and the
    bias, store [BLOCK_N, BLOCK_M] transposed into out (K slice pid_s's, with split-K)."""
    if REDUCE_ONCE and FLAT:
        acc = tl.sum(acc3, axis=1, keep_dims=True)
    elif REDUCE_ONCE:
        acc = tl.sum(acc3, axis=2)
    else:
        acc = acc3
    if W_FP8:
        acc *= tl.load(s_ptr + rows_w)[:, None]
    if HAS_BIAS:
        acc += tl.load(b_ptr + rows_w).to(tl.float32)[:, None]
    o_ptrs = out_ptr + pid_s * stride_os + offs_m[None, :] * stride_om + offs_n[:, None]
    mask = (offs_n[:, None] < N) & (offs_m[None, :] < M)
    tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gemv_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    s_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    stride_os,
    k_per_split,
    HAS_BIAS: tl.constexpr,
    W_FP8: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_DOT: tl.constexpr,
    DOT_PREC: tl.constexpr,
    UPCAST: tl.constexpr,
    REDUCE_ONCE: tl.constexpr,
    PDL: tl.constexpr,
    FLAT: tl.constexpr,
):
    """Program (i, s): out[:, i*BLOCK_N : (i+1)*BLOCK_N] over K slice s (whole K when unsplit).

    With split-K, out_ptr is the fp32 workspace [splits, M, N] (slice stride stride_os) and the bias is
    added by the reduction kernel. W_FP8: s_ptr holds W's per-row fp32 scales. PDL: launched as a
    programmatic dependent; the first W tile is loaded before griddepcontrol.wait, x (the producer's
    output) and every store after it. The host sets PDL only when every K slice holds at least one
    full BLOCK_K step (so that first load needs no mask).
    """
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    # Clamp instead of masking: the main loop's loads stay unmasked (and vectorized).
    rows_w = tl.minimum(offs_n, N - 1).to(tl.int64)
    rows_x = tl.minimum(offs_m, M - 1)
    k_start = pid_s * k_per_split
    k_len = tl.minimum(K - k_start, k_per_split)
    w_ptrs = w_ptr + rows_w[:, None] * stride_wn + (k_start + offs_k)[None, :]
    if USE_DOT:
        x_ptrs = x_ptr + rows_x[None, :] * stride_xm + (k_start + offs_k)[:, None]
    else:
        x_ptrs = x_ptr + rows_x[:, None] * stride_xm + (k_start + offs_k)[None, :]
    acc3 = _gemv_acc(BLOCK_M, BLOCK_N, BLOCK_K, REDUCE_ONCE, FLAT)
    n_full = k_len // BLOCK_K
    if PDL:  # W streams while the producer of x drains; x only after the wait
        w0 = _load_w(w_ptrs, 0, offs_k, False)
        gdc_wait()
        acc3 = _gemv_step(acc3, w0, x_ptrs, 0, offs_k, False, USE_DOT, DOT_PREC, UPCAST, W_FP8, REDUCE_ONCE, FLAT)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
        n_full -= 1
    for _ in range(n_full):
        w = _load_w(w_ptrs, 0, offs_k, False)
        acc3 = _gemv_step(acc3, w, x_ptrs, 0, offs_k, False, USE_DOT, DOT_PREC, UPCAST, W_FP8, REDUCE_ONCE, FLAT)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    k_rem = k_len - (k_len // BLOCK_K) * BLOCK_K
    if k_rem > 0:
        w = _load_w(w_ptrs, k_rem, offs_k, True)
        acc3 = _gemv_step(acc3, w, x_ptrs, k_rem, offs_k, True, USE_DOT, DOT_PREC, UPCAST, W_FP8, REDUCE_ONCE, FLAT)
    _gemv_store(acc3, out_ptr, s_ptr, b_ptr, rows_w, pid_s, stride_os, offs_m, offs_n, M, N, stride_om,
                W_FP8, HAS_BIAS, REDUCE_ONCE, FLAT)


@triton.jit
def _splitk_reduce_kernel(
    ws_ptr,
    b_ptr,
    out_ptr,
    M,
    N,
    stride_om,
    SPLITS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """out[m, n] = sum_s ws[s, m, n] (+ bias[n]), slices summed in a fixed order (deterministic)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < M * N
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in tl.static_range(SPLITS):
        acc += tl.load(ws_ptr + s * M * N + offs, mask=mask, other=0.0)
    m = offs // N
    n = offs % N
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + m * stride_om + n, acc.to(out_ptr.dtype.element_ty), mask=mask)


def fp8_bucket(m: int) -> int:
    """The FP8_TILES row of a batch of m rows: 1, 2, 4 (3-4), 8 (5-8) or 16 (9-16)."""
    return 1 if m == 1 else 2 if m == 2 else 4 if m <= 4 else 8 if m <= 8 else 16


def fp8_shape_class(n: int, k: int) -> str:
    """'wide' (N >= 16384: gate_up, lm_head), 'long_k' (K >= 8192: down_proj) or 'short' (qkv,
    o_proj): the column of FP8_TILES a weight [N, K] uses."""
    return "wide" if n >= 16384 else "long_k" if k >= 8192 else "short"


_C = GemvConfig
# FP8 weights (W8A16 GEMV) per (fp8_bucket(M), fp8_shape_class(N, K)). `bench_fp8.py --sweep` times
# these entries next to its grid and prints a replacement block in this very form; BLOCK_K is capped
# at K (rounded up to a power of two) when used.
# M=1, M=2 (H100, session 6 sweep, Llama-3.1-8B): two rows per program for the short-K layers (qkv
# 12.0 us, o_proj 9.6, gate_up 43.3) and, for long K (down_proj, K=14336), four rows, 2048-wide K
# steps and two warps (24.3 us instead of 27.9); at M=2 four rows per program stream 4 KB per step
# and share each x load (111 us per layer; best per shape 109). M=1 then went `flat` (the same tiles
# in 2D, 7.7 -> 5.4 SASS instructions per fp8 weight and fewer registers, 71 -> 64 and 153 -> 126,
# read off the sm_90 build). M=1, M=2 rows: the session-8 sweep on the H100 (`FP8_SWEEP_MS=1,2
# bash benches/device_check.sh fp8sweep`, best per class; M=1 step matmuls 2.842 -> 2.788 ms,
# M=2 3.785 -> 3.613 ms). M >= 3: the bf16 rules' tensor-core tiles.
FP8_TILES: dict[tuple[int, str], GemvConfig] = {
    (1, "short"): _C(block_n=2, block_k=1024, num_warps=1, pdl=True, flat=True),  # qkv 10.9, o_proj 8.5 us
    (1, "wide"): _C(block_n=4, block_k=1024, num_warps=2, num_stages=2, pdl=True, flat=True),  # gate_up 40.2, lm_head 170.0
    (1, "long_k"): _C(block_n=2, block_k=2048, num_warps=2, flat=True),  # down 22.2 us
    (2, "short"): _C(block_n=4, block_k=1024, num_warps=1, pdl=True),  # qkv 14.6, o_proj 11.4 us
    (2, "wide"): _C(block_n=4, block_k=512, num_warps=1),  # gate_up 50.0, lm_head 196.2 us
    (2, "long_k"): _C(block_n=8, block_k=1024, num_warps=2, split_k=2),  # down 30.7 us
    (4, "short"): _C(block_n=64, block_k=256, num_warps=4, num_stages=4, use_dot=True),
    (4, "wide"): _C(block_n=128, block_k=128, num_warps=8, num_stages=4, use_dot=True),
    (4, "long_k"): _C(block_n=64, block_k=256, num_warps=4, num_stages=4, use_dot=True, split_k=2),
    (8, "short"): _C(block_n=64, block_k=256, num_warps=4, num_stages=4, use_dot=True),
    (8, "wide"): _C(block_n=128, block_k=128, num_warps=8, num_stages=4, use_dot=True),
    (8, "long_k"): _C(block_n=64, block_k=256, num_warps=4, num_stages=4, use_dot=True, split_k=2),
    (16, "short"): _C(block_n=64, block_k=256, num_warps=4, num_stages=4, use_dot=True),
    (16, "wide"): _C(block_n=128, block_k=128, num_warps=8, num_stages=4, use_dot=True),
    (16, "long_k"): _C(block_n=64, block_k=256, num_warps=4, num_stages=4, use_dot=True, split_k=2),
}


def _pick_config(m: int, n: int, k: int, dtype: torch.dtype, sms: int, w_fp8: bool = False) -> GemvConfig:
    """Deterministic config table per shape class, from `bench_gemv.py --sweep` on an H100 (and an
    H200: each choice is within ~1-2% of the per-shape best on both at the Llama-3.1-8B shapes);
    FP8 weights with bf16/fp16 activations: FP8_TILES (`bench_fp8.py --sweep`).

    M <= 2: "fma" with one warp per program: the K reduction stays inside the warp (shuffles, no
    shared memory or barriers) and thousands of small independent programs keep enough loads in flight.
    M >= 3: the fma variant's per-row shuffles grow with M, so tensor cores ("dot", M padded to 16)
    win; big N takes 128-row tiles, and long K with few row blocks (down_proj) is split in two
    (a tie on the H100, ~3% on the H200).
    """
    if _interpreting():
        # Small tiles keep the numpy interpreter fast; exercise the split-K path on long K.
        return GemvConfig(block_n=32, block_k=128, num_warps=4, split_k=2 if k >= 1024 else 1)
    kcap = max(64, triton.next_power_of_2(k))  # no K step much longer than K itself
    if dtype == torch.float32:
        # Correctness path (exact "ieee" dot): tiles small enough for fp32 registers / shared memory.
        if m == 1:
            return GemvConfig(block_n=2, block_k=min(256, kcap), num_warps=1)
        return GemvConfig(block_n=32, block_k=min(64, kcap), num_warps=4, num_stages=3, use_dot=True)
    if w_fp8:
        cfg = FP8_TILES[(fp8_bucket(m), fp8_shape_class(n, k))]
        return replace(cfg, block_k=min(cfg.block_k, kcap))
    if m == 1:
        return GemvConfig(block_n=1, block_k=min(1024, kcap), num_warps=1)
    if m == 2:
        return GemvConfig(block_n=4, block_k=min(1024, kcap), num_warps=1)
    if n >= 16384:  # gate_up, lm_head
        return GemvConfig(block_n=128, block_k=min(128, kcap), num_warps=8, num_stages=4, use_dot=True)
    split = 2 if k >= 8192 and triton.cdiv(n, 64) < sms else 1
    return GemvConfig(
        block_n=64, block_k=min(256, kcap), num_warps=4, num_stages=4, use_dot=True, split_k=split
    )


def skinny_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    config: GemvConfig | None = None,
    weight_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [M, K] @ weight[N, K].T (+ bias[N]) -> [M, N] in x.dtype, fp32 accumulation (small M).

    x, weight, bias share one dtype (bf16, fp16 or fp32); x and weight need a contiguous last dim.
    FP8 weights: weight is float8_e4m3fn/e5m2 and weight_scale [N] fp32 its per-row scales
    (out = x @ (weight * weight_scale[:, None]).T).
    out, when given, is [M, N] with a contiguous last dim. M > MAX_M falls back to F.linear.
    Deterministic and CUDA-graph capturable (no syncs; output via torch.empty when out is None).
    """
    assert x.dim() == 2 and weight.dim() == 2 and x.shape[1] == weight.shape[1], (x.shape, weight.shape)
    w_fp8 = weight_scale is not None
    if w_fp8:
        assert weight.dtype in (torch.float8_e4m3fn, torch.float8_e5m2), weight.dtype
        assert weight_scale.shape == (weight.shape[0],) and weight_scale.dtype == torch.float32
        assert weight_scale.stride(0) == 1
    else:
        assert x.dtype == weight.dtype, (x.dtype, weight.dtype)
    assert x.stride(1) == 1 and weight.stride(1) == 1, "x and weight need a contiguous last dim"
    m, k = x.shape
    n = weight.shape[0]
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    assert out.shape == (m, n) and out.stride(1) == 1 and out.dtype == x.dtype
    if bias is not None:
        assert bias.shape == (n,) and bias.stride(0) == 1
    if m == 0 or n == 0:
        return out
    if k == 0:
        out.copy_(bias.expand(m, n) if bias is not None else torch.zeros_like(out))
        return out
    if m > MAX_M:
        w = (weight.float() * weight_scale[:, None]).to(x.dtype) if w_fp8 else weight
        out.copy_(F.linear(x, w, bias))
        return out
    dev = x.device.index if x.device.type == "cuda" else 0
    cfg = config or _pick_config(m, n, k, x.dtype, _num_sms(dev if dev is not None else 0), w_fp8)
    upcast = _interpreting() and x.dtype == torch.bfloat16
    block_m = max(16 if cfg.use_dot else 1, triton.next_power_of_2(m))
    dot_prec = "ieee" if x.dtype == torch.float32 or upcast else "tf32"
    # K slices are whole BLOCK_K multiples so only the last slice has a (masked) tail.
    k_per_split = triton.cdiv(triton.cdiv(k, cfg.split_k), cfg.block_k) * cfg.block_k
    splits = triton.cdiv(k, k_per_split)
    grid = (triton.cdiv(n, cfg.block_n), splits)
    # PDL's first W load is unmasked: every K slice (the last one too) needs a full BLOCK_K step.
    pdl = cfg.pdl and k - (splits - 1) * k_per_split >= cfg.block_k
    common = {"BLOCK_M": block_m, "BLOCK_N": cfg.block_n, "BLOCK_K": cfg.block_k, "USE_DOT": cfg.use_dot,
              "DOT_PREC": dot_prec, "UPCAST": upcast, "num_warps": cfg.num_warps, "num_stages": cfg.num_stages,
              "REDUCE_ONCE": cfg.reduce_once and not cfg.use_dot, "PDL": pdl,
              "FLAT": cfg.flat and block_m == 1 and not cfg.use_dot}  # fmt: skip
    if pdl and x.is_cuda and not _interpreting():
        if not HAS_PDL:
            raise ValueError("GemvConfig(pdl=True) needs Triton's griddepcontrol (Triton >= 3.5)")
        common["launch_pdl"] = True
    b_arg = bias if bias is not None else x  # never read when HAS_BIAS is False
    s_arg = weight_scale if w_fp8 else x  # never read when W_FP8 is False
    common["W_FP8"] = w_fp8
    if splits == 1:
        _gemv_kernel[grid](x, weight, b_arg, s_arg, out, m, n, k, x.stride(0), weight.stride(0), out.stride(0),
                           0, k_per_split, HAS_BIAS=bias is not None, **common)  # fmt: skip
        return out
    ws = torch.empty((splits, m, n), dtype=torch.float32, device=x.device)
    _gemv_kernel[grid](x, weight, b_arg, s_arg, ws, m, n, k, x.stride(0), weight.stride(0), n, m * n,
                       k_per_split, HAS_BIAS=False, **common)  # fmt: skip
    block = 1024
    _splitk_reduce_kernel[(triton.cdiv(m * n, block),)](ws, b_arg, out, m, n, out.stride(0), SPLITS=splits,
                                                         HAS_BIAS=bias is not None, BLOCK=block,
                                                         num_warps=4)  # fmt: skip
    return out
