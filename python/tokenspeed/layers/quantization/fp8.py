"""FP8 (e4m3) linear layers: per-output-channel weight scales, dynamic per-token activation scales.

A quantised ColumnLinear/RowLinear (and the LMHead, when Fp8Config.lm_head: --lm-head-quantization)
keeps `weight` as float8_e4m3fn [N, K] and `weight_scale` as fp32 [N] (W ~= weight *
weight_scale[:, None]); layers/linear.py hands such a layer's matmul to `fp8_linear`, which picks
the kernel:
* CUDA, up to SKINNY_MAX_ROWS rows (decode): tokenspeed_kernels.skinny_linear with weight_scale,
  weight-only FP8 (the activations stay bf16): the weight stream is the cost, and it is halved;
* CUDA, more rows: activations quantised per token (per_token_quant_fp8), then cuBLAS FP8
  (torch._scaled_mm with row-wise scales; per-tensor scales plus an fp32 rescale where a torch
  build lacks row-wise scaling) or, with TOKENSPEED_FP8_GEMM=triton, tokenspeed_kernels.fp8_matmul.
  cuBLAS runs with Hopper's fast FP8 accumulation (as the CUTLASS FP8 kernels of vLLM and SGLang
  do): 20% less GEMM time at S1's decode batch (kernels/bench/bench_fp8.py, mm_fast);
  TOKENSPEED_FP8_GEMM=cublas_promote keeps cuBLAS's periodic promotion to fp32 instead;
* elsewhere (CPU tests): dequantise, then matmul (the reference).
Block-scaled weights (DeepSeek-V3's checkpoints: `weight_scale` 2-D, one scale per FP8_BLOCK tile
of the weight, [ceil(N / 128), ceil(K / 128)]) go to `fp8_block_linear` instead: activations
quantised per token per 128-column group, then tokenspeed_kernels.w8a8_block_matmul on CUDA (both
scales applied per K-block); elsewhere `reference_block_linear`, the same numerics in fp32 torch.
TOKENSPEED_FP8_GEMM=reference (or setting GEMM_BACKEND) runs `reference_linear` instead on any
device: the same numerics in fp32 torch, kernel-free (benches/diagnostics/fp8_accuracy.py compares the kernels
against it at model level).
"""

from __future__ import annotations

import logging
import os

import torch
from torch import nn

logger = logging.getLogger(__name__)

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)
# The weight block of block-scaled checkpoints: DeepSeek-V3's, the only size methods.py accepts.
FP8_BLOCK = (128, 128)
SKINNY_MAX_ROWS = 8  # as for bf16 (layers/linear.py): the GEMV's range, cuBLAS above it
# "cublas" (default), "cublas_promote", "triton" (to measure them) or "reference" (reference_linear).
GEMM_BACKEND = os.environ.get("TOKENSPEED_FP8_GEMM", "cublas")
FAST_ACCUM = GEMM_BACKEND != "cublas_promote"
_rowwise_ok: bool | None = None  # torch._scaled_mm with row-wise scales: learnt on first use


def quantize_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (fp8 [N, K], fp32 scales [N]): each row's max |w| maps to 448."""
    scale = w.float().abs().amax(dim=1).clamp_min(1e-12) / FP8_MAX
    q = (w.float() / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


def quantize_blocks(w: torch.Tensor, block: tuple[int, int] = FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (fp8 [N, K], fp32 block scales [ceil(N / bn), ceil(K / bk)]): each tile's max
    |w| maps to 448, the layout of a block-scaled checkpoint's weight and `weight_scale_inv`
    (partial last tiles as there). Dummy weights under a block-FP8 config take this form."""
    bn, bk = block
    n, k = w.shape
    rows, cols = -(-n // bn), -(-k // bk)
    padded = torch.nn.functional.pad(w.float(), (0, cols * bk - k, 0, rows * bn - n))
    scale = padded.view(rows, bn, cols, bk).abs().amax(dim=(1, 3)).clamp_min(1e-12) / FP8_MAX
    full = scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    return (w.float() / full).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def dequantize(weight: torch.Tensor, weight_scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The weight in `dtype`: per-channel scales [N], or block scales [N / bn, K / bk] (2-D)."""
    if weight_scale.dim() == 2:
        from tokenspeed_kernels.fp8_block import dequantize_block

        return dequantize_block(weight, weight_scale, FP8_BLOCK, dtype)
    return (weight.float() * weight_scale[:, None]).to(dtype)


def reference_block_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                           bias: torch.Tensor | None = None) -> torch.Tensor:
    """fp8_block_linear's numerics in fp32 torch: activations rounded to fp8 per token per
    128-group, both operands dequantised, fp32 matmul, output rounded to x's dtype."""
    from tokenspeed_kernels.fp8_block import dequantize_block, ref_per_token_group_quant_fp8

    k = x.shape[-1]
    xq, xs = ref_per_token_group_quant_fp8(x.reshape(-1, k), FP8_BLOCK[1])
    out = dequantize_block(xq, xs, (1, FP8_BLOCK[1])) @ dequantize_block(weight, weight_scale, FP8_BLOCK).T
    if bias is not None:
        out += bias.float()
    return out.to(x.dtype).view(*x.shape[:-1], weight.shape[0])


def fp8_block_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T (+ b) with W = weight (fp8 [N, K]) * its FP8_BLOCK tile's weight_scale; W8A8 at every
    batch size (no weight-only GEMV: the block matmul streams the fp8 weight once either way)."""
    if GEMM_BACKEND == "reference" or not x.is_cuda:
        return reference_block_linear(x, weight, weight_scale, bias)
    from tokenspeed_kernels.fp8_block import per_token_group_quant_fp8, w8a8_block_matmul

    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    xq, xs = per_token_group_quant_fp8(x2, FP8_BLOCK[1])
    out = w8a8_block_matmul(xq, xs, weight, weight_scale, FP8_BLOCK, x.dtype)
    if bias is not None:
        out += bias
    return out.view(*shape[:-1], weight.shape[0])


def _scaled_mm(xq: torch.Tensor, xs: torch.Tensor, w: torch.Tensor, ws: torch.Tensor,
               dtype: torch.dtype) -> torch.Tensor:
    """cuBLAS FP8 GEMM: row-wise scales where supported, else per-tensor plus an fp32 rescale."""
    global _rowwise_ok
    if _rowwise_ok is not False:
        try:
            out = torch._scaled_mm(xq, w.t(), scale_a=xs.view(-1, 1), scale_b=ws.view(1, -1),
                                   out_dtype=dtype, use_fast_accum=FAST_ACCUM)
            _rowwise_ok = True
            return out
        except (RuntimeError, ValueError) as e:
            if _rowwise_ok:  # it worked before: this is a real error
                raise
            logger.warning("torch._scaled_mm without row-wise scales here (%s); using per-tensor "
                           "scales and an fp32 rescale", e)
            _rowwise_ok = False
    one = torch.ones((), dtype=torch.float32, device=xq.device)
    out = torch._scaled_mm(xq, w.t(), scale_a=one, scale_b=one, out_dtype=torch.float32,
                           use_fast_accum=FAST_ACCUM)
    return (out * xs[:, None] * ws[None, :]).to(dtype)


def reference_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """fp8_linear's numerics on CUDA, in fp32 torch: weight-only up to SKINNY_MAX_ROWS rows (the
    GEMV), per-token fp8 activations above (W8A8); fp32 accumulation, output rounded to x's dtype."""
    k = x.shape[-1]
    x2 = x.reshape(-1, k).float()
    if x2.shape[0] > SKINNY_MAX_ROWS:
        scale = x2.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / FP8_MAX
        x2 = (x2 * scale.reciprocal()).clamp(-FP8_MAX, FP8_MAX).to(FP8).float() * scale  # as the kernel
    out = x2 @ (weight.float() * weight_scale[:, None]).T
    if bias is not None:
        out += bias.float()
    return out.to(x.dtype).view(*x.shape[:-1], weight.shape[0])


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T (+ b) with W = weight (fp8) * weight_scale[:, None]; output in x's dtype. A 2-D
    weight_scale holds block scales (fp8_block_linear)."""
    if weight_scale.dim() == 2:
        return fp8_block_linear(x, weight, weight_scale, bias)
    if GEMM_BACKEND == "reference":
        return reference_linear(x, weight, weight_scale, bias)
    if not x.is_cuda:
        return nn.functional.linear(x, dequantize(weight, weight_scale, x.dtype), bias)
    from tokenspeed_kernels import fp8_matmul, per_token_quant_fp8, skinny_linear

    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    n, k = weight.shape
    if x2.shape[0] <= SKINNY_MAX_ROWS:
        out = skinny_linear(x2, weight, bias, weight_scale=weight_scale)
    else:
        xq, xs = per_token_quant_fp8(x2)
        if GEMM_BACKEND == "triton" or n % 16 or k % 16:  # cuBLAS FP8 needs multiples of 16
            out = fp8_matmul(xq, xs, weight, weight_scale, x.dtype, bias=bias)
        else:
            out = _scaled_mm(xq, xs, weight, weight_scale, x.dtype)
            if bias is not None:
                out += bias
    return out.view(*shape[:-1], n)
