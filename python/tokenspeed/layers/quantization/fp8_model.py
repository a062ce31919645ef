"""FP8 weights over a built model: which of its linear layers FP8 covers (the checkpoint's ignore
list, in HF module names), fp8 parameters for an FP8 checkpoint to fill (`prepare_fp8_checkpoint`),
and quantising what still holds high-precision weights once loaded (`quantize_model`). The
layers then run through fp8.py's `fp8_linear`.

Block-scaled checkpoints (Fp8Config.weight_block, DeepSeek-V3): the linears' `weight_scale` is the
checkpoint's `weight_scale_inv` grid [ceil(N/bn), ceil(K/bk)] (`checkpoint_names` renames it), cut
on the block grid for fused sub-matrices and TP shards; the routed experts (FusedMoE) get fp8
`gate_up_proj` / `down_proj` with `gate_up_proj_scale` / `down_proj_scale` grids the same way. The
linears a model reads as matrices (its HIGH_PRECISION_LINEARS: MLA's kv_b_proj) are dequantised to
the model dtype once loaded.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from tokenspeed.layers.embedding import LMHead
from tokenspeed.layers.linear import ColumnLinear, RowLinear
from tokenspeed.layers.moe import FusedMoE
from tokenspeed.layers.quantization.fp8 import FP8, dequantize, quantize_blocks, quantize_per_channel
from tokenspeed.layers.quantization.methods import Fp8Config, QuantizationError


def _hf_name(model: nn.Module, name: str) -> str:
    """The checkpoint's name of the model's module `name`: the same, but for a module built
    apart from the checkpoint's root that says where its tensors live (`hf_module_name`: a draft
    head, models/deepseek_mtp.py, whose decoder layer is `model.layers.N.` on disk)."""
    rename = getattr(model, "hf_module_name", None)
    return rename(name) if rename is not None else name


def _linear_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module, list[str]]]:
    """(name, module, the HF module names it holds) of every ColumnLinear/RowLinear. The model
    names the HF modules it fuses in its STACKED_PARAMS ((HF fragment, ours, shard) rows, as
    models/llama.py declares them); a model without them fuses nothing."""
    stacked = getattr(model, "STACKED_PARAMS", ())
    for name, module in model.named_modules():
        if not isinstance(module, (ColumnLinear, RowLinear)):
            continue
        key = _hf_name(model, name) + "."
        parts = [key.replace(ours, hf) for hf, ours, _ in stacked if ours in key]
        yield name, module, [p.rstrip(".") for p in parts] or [key.rstrip(".")]


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


def checkpoint_names(tensors: Iterable[tuple[str, torch.Tensor]], cfg: Fp8Config
                     ) -> Iterator[tuple[str, torch.Tensor]]:
    """A block-scaled checkpoint's tensors with `weight_scale_inv` named `weight_scale`, the
    parameter that holds it (the others pass as they are)."""
    for name, tensor in tensors:
        if cfg.weight_block is not None and name.endswith(".weight_scale_inv"):
            name = name[: -len("_inv")]
        yield name, tensor


def _blocks(size: int, block: int, what: str) -> int:
    if size % block:
        raise QuantizationError(f"{what}: {size} rows/columns do not cut on the {block}-wide "
                                "block grid of the checkpoint's FP8 weight scales")
    return size // block


def _block_scale_loader(module: nn.Module, loader: object, block: tuple[int, int]) -> object:
    """The module's weight_loader, taking the checkpoint's block-scale grid [ceil(N/bn), ceil(K/bk)]
    into this layer's grid: a fused sub-matrix's block rows at its offset, a column-parallel
    shard's block rows, a row-parallel shard's block columns."""
    bn, bk = block

    def load(param: nn.Parameter, loaded: torch.Tensor, shard: int = 0) -> None:
        if param is not module.weight_scale:
            loader(param, loaded, shard)  # type: ignore[operator]
            return
        grid = loaded.to(torch.float32)  # a Tensor or a weights.LazyTensor (small: read whole)
        if isinstance(module, ColumnLinear):
            part, parts = module.shard_splits[shard]
            size, offset = module.output_sizes[shard], sum(module.output_sizes[:shard])
            if len(module.output_sizes) == 1 and parts == 1:
                dst = param.data  # one whole matrix: a partial last block is fine
            else:
                rows = _blocks(size, bn, f"shard {shard} of a fused/TP linear")
                dst = param.data.narrow(0, _blocks(offset, bn, "a fused linear"), rows)
                grid = grid.narrow(0, part * rows, rows)
        else:
            cols = param.shape[1]
            if module.tp_size > 1:
                _blocks(module.weight.shape[1], bk, "a row-parallel shard")
                grid = grid.narrow(1, module.tp_rank * cols, cols)
            dst = param.data
        if dst.shape != grid.shape:
            raise ValueError(f"block scales: checkpoint grid {tuple(grid.shape)} != "
                             f"parameter {tuple(dst.shape)}")
        with torch.no_grad():
            dst.copy_(grid)

    return load


def _make_fp8_block(module: nn.Module, block: tuple[int, int]) -> None:
    """An fp8 `weight` and an fp32 block-scale grid `weight_scale` of the module's shape."""
    w = module.weight
    grid = (-(-w.shape[0] // block[0]), -(-w.shape[1] // block[1]))
    module.weight = nn.Parameter(torch.empty(w.shape, dtype=FP8, device=w.device), requires_grad=False)
    module.weight_scale = nn.Parameter(torch.ones(grid, dtype=torch.float32, device=w.device),
                                       requires_grad=False)
    module.weight_loader = _block_scale_loader(module, module.weight_loader, block)


def _prepare_blocks(model: nn.Module, cfg: Fp8Config) -> None:
    assert cfg.weight_block is not None
    for _, module in _quantized_modules(model, cfg):
        _make_fp8_block(module, cfg.weight_block)
    for name, module in model.named_modules():
        if isinstance(module, FusedMoE) and not cfg.ignores(_hf_name(model, name)):
            module.make_fp8_block(cfg.weight_block)


def prepare_fp8_checkpoint(model: nn.Module, cfg: Fp8Config) -> None:
    """Before loading an FP8 checkpoint: quantised layers (and the LM head, when the checkpoint's
    is FP8) get an fp8 `weight` and an fp32 `weight_scale` (per row; a block grid for a block-wise
    checkpoint, routed experts included), which the checkpoint's tensors then fill."""
    if cfg.weight_block is not None:
        _prepare_blocks(model, cfg)
    else:
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
    if cfg.weight_block is not None:
        count = _quantize_blocks(model, cfg)
        _dequantize_matrices(model, dtype)
    else:
        count = 0
        for _, module in _quantized_modules(model, cfg):
            if module.weight.dtype != FP8:
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


def _quantize_blocks(model: nn.Module, cfg: Fp8Config) -> int:
    """A block-FP8 config's layers still in high precision (dummy weights: the checkpoint's
    tensors arrive fp8) block-quantised as the checkpoint would hold them: linears' weight + scale
    grid, the routed experts' fp8 banks. The layers the model reads as matrices stay as they are
    (a checkpoint's are dequantised anyway). Each rank quantises its shard: the same tiles as the
    full tensor's wherever shards cut on the block grid (V3 at TP <= 8, any EP), so the dummy
    model stays the same at every layout."""
    block = cfg.weight_block
    assert block is not None
    suffixes = tuple("." + s for s in getattr(model, "HIGH_PRECISION_LINEARS", ()))
    count = 0
    for name, module in _quantized_modules(model, cfg):
        if module.weight.dtype == FP8 or name.endswith(suffixes):
            continue
        q, scale = quantize_blocks(module.weight.data, block)
        module.weight = nn.Parameter(q, requires_grad=False)
        module.weight_scale = nn.Parameter(scale, requires_grad=False)
        count += 1
    for name, module in model.named_modules():
        if isinstance(module, FusedMoE) and not cfg.ignores(_hf_name(model, name)) \
                and module.gate_up_proj.dtype != FP8:
            module.quantize_fp8_block(block)
            count += 1
    return count


def _dequantize_matrices(model: nn.Module, dtype: torch.dtype | None) -> None:
    """The block-scaled linears the model reads as matrices, not through linear() (its
    HIGH_PRECISION_LINEARS name suffixes; MLA's kv_b_proj), dequantised to `dtype` once."""
    suffixes = tuple("." + s for s in getattr(model, "HIGH_PRECISION_LINEARS", ()))
    for name, module in model.named_modules():
        if not name.endswith(suffixes) or getattr(module, "weight_scale", None) is None:
            continue
        if dtype is None:
            raise ValueError(f"{name} must be dequantised: pass the model dtype")
        module.weight = nn.Parameter(dequantize(module.weight, module.weight_scale, dtype),
                                     requires_grad=False)
        module.weight_scale = None
