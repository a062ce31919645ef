"""FP8 weights over a built model: which of its linear layers FP8 covers (the checkpoint's ignore
list, in HF module names), fp8 parameters for an FP8 checkpoint to fill (`prepare_fp8_checkpoint`),
and quantising what still holds high-precision weights once loaded (`quantize_model`). The
layers then run through fp8.py's `fp8_linear`.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from tokenspeed.layers.embedding import LMHead
from tokenspeed.layers.linear import ColumnLinear, RowLinear
from tokenspeed.layers.quantization.fp8 import FP8, dequantize, quantize_per_channel
from tokenspeed.layers.quantization.methods import Fp8Config, QuantizationError


def _linear_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module, list[str]]]:
    """(name, module, the HF module names it holds) of every ColumnLinear/RowLinear. The model
    names the HF modules it fuses in its STACKED_PARAMS ((HF fragment, ours, shard) rows, as
    models/llama.py declares them); a model without them fuses nothing."""
    stacked = getattr(model, "STACKED_PARAMS", ())
    for name, module in model.named_modules():
        if not isinstance(module, (ColumnLinear, RowLinear)):
            continue
        key = name + "."
        parts = [key.replace(ours, hf) for hf, ours, _ in stacked if ours in key]
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
