"""The shared base of the MoE families: a Llama-family decoder whose sparse layers' MLP is a
SparseMoeBlock, and the loading of expert tensors in their several checkpoint spellings."""

from __future__ import annotations

import re
from typing import ClassVar

import torch
from torch import nn

from tokenspeed.layers.moe import FusedMoE, MoeCommunication, MoeOptions, Router, SingleRank
from tokenspeed.layers.moe_exchange import moe_communication
from tokenspeed.models.config import ModelConfig
from tokenspeed.models.llama import LlamaForCausalLM, LlamaMLP

# One expert's matrix: HF safetensors (`mlp.experts.3.gate_proj.weight`, Mixtral's `w1`/`w2`/`w3`),
# or its FP8 block scales (`weight_scale`: the checkpoint's weight_scale_inv, renamed by fp8_model).
_ONE_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(\w+)\.(weight|weight_scale)$")
# All experts stacked on dim 0: transformers 5's fused tensors (`mlp.experts.gate_up_proj`
# [E, 2I, H], `mlp.experts.down_proj` [E, H, I]) and the GGUF stacks (`gate_proj`/`up_proj` [E, I, H]).
_STACKED = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|gate_proj|up_proj|down_proj)(?:\.weight)?$")


class SparseMoeBlock(nn.Module):
    """router → routing (softmax top-k) → dispatch → experts → combine across ranks. Parameter
    names follow HF (`gate`, `experts`)."""

    def __init__(self, config: ModelConfig, options: MoeOptions | None = None) -> None:
        super().__init__()
        if config.hidden_act != "silu":
            raise NotImplementedError(f"hidden_act {config.hidden_act!r} (only silu)")
        self.gate = Router(config.hidden_size, config.num_experts)
        self.experts = FusedMoE(config.num_experts, config.num_experts_per_tok, config.hidden_size,
                                config.moe_intermediate_size, config.norm_topk_prob,
                                options or MoeOptions())
        # The exchange across ranks (layers/moe_exchange.py): all-reduce, all-gather /
        # reduce-scatter or all-to-all goes here.
        self.comm: MoeCommunication = SingleRank()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Routed here, on the rank holding the tokens: the exchange carries the routing.
        x, routing = self.comm.dispatch(x, self.experts.route(self.gate(x)))
        return self.comm.combine(self.experts(x, routing))


class MoeForCausalLM(LlamaForCausalLM):
    # HF name fragment → ours, applied before anything else (Mixtral's `block_sparse_moe`).
    RENAMES: tuple[tuple[str, str], ...] = ()
    # Per-expert HF matrix name → FusedMoE shard.
    EXPERT_SHARDS: ClassVar[dict[str, str]] = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}

    def make_mlp(self, layer_id: int) -> nn.Module:
        if self.config.is_moe_layer(layer_id):
            block = SparseMoeBlock(self.config, self.moe_options)
            comm = moe_communication(self.parallel, block.experts)  # tokens meet experts
            if comm is not None:
                block.comm = comm
            return block
        return LlamaMLP(self.config, self.parallel)

    def load_tensor(self, name: str, tensor: torch.Tensor, params: dict[str, nn.Parameter],
                    modules: dict[str, nn.Module]) -> str | None:
        for hf, ours in self.RENAMES:
            name = name.replace(hf, ours)
        if m := _ONE_EXPERT.match(name):
            experts = self._experts(modules, m[1], name)
            shard = self.EXPERT_SHARDS.get(m[3])
            if shard is None:
                raise KeyError(f"checkpoint tensor {name!r}: unknown expert matrix {m[3]!r}")
            suffix = "_scale" if m[4] == "weight_scale" else ""
            experts.load_expert(int(m[2]), shard + suffix, tensor)
            return f"{m[1]}.{'down_proj' if shard == 'down' else 'gate_up_proj'}{suffix}"
        if m := _STACKED.match(name):
            experts = self._experts(modules, m[1], name)
            if tensor.shape[0] != experts.num_experts:
                raise ValueError(f"{name}: {tensor.shape[0]} stacked experts, the model has "
                                 f"{experts.num_experts}")
            for e in range(experts.num_experts):
                if m[2] == "gate_up_proj":
                    gate, up = tensor[e].chunk(2, dim=0)
                    experts.load_expert(e, "gate", gate)
                    experts.load_expert(e, "up", up)
                else:
                    experts.load_expert(e, m[2].removesuffix("_proj"), tensor[e])
            return f"{m[1]}.{'down_proj' if m[2] == 'down_proj' else 'gate_up_proj'}"
        return super().load_tensor(name, tensor, params, modules)

    @staticmethod
    def _experts(modules: dict[str, nn.Module], path: str, name: str) -> FusedMoE:
        experts = modules.get(path)
        if not isinstance(experts, FusedMoE):
            raise KeyError(f"checkpoint tensor {name!r}: {path!r} is not an expert bank here "
                           "(a dense layer, or a config that disagrees with the checkpoint)")
        return experts
