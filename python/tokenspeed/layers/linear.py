"""Linear layers: column-parallel (incl. fused qkv / gate_up) and row-parallel, loading HF weights.

Tensor parallelism: every layer knows its `tp_rank`/`tp_size` and loads only its shard of a full
HF tensor in `weight_loader` (through `shard_rows`/`shard_cols`, which read just that range of a
lazily opened safetensors tensor). A column-parallel output stays split (the next row-parallel
layer consumes it as is); a row-parallel output is a partial sum, all-reduced over its TP group.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tokenspeed.distributed.groups import tp_all_reduce
from tokenspeed.layers import batch_invariant
from tokenspeed.layers.lora import LoraWeights
from tokenspeed.layers.quantization.fp8 import fp8_linear


def shard_rows(full: Any, tp_rank: int, tp_size: int) -> Any:
    """This rank's slice of dim 0 (output features of a column-parallel weight). `full` is a
    tensor or a `weights.LazyTensor` (then only the slice is read)."""
    if tp_size == 1:
        return full
    size = full.shape[0] // tp_size
    return full.narrow(0, tp_rank * size, size)


def shard_cols(full: Any, tp_rank: int, tp_size: int) -> Any:
    """This rank's slice of dim 1 (input features of a row-parallel weight)."""
    if tp_size == 1 or full.dim() == 1:
        return full
    size = full.shape[1] // tp_size
    return full.narrow(1, tp_rank * size, size)


class RowRange:
    """Rows [start, start + length) of a tensor or `weights.LazyTensor`, still unread: one
    sub-matrix of a fused checkpoint tensor (Phi-3's qkv_proj), which `shard_rows` then narrows
    to a rank's shard (reading only that)."""

    def __init__(self, base: Any, start: int, length: int) -> None:
        self._base, self._start = base, start
        self.shape = torch.Size([length, *base.shape[1:]])

    def dim(self) -> int:
        return len(self.shape)

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        if dim == 0:
            return self._base.narrow(0, self._start + start, length)
        return self.full().narrow(dim, start, length)

    def full(self) -> torch.Tensor:
        return self._base.narrow(0, self._start, self.shape[0])

    def to(self, dtype: torch.dtype) -> torch.Tensor:
        return self.full().to(dtype)


# Up to this many rows (decode batches) a CUDA matmul streams the weights through
# tokenspeed_kernels.skinny_linear: 0.42 ms faster than cuBLAS per Llama-3.1-8B step at batch 1
# on the H100 (kernels/bench/bench_gemv.py); beyond it cuBLAS is the better kernel.
SKINNY_MAX_ROWS = 8


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           weight_scale: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T (+ b): the skinny GEMV kernel for small decode batches on CUDA, cuBLAS otherwise.
    weight_scale: FP8 weights (layers/quantization/fp8.py picks their kernels)."""
    if weight_scale is not None:
        return fp8_linear(x, weight, weight_scale, bias)
    if batch_invariant.enabled():
        return batch_invariant.linear(x, weight, bias)
    if (x.is_cuda and x.dim() == 2 and x.shape[0] <= SKINNY_MAX_ROWS
            and x.dtype in (torch.bfloat16, torch.float16) and x.dtype == weight.dtype
            and x.stride(1) == 1):
        from tokenspeed_kernels import skinny_linear

        return skinny_linear(x, weight, bias)
    return nn.functional.linear(x, weight, bias)


def lora_linear(lora: LoraWeights, x: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None, weight_scale: torch.Tensor | None) -> torch.Tensor:
    """x W^T (+ b) plus this step's LoRA delta: one stacked GEMM and a merge kernel when the
    pool's A sits under W (layers/lora.py), else the base GEMM and the delta kernels."""
    if lora.stacked_step(x):
        assert lora.stacked is not None
        return lora.merge(linear(x, lora.stacked, None if bias is None else lora.stacked_bias))
    return lora.add_to(x, linear(x, weight, bias, weight_scale))


def _copy(param: torch.Tensor, loaded: torch.Tensor, what: str) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"{what}: checkpoint shape {tuple(loaded.shape)} != "
                         f"parameter shape {tuple(param.shape)}")
    with torch.no_grad():
        param.copy_(loaded)


class ColumnLinear(nn.Module):
    """y = x W^T (+ b), W split by output features across TP ranks.

    `output_sizes` lists the fused sub-matrices (e.g. [q, k, v] or [gate, up]); each HF tensor is
    loaded into its slice by shard index. `shard_splits[i]` = (part, parts): sub-matrix i is cut
    into `parts` equal pieces and this rank holds piece `part` (default: (tp_rank, tp_size); K/V
    of a model with fewer KV heads than ranks are cut per head and each head replicated).
    """

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False,
                 tp_rank: int = 0, tp_size: int = 1,
                 shard_splits: list[tuple[int, int]] | None = None) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.shard_splits = shard_splits or [(tp_rank, tp_size)] * len(output_sizes)
        for full, (_, parts) in zip(output_sizes, self.shard_splits):
            if full % parts:
                raise ValueError(f"output size {full} does not split into {parts} parts")
        self.output_sizes = [s // parts for s, (_, parts) in zip(output_sizes, self.shard_splits)]
        out = sum(self.output_sizes)
        self.weight = nn.Parameter(torch.empty(out, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out), requires_grad=False) if bias else None
        self.weight_scale: nn.Parameter | None = None  # set by FP8 quantization
        self.lora: LoraWeights | None = None  # set by the LoRA pool (--enable-lora)

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard: int = 0) -> None:
        offset = sum(self.output_sizes[:shard])
        size = self.output_sizes[shard]
        part, parts = self.shard_splits[shard]
        local = shard_rows(loaded, part, parts)
        _copy(param.data.narrow(0, offset, size), local.to(param.dtype), f"shard {shard}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.lora is not None:
            return lora_linear(self.lora, x, self.weight, self.bias, self.weight_scale)
        return linear(x, self.weight, self.bias, self.weight_scale)


class QKVLinear(ColumnLinear):
    """Fused q/k/v projection; HF `q_proj`, `k_proj`, `v_proj` load into shards 0, 1, 2.

    Query heads split evenly over the ranks. KV heads too when there are at least as many as
    ranks; otherwise rank r holds KV head r // (tp_size / num_kv_heads), the one its query heads
    read (GQA groups are contiguous), so each KV head lives on tp_size / num_kv_heads ranks."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False, tp_rank: int = 0, tp_size: int = 1) -> None:
        if num_kv_heads >= tp_size:
            kv_split = (tp_rank, tp_size)
        else:
            kv_split = (tp_rank // (tp_size // num_kv_heads), num_kv_heads)
        super().__init__(hidden_size, [num_heads * head_dim, num_kv_heads * head_dim,
                                       num_kv_heads * head_dim], bias, tp_rank, tp_size,
                         shard_splits=[(tp_rank, tp_size), kv_split, kv_split])

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = qkv.split(self.output_sizes, dim=-1)
        return q, k, v


class GateUpLinear(ColumnLinear):
    """Fused gate/up projection of a gated MLP; HF `gate_proj`, `up_proj` load into shards 0, 1."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False,
                 tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__(hidden_size, [intermediate_size, intermediate_size], bias, tp_rank, tp_size)


class RowLinear(nn.Module):
    """y = x W^T (+ b), W split by input features across TP ranks (o_proj, down_proj): each rank
    multiplies its slice of x, the partial sums are all-reduced over `group` (NCCL inside the
    decode CUDA graphs too) and the bias, held whole by every rank, is added once after it."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 tp_rank: int = 0, tp_size: int = 1, group: str = "attn_tp") -> None:
        super().__init__()
        if in_features % tp_size:
            raise ValueError(f"input size {in_features} does not split over {tp_size} ranks")
        self.tp_rank, self.tp_size, self.group = tp_rank, tp_size, group
        self.weight = nn.Parameter(torch.empty(out_features, in_features // tp_size),
                                   requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.weight_scale: nn.Parameter | None = None  # set by FP8 quantization
        self.lora: LoraWeights | None = None  # set by the LoRA pool (--enable-lora)

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard: int = 0) -> None:
        if param is self.bias:
            _copy(param.data, loaded.to(param.dtype), "row bias")
            return
        _copy(param.data, shard_cols(loaded, self.tp_rank, self.tp_size).to(param.dtype), "row")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            if self.lora is not None:
                return lora_linear(self.lora, x, self.weight, self.bias, self.weight_scale)
            return linear(x, self.weight, self.bias, self.weight_scale)
        if self.lora is not None:  # x A^T is a partial sum too: the all-reduce completes both
            partial = lora_linear(self.lora, x, self.weight, None, self.weight_scale)
        else:
            partial = linear(x, self.weight, None, self.weight_scale)
        y = tp_all_reduce(partial, self.group)
        return y if self.bias is None else y + self.bias
