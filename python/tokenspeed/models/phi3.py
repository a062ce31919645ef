"""Phi-3 / Phi-4 (Phi3ForCausalLM): the Llama architecture whose checkpoints store q/k/v as one
`qkv_proj` and gate/up as one `gate_up_proj`, with LongRoPE (short/long factors, formerly "su")
and partial rotary (Phi-4-mini) handled by RotaryEmbedding. The fused tensors are cut back into
their sub-matrices at load, so each TP rank keeps its heads / intermediate rows as for Llama."""

from __future__ import annotations

import torch
from torch import nn

from tokenspeed.layers.linear import ColumnLinear, RowRange
from tokenspeed.models.llama import LlamaForCausalLM

_FUSED = (".qkv_proj.", ".gate_up_proj.")


class Phi3ForCausalLM(LlamaForCausalLM):
    def load_tensor(self, name: str, tensor: torch.Tensor, params: dict[str, nn.Parameter],
                    modules: dict[str, nn.Module]) -> str | None:
        if not any(f in name for f in _FUSED):
            return super().load_tensor(name, tensor, params, modules)
        if name not in params:
            raise KeyError(f"checkpoint tensor {name!r} has no parameter in Phi3ForCausalLM")
        owner = modules[name.rsplit(".", 1)[0]]
        assert isinstance(owner, ColumnLinear)
        # Full (unsharded) size of each sub-matrix: this rank's share times the parts it is cut in.
        sizes = [s * parts for s, (_, parts) in zip(owner.output_sizes, owner.shard_splits)]
        if tensor.shape[0] != sum(sizes):
            raise ValueError(f"{name}: {tensor.shape[0]} rows, expected {sum(sizes)} ({sizes})")
        start = 0
        for shard, size in enumerate(sizes):
            owner.weight_loader(params[name], RowRange(tensor, start, size), shard)
            start += size
        return name
