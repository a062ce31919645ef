"""FP8 (e4m3) linear layers: per-output-channel weight scales, dynamic per-token activation scales.

A quantised ColumnLinear/RowLinear (and the LMHead, when Fp8Config.lm_head: --lm-head-quantization)
keeps `weight` as float8_e4m3fn [N, K] and `weight_scale` as fp32 [N] (W ~= weight *
weight_scale[:, None]); layers/linear.py hands such a layer's matmul to `fp8_linear`, which picks
the kernel:
* CUDA, up to SKINNY_MAX_ROWS rows (decode): tokenspeed_kernels.skinny_linear with weight_scale,
  weight-only FP8 (the activations stay bf16): the weight stream is the cost, and it is halved;
* CUDA, more rows: activations quantised per token (per_token_quant_fp8), then cuBLAS FP8
  (torch._scaled_mm with row-wise scales; per-tensor scales plus an fp32 rescale where a torch
  build lacks row-wise scaling) or, with TOKENSPEED_FP8_GEMM=triton, tokenspeed_kernels.fp8_matmul;
* elsewhere (CPU tests): dequantise, then matmul (the reference).
TOKENSPEED_FP8_GEMM=reference (or setting GEMM_BACKEND) runs `reference_linear` instead on any
device: the same numerics in fp32 torch, kernel-free (benches/fp8_accuracy.py compares the kernels
against it at model level).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator

import torch
from torch import nn

from tokenspeed.layers.quantization.methods import Fp8Config, QuantizationError

logger = logging.getLogger(__name__)

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)
SKINNY_MAX_ROWS = 8  # as for bf16 (layers/linear.py): the GEMV's range, cuBLAS above it
# "cublas" (default), "triton" (to measure both) or "reference" (reference_linear).
GEMM_BACKEND = os.environ.get("TOKENSPEED_FP8_GEMM", "cublas")
_rowwise_ok: bool | None = None  # torch._scaled_mm with row-wise scales: learnt on first use


def quantize_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (fp8 [N, K], fp32 scales [N]): each row's max |w| maps to 448."""
    scale = w.float().abs().amax(dim=1).clamp_min(1e-12) / FP8_MAX
    q = (w.float() / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


def dequantize(weight: torch.Tensor, weight_scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (weight.float() * weight_scale[:, None]).to(dtype)


def _scaled_mm(xq: torch.Tensor, xs: torch.Tensor, w: torch.Tensor, ws: torch.Tensor,
               dtype: torch.dtype) -> torch.Tensor:
    """cuBLAS FP8 GEMM: row-wise scales where supported, else per-tensor plus an fp32 rescale."""
    global _rowwise_ok
    if _rowwise_ok is not False:
        try:
            out = torch._scaled_mm(xq, w.t(), scale_a=xs.view(-1, 1), scale_b=ws.view(1, -1),
                                   out_dtype=dtype)
            _rowwise_ok = True
            return out
        except (RuntimeError, ValueError) as e:
            if _rowwise_ok:  # it worked before: this is a real error
                raise
            logger.warning("torch._scaled_mm without row-wise scales here (%s); using per-tensor "
                           "scales and an fp32 rescale", e)
            _rowwise_ok = False
    one = torch.ones((), dtype=torch.float32, device=xq.device)
    out = torch._scaled_mm(xq, w.t(), scale_a=one, scale_b=one, out_dtype=torch.float32)
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
    """x W^T (+ b) with W = weight (fp8) * weight_scale[:, None]; output in x's dtype."""
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


# --- model surgery ---------------------------------------------------------------------------


def _linear_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module, list[str]]]:
    """(name, module, the HF module names it holds) of every ColumnLinear/RowLinear."""
    from tokenspeed.layers.linear import ColumnLinear, RowLinear
    from tokenspeed.models.llama import STACKED_PARAMS

    for name, module in model.named_modules():
        if not isinstance(module, (ColumnLinear, RowLinear)):
            continue
        key = name + "."
        parts = [key.replace(ours, hf) for hf, ours, _ in STACKED_PARAMS if ours in key]
        yield name, module, [p.rstrip(".") for p in parts] or [name]


def _quantized_modules(model: nn.Module, cfg: Fp8Config) -> Iterator[tuple[str, nn.Module]]:
    for name, module, hf_names in _linear_modules(model):
        ignored = [cfg.ignores(h) for h in hf_names]
        if all(ignored):
            continue
        if any(ignored):
            raise QuantizationError(f"{name}: the checkpoint leaves only some of {hf_names} "
                                    "unquantised; TokenSpeed fuses them into one layer")
        yield name, module


def _scale_loader(module: nn.Module, loader: object) -> object:
    """The module's weight_loader, with checkpoint weight scales ([N, 1], [N], [1] or scalar:
    per channel or per tensor) turned into this shard's per-channel [rows] first."""
    from tokenspeed.layers.linear import ColumnLinear

    def load(param: nn.Parameter, loaded: torch.Tensor, shard: int = 0) -> None:
        if param is module.weight_scale:
            if isinstance(module, ColumnLinear):
                rows = module.output_sizes[shard] * module.tp_size
            else:
                rows = module.weight.shape[0]
            loaded = loaded.to(torch.float32).reshape(-1)  # a Tensor or a weights.LazyTensor
            if loaded.numel() == 1:
                loaded = loaded.expand(rows)
        loader(param, loaded, shard)  # type: ignore[operator]

    return load


def _head_scale_loader(head: nn.Module, loader: object) -> object:
    """The LM head's weight_loader, taking the checkpoint's head scale too ([V, 1], [V], [1] or
    scalar) as this rank's rows of per-row scales (vocab-parallel, padded rows 0)."""

    def load(param: nn.Parameter, loaded: torch.Tensor, shard: int = 0) -> None:
        if param is not head.weight_scale:
            loader(param, loaded, shard)  # type: ignore[operator]
            return
        scale = loaded.to(torch.float32).reshape(-1)  # a Tensor or a weights.LazyTensor
        if scale.numel() == 1:
            scale = scale.expand(head.vocab_size)
        if scale.numel() != head.vocab_size:
            raise ValueError(f"lm_head.weight_scale: {scale.numel()} scales for a vocabulary of "
                             f"{head.vocab_size} (expected one per row or one in all)")
        with torch.no_grad():
            param.zero_()
            param[: head.end - head.start].copy_(scale[head.start:head.end])

    return load


def _make_fp8(module: nn.Module) -> None:
    """An fp8 `weight` and an fp32 per-row `weight_scale` of the module's shape, to be filled."""
    w = module.weight
    module.weight = nn.Parameter(torch.empty(w.shape, dtype=FP8, device=w.device),
                                 requires_grad=False)
    module.weight_scale = nn.Parameter(torch.empty(w.shape[0], dtype=torch.float32,
                                                   device=w.device), requires_grad=False)


def prepare_fp8_checkpoint(model: nn.Module, cfg: Fp8Config) -> None:
    """Before loading an FP8 checkpoint: quantised layers (and the LM head, when the checkpoint's
    is FP8) get an fp8 `weight` and an fp32 `weight_scale`, which the checkpoint's tensors then
    fill."""
    from tokenspeed.layers.embedding import LMHead

    for _, module in _quantized_modules(model, cfg):
        _make_fp8(module)
        module.weight_loader = _scale_loader(module, module.weight_loader)
    head = getattr(model, "lm_head", None)
    if cfg.checkpoint_lm_head and isinstance(head, LMHead):
        _make_fp8(head)
        head.weight_loader = _head_scale_loader(head, head.weight_loader)


def _quantize_weight(module: nn.Module) -> None:
    """module.weight -> fp8 `weight` + fp32 per-row `weight_scale`. The new Parameter replaces the
    attribute only: a weight shared with another module (a tied LM head's embedding) stays there."""
    q, scale = quantize_per_channel(module.weight.data)
    module.weight = nn.Parameter(q, requires_grad=False)
    module.weight_scale = nn.Parameter(scale, requires_grad=False)


@torch.no_grad()
def quantize_model(model: nn.Module, cfg: Fp8Config, dtype: torch.dtype | None = None) -> int:
    """After loading: quantise every layer FP8 should cover that still holds high-precision
    weights (all of them for --quantization fp8 or dummy weights), and the LM head when
    cfg.lm_head. Returns how many. An FP8 head (the checkpoint's) without cfg.lm_head
    (--lm-head-quantization none) is dequantised to `dtype` instead."""
    from tokenspeed.layers.embedding import LMHead

    count = 0
    for _, module in _quantized_modules(model, cfg):
        if module.weight.dtype == FP8:
            continue
        _quantize_weight(module)
        count += 1
    head = getattr(model, "lm_head", None)
    if cfg.lm_head and isinstance(head, LMHead) and head.weight.dtype != FP8:
        _quantize_weight(head)  # tied: the embedding keeps its high-precision table for lookups
        count += 1
    elif not cfg.lm_head and isinstance(head, LMHead) and head.weight.dtype == FP8:
        if dtype is None:
            raise ValueError("the LM head is FP8 and must be dequantised: pass the model dtype")
        head.weight = nn.Parameter(dequantize(head.weight, head.weight_scale, dtype),
                                   requires_grad=False)
        head.weight_scale = None
    return count
