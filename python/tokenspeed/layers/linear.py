"""Linear layers: column-parallel (incl. fused qkv / gate_up) and row-parallel, loading HF weights.

Tensor parallelism seam: every layer knows its `tp_rank`/`tp_size` and loads its own shard of a
full HF tensor in `weight_loader` through `shard_rows`/`shard_cols`. Only tp_size == 1 exists today;
for TP > 1, RowLinear's output additionally needs an all-reduce (marked below).
"""

from __future__ import annotations

import torch
from torch import nn


def shard_rows(full: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
    """This rank's slice of dim 0 (output features of a column-parallel weight)."""
    if tp_size == 1:
        return full
    size = full.shape[0] // tp_size
    return full.narrow(0, tp_rank * size, size)


def shard_cols(full: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
    """This rank's slice of dim 1 (input features of a row-parallel weight)."""
    if tp_size == 1 or full.dim() == 1:
        return full
    size = full.shape[1] // tp_size
    return full.narrow(1, tp_rank * size, size)


# Up to this many rows (decode batches) a CUDA matmul streams the weights through
# tokenspeed_kernels.skinny_linear: 0.42 ms faster than cuBLAS per Llama-3.1-8B step at batch 1
# on the H100 (kernels/bench/bench_gemv.py); beyond it cuBLAS is the better kernel.
SKINNY_MAX_ROWS = 8


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           weight_scale: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T (+ b): the skinny GEMV kernel for small decode batches on CUDA, cuBLAS otherwise.
    weight_scale: FP8 weights (layers/quantization/fp8.py picks their kernels)."""
    if weight_scale is not None:
        from tokenspeed.layers.quantization.fp8 import fp8_linear

        return fp8_linear(x, weight, weight_scale, bias)
    if (x.is_cuda and x.dim() == 2 and x.shape[0] <= SKINNY_MAX_ROWS
            and x.dtype in (torch.bfloat16, torch.float16) and x.dtype == weight.dtype
            and x.stride(1) == 1):
        from tokenspeed_kernels import skinny_linear

        return skinny_linear(x, weight, bias)
    return nn.functional.linear(x, weight, bias)


def _check_tp(tp_size: int) -> None:
    if tp_size != 1:
        raise NotImplementedError("tensor parallelism is not implemented yet (tp_size must be 1)")


def _copy(param: torch.Tensor, loaded: torch.Tensor, what: str) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"{what}: checkpoint shape {tuple(loaded.shape)} != "
                         f"parameter shape {tuple(param.shape)}")
    with torch.no_grad():
        param.copy_(loaded)


class ColumnLinear(nn.Module):
    """y = x W^T (+ b), W split by output features across TP ranks.

    `output_sizes` lists the fused sub-matrices (e.g. [q, k, v] or [gate, up]); each HF tensor is
    loaded into its slice by shard index.
    """

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False,
                 tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__()
        _check_tp(tp_size)
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.output_sizes = [s // tp_size for s in output_sizes]
        out = sum(self.output_sizes)
        self.weight = nn.Parameter(torch.empty(out, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out), requires_grad=False) if bias else None
        self.weight_scale: nn.Parameter | None = None  # set by FP8 quantization

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: int = 0) -> None:
        offset = sum(self.output_sizes[:shard])
        size = self.output_sizes[shard]
        local = shard_rows(loaded, self.tp_rank, self.tp_size)
        _copy(param.data.narrow(0, offset, size), local.to(param.dtype), f"shard {shard}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.weight_scale)


class QKVLinear(ColumnLinear):
    """Fused q/k/v projection; HF `q_proj`, `k_proj`, `v_proj` load into shards 0, 1, 2."""

    def __init__(self, hidden_size: int, q_size: int, kv_size: int, bias: bool = False,
                 tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__(hidden_size, [q_size, kv_size, kv_size], bias, tp_rank, tp_size)

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = qkv.split(self.output_sizes, dim=-1)
        return q, k, v


class GateUpLinear(ColumnLinear):
    """Fused gate/up projection of a gated MLP; HF `gate_proj`, `up_proj` load into shards 0, 1."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False,
                 tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__(hidden_size, [intermediate_size, intermediate_size], bias, tp_rank, tp_size)


class RowLinear(nn.Module):
    """y = x W^T (+ b), W split by input features across TP ranks (o_proj, down_proj)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__()
        _check_tp(tp_size)
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.weight = nn.Parameter(torch.empty(out_features, in_features // tp_size),
                                   requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.weight_scale: nn.Parameter | None = None  # set by FP8 quantization

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: int = 0) -> None:
        _copy(param.data, shard_cols(loaded, self.tp_rank, self.tp_size).to(param.dtype), "row")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # With TP > 1: partial sums -> all-reduce here, and add the bias on one rank only.
        return linear(x, self.weight, self.bias, self.weight_scale)
