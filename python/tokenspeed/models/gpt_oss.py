"""GPT-OSS (GptOssForCausalLM: gpt-oss-20b, gpt-oss-120b).

Attention: q/k/v/o with biases, per-head attention sinks (a learned logit per head that joins
the softmax and carries no value), sliding-window (128) and full layers alternating
(`layer_types`), YaRN rope. Every MLP is a mixture of experts: a router with a bias, top-k on its
logits and a softmax over the k chosen (= renormalised top-k), experts with biases and the
clamped SwiGLU ((up + 1) * gate * sigmoid(alpha * gate), gate <= limit, |up| <= limit).

Checkpoints: the experts stacked per layer, either as HF transformers saves them
(`experts.gate_up_proj` [E, H, 2I] with gate and up interleaved column by column, `down_proj`
[E, I, H]) or as OpenAI ships them, MXFP4 (`*_blocks` uint8 [E, out, in / 32, 16] of two E2M1
values a byte, `*_scales` uint8 [E, out, in / 32] of power-of-two exponents biased by 127),
dequantised at load into the model's dtype."""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from torch import nn

from tokenspeed.distributed.groups import ParallelState
from tokenspeed.layers.attention import Attention, ForwardBatch
from tokenspeed.layers.linear import QKVLinear, RowLinear, shard_rows
from tokenspeed.layers.moe import ExpertActivation, FusedMoE, MoeCommunication, Router, SingleRank
from tokenspeed.layers.moe_exchange import moe_communication
from tokenspeed.layers.rotary import Rope, RotaryEmbedding
from tokenspeed.models.config import ModelConfig, local_heads
from tokenspeed.models.llama import LlamaDecoderLayer, LlamaForCausalLM

_FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
               -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor,
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """MXFP4 → [*prefix, out, in]: blocks uint8 [*prefix, out, G, 16] (low nibble first),
    scales uint8 [*prefix, out, G] (2 ** (s - 127) per 32 values)."""
    if blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} "
                         "do not match")
    lut = torch.tensor(_FP4_VALUES, dtype=torch.float32, device=blocks.device)
    b = blocks.to(torch.uint8)
    values = torch.stack((lut[(b & 0x0F).long()], lut[(b >> 4).long()]), dim=-1)  # [.., G, 16, 2]
    values = values.flatten(-2)  # [..., G, 32]
    out = torch.ldexp(values, (scales.to(torch.int32) - 127).unsqueeze(-1))
    return out.flatten(-2).to(dtype)


class GptOssAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, rotary: RotaryEmbedding,
                 parallel: ParallelState) -> None:
        super().__init__()
        c = config
        tp = parallel.attn_tp
        self.tp_rank = tp.rank
        self.num_heads, self.num_kv_heads = local_heads(c, tp.size)
        self.head_dim = c.head_dim
        self.qkv_proj = QKVLinear(c.hidden_size, c.head_dim, c.num_attention_heads,
                                  c.num_key_value_heads, bias=c.attention_bias,
                                  tp_rank=tp.rank, tp_size=tp.size)
        self.o_proj = RowLinear(c.q_size, c.hidden_size, bias=c.attention_bias, tp_rank=tp.rank,
                                tp_size=tp.size, group="attn_tp")
        self.sinks = nn.Parameter(torch.empty(self.num_heads), requires_grad=False)
        self.rotary = [rotary]
        self.attn = Attention(layer_id, self.num_heads, self.num_kv_heads, c.head_dim,
                              scaling=c.head_dim ** -0.5,
                              sliding_window=c.sliding_windows[layer_id], has_sinks=True)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: int = 0) -> None:
        """The sinks of this rank's query heads."""
        local = shard_rows(loaded, self.tp_rank, loaded.shape[0] // self.num_heads)
        with torch.no_grad():
            param.copy_(local.to(param.dtype))

    def forward(self, positions: torch.Tensor, x: torch.Tensor,
                batch: ForwardBatch) -> torch.Tensor:
        q, k, v = self.qkv_proj.split(self.qkv_proj(x))
        q = q.reshape(-1, self.num_heads, self.head_dim)
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)
        return self.o_proj(self.attn(q, k, v, batch, rope=Rope(self.rotary[0], positions),
                                     sinks=self.sinks))


class GptOssMoe(nn.Module):
    """router → experts (biases, clamped SwiGLU) → combine across ranks."""

    def __init__(self, config: ModelConfig, parallel: ParallelState, owner: LlamaForCausalLM) -> None:
        super().__init__()
        c = config
        self.router = Router(c.hidden_size, c.num_experts, bias=True)
        activation = ExpertActivation("swiglu_oai", float(c.raw.get("swiglu_alpha", 1.702)),
                                      float(c.raw.get("swiglu_limit", 7.0)))
        self.experts = FusedMoE(c.num_experts, c.num_experts_per_tok, c.hidden_size,
                                c.moe_intermediate_size, True, owner.moe_options, bias=True,
                                activation=activation)
        comm = moe_communication(parallel, self.experts)
        self.comm: MoeCommunication = comm if comm is not None else SingleRank()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x, routing = self.comm.dispatch(x, self.experts.route(self.router(x)))
        return self.comm.combine(self.experts(x, routing))


_EXPERTS = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)(_bias|_blocks|_scales)?$")


class GptOssForCausalLM(LlamaForCausalLM):
    def __init__(self, *args: object, **kwargs: object) -> None:
        self._mxfp4_blocks: dict[str, torch.Tensor] = {}  # blocks waiting for their scales
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]

    def make_model(self, max_positions: int) -> nn.Module:
        model = super().make_model(max_positions)
        c = self.config
        for i, layer in enumerate(model.layers):  # type: ignore[union-attr]
            assert isinstance(layer, LlamaDecoderLayer)
            layer.self_attn = GptOssAttention(c, i, model.rotary_emb, self.parallel)  # type: ignore[arg-type]
        return model

    def make_mlp(self, layer_id: int) -> nn.Module:
        return GptOssMoe(self.config, self.parallel, self)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(weights)
        if self._mxfp4_blocks:
            raise KeyError(f"MXFP4 tensors without their blocks / scales: {sorted(self._mxfp4_blocks)}")

    def load_tensor(self, name: str, tensor: torch.Tensor, params: dict[str, nn.Parameter],
                    modules: dict[str, nn.Module]) -> str | None:
        m = _EXPERTS.match(name)
        if m is None:
            return super().load_tensor(name, tensor, params, modules)
        experts = modules.get(m[1])
        if not isinstance(experts, FusedMoE):
            raise KeyError(f"checkpoint tensor {name!r}: {m[1]!r} is not an expert bank")
        which, suffix = m[2], m[3] or ""
        full = tensor.full() if hasattr(tensor, "full") else tensor
        if suffix in ("_blocks", "_scales"):  # MXFP4: wait for the pair, then dequantise
            other = f"{m[1]}.{which}{'_scales' if suffix == '_blocks' else '_blocks'}"
            if other not in self._mxfp4_blocks:
                self._mxfp4_blocks[name] = full
                return f"{m[1]}.{which}"
            pair = self._mxfp4_blocks.pop(other)
            blocks, scales = (full, pair) if suffix == "_blocks" else (pair, full)
            dense = dequantize_mxfp4(blocks, scales)  # [E, out, in]: our layout already
        elif suffix == "_bias":
            dense = full
        else:
            dense = full.transpose(1, 2)  # HF's [E, in, out]
        for e in range(experts.num_experts):
            if which == "down_proj":
                experts.load_expert(e, "down_bias" if suffix == "_bias" else "down", dense[e])
            else:  # gate and up interleaved along the outputs
                part = "_bias" if suffix == "_bias" else ""
                experts.load_expert(e, "gate" + part, dense[e][0::2])
                experts.load_expert(e, "up" + part, dense[e][1::2])
        if suffix == "_bias":
            return f"{m[1]}.{which}_bias"
        return f"{m[1]}.{which}"
