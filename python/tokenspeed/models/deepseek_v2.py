"""DeepSeek-V2 / V3 (DeepseekV2ForCausalLM, DeepseekV3ForCausalLM; Kimi-K2, DeepSeek-R1 share V3).

Multi-head latent attention with the compressed KV cache and weight absorption: q from `q_proj`
(or the low-rank `q_a_proj` → `q_a_layernorm` → `q_b_proj`); `kv_a_proj_with_mqa` gives the
latent, normed (kv_lora_rank), and one shared rope key part. The cache holds just those per
token and layer, [latent | roped k_pe] as one K "head" (kv_lora_rank + rope: 576 values for V3,
~1/30 of per-head K and V). `kv_b_proj` is never applied to the latent: its key half W_UK is
absorbed into the query (q_nope @ W_UK: each head's query in latent space, then the roped q_pe:
a kv_lora_rank + rope wide query), attention runs as MQA over the cache with V = the latent (the
cache's first kv_lora_rank features), and the value half W_UV maps each head's latent output to
v_head_dim before o_proj. The softmax scale stays that of the original head (nope + rope)**-0.5,
times YaRN's mscale(mscale_all_dim)^2. The rope part is interleaved (pairs of features),
de-interleaved before a neox rotation (the same q.k).

MoE: dense MLPs up to `first_k_dense_replace`, then routed experts plus always-on shared ones;
routing V2: softmax, greedy or group-limited (group score = max); V3: sigmoid scores plus the
`e_score_correction_bias` for the choice, groups scored by their top-2 sum, weights the
unbiased scores renormalised (`norm_topk_prob`); both scaled by `routed_scaling_factor`."""

from __future__ import annotations

import re
from typing import ClassVar

import torch
from torch import nn

from tokenspeed.distributed.groups import ParallelState
from tokenspeed.layers.attention import Attention, ForwardBatch
from tokenspeed.layers.linear import ColumnLinear, RowLinear
from tokenspeed.layers.moe import FusedMoE, MoeCommunication, Routing, SingleRank
from tokenspeed.layers.moe_exchange import moe_communication
from tokenspeed.layers.norm import RMSNorm
from tokenspeed.layers.rotary import RotaryEmbedding, _yarn_mscale
from tokenspeed.models.config import ModelConfig
from tokenspeed.models.llama import STACKED_PARAMS, LlamaDecoderLayer, LlamaMLP
from tokenspeed.models.moe_base import MoeForCausalLM

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def _deinterleave(x: torch.Tensor) -> torch.Tensor:
    """(x0, x1, x2, x3, ...) → (x0, x2, ..., x1, x3, ...): DeepSeek's rope pairs as neox halves."""
    return x.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2).contiguous()


class MlaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, rotary: RotaryEmbedding,
                 parallel: ParallelState) -> None:
        super().__init__()
        r = config.raw
        tp = parallel.attn_tp
        self.heads = config.num_attention_heads // tp.size
        self.nope, self.rope = int(r["qk_nope_head_dim"]), int(r["qk_rope_head_dim"])
        self.v_dim, self.kv_lora = int(r["v_head_dim"]), int(r["kv_lora_rank"])
        qk = self.nope + self.rope
        h, heads, eps = config.hidden_size, config.num_attention_heads, config.rms_norm_eps
        self.q_lora = r.get("q_lora_rank")
        if self.q_lora:
            self.q_a_proj = ColumnLinear(h, [self.q_lora], bias=config.attention_bias)
            self.q_a_layernorm = RMSNorm(self.q_lora, eps)
            self.q_b_proj = ColumnLinear(self.q_lora, [heads * qk], tp_rank=tp.rank, tp_size=tp.size)
        else:
            self.q_proj = ColumnLinear(h, [heads * qk], tp_rank=tp.rank, tp_size=tp.size)
        self.kv_a_proj_with_mqa = ColumnLinear(h, [self.kv_lora + self.rope], bias=config.attention_bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora, eps)
        self.kv_b_proj = ColumnLinear(self.kv_lora, [heads * (self.nope + self.v_dim)],
                                      tp_rank=tp.rank, tp_size=tp.size)
        self.o_proj = RowLinear(heads * self.v_dim, h, bias=config.attention_bias, tp_rank=tp.rank,
                                tp_size=tp.size, group="attn_tp")
        self.rotary = [rotary]
        scaling = qk ** -0.5
        s = config.rope_scaling
        if s.get("rope_type") == "yarn" and s.get("mscale_all_dim"):
            scaling *= _yarn_mscale(float(s["factor"]), float(s["mscale_all_dim"])) ** 2
        # One latent K head of kv_lora + rope features shared by every query head; V = its first
        # kv_lora features. Prefill uses the same absorbed form as decode: one cache layout and
        # one code path, and prefix hits / chunked prefill read the cached latent as it is (the
        # expanded form, cheaper in FLOPs for long prompts, would re-expand every cached prefix).
        self.attn = Attention(layer_id, self.heads, 1, self.kv_lora + self.rope, scaling=scaling,
                              v_head_dim=self.kv_lora)

    def _absorbed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_UK [H, nope, kv_lora], W_UV [H, v_dim, kv_lora]): kv_b_proj's key and value halves
        (views of its weight; an fp8-quantised kv_b_proj is dequantised first)."""
        w = self.kv_b_proj.weight
        if self.kv_b_proj.weight_scale is not None:
            from tokenspeed.layers.quantization.fp8 import dequantize

            w = dequantize(w, self.kv_b_proj.weight_scale, torch.float32)
        w = w.view(self.heads, self.nope + self.v_dim, self.kv_lora)
        return w[:, : self.nope], w[:, self.nope:]

    def forward(self, positions: torch.Tensor, x: torch.Tensor,
                batch: ForwardBatch) -> torch.Tensor:
        t = x.shape[0]
        if self.q_lora:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        else:
            q = self.q_proj(x)
        q = q.view(t, self.heads, self.nope + self.rope)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora, self.rope], dim=-1)
        q_pe, k_pe = self.rotary[0](positions, _deinterleave(q[..., self.nope:]),
                                    _deinterleave(k_pe.reshape(t, 1, self.rope)))
        w_uk, w_uv = self._absorbed()
        # [H, t, nope] @ [H, nope, kv_lora]: each head's no-rope query in latent space.
        q_lat = torch.bmm(q[..., : self.nope].transpose(0, 1), w_uk.to(q.dtype)).transpose(0, 1)
        q = torch.cat([q_lat, q_pe.to(q_lat.dtype)], dim=-1)
        k = torch.cat([self.kv_a_layernorm(latent), k_pe.reshape(t, self.rope)], dim=-1)[:, None]
        out = self.attn(q, k, k[..., : self.kv_lora], batch).view(t, self.heads, self.kv_lora)
        # [H, t, kv_lora] @ [H, kv_lora, v_dim]: each head's value from its latent output.
        out = torch.bmm(out.transpose(0, 1), w_uv.transpose(1, 2).to(out.dtype)).transpose(0, 1)
        return self.o_proj(out.reshape(t, self.heads * self.v_dim))


class DeepseekRouter(nn.Module):
    """Router logits in fp32 → (weights, ids) by the model's scoring and grouped top-k."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        r = config.raw
        e = config.num_experts
        self.weight = nn.Parameter(torch.empty(e, config.hidden_size), requires_grad=False)
        self.sigmoid = r.get("scoring_func", "softmax") == "sigmoid" or \
            config.architecture == "DeepseekV3ForCausalLM"
        self.e_score_correction_bias = (nn.Parameter(torch.zeros(e), requires_grad=False)
                                        if self.sigmoid else None)
        self.top_k, self.groups = config.num_experts_per_tok, int(r.get("n_group") or 1)
        self.topk_group = int(r.get("topk_group") or 1)
        self.grouped = self.groups > 1 and (self.sigmoid or r.get("topk_method") == "group_limited_greedy")
        self.renormalize = self.sigmoid and config.norm_topk_prob
        self.scale = float(r.get("routed_scaling_factor") or 1.0)

    def forward(self, x: torch.Tensor) -> Routing:
        scores = nn.functional.linear(x.float(), self.weight.float())
        scores = scores.sigmoid() if self.sigmoid else scores.softmax(-1)
        choice = scores if self.e_score_correction_bias is None else \
            scores + self.e_score_correction_bias.float()
        if self.grouped:
            g = choice.unflatten(1, (self.groups, -1))  # [T, groups, experts per group]
            group_score = g.topk(2, dim=-1)[0].sum(-1) if self.sigmoid else g.amax(-1)
            keep = torch.zeros_like(group_score).scatter_(
                1, group_score.topk(self.topk_group, dim=-1)[1], 1.0).bool()
            choice = choice.masked_fill(~keep.repeat_interleave(g.shape[-1], dim=1),
                                        float("-inf") if self.sigmoid else 0.0)
        ids = choice.topk(self.top_k, dim=-1)[1]
        weights = scores.gather(1, ids)
        if self.renormalize:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return Routing(weights * self.scale, ids.to(torch.int32))


class DeepseekMoe(nn.Module):
    """Routed experts through the ranks' MoE exchange (as `SparseMoeBlock`: tokens routed by
    `DeepseekRouter` meet their experts, partial outputs are combined), under TP / EP, data-
    parallel attention or torch_all2all alike, plus the shared experts, a dense MLP on this
    rank's own tokens sharded like the dense layers (its down projection reduces itself)."""

    def __init__(self, config: ModelConfig, parallel: ParallelState, owner: MoeForCausalLM) -> None:
        super().__init__()
        c = config
        self.gate = DeepseekRouter(c)
        self.experts = FusedMoE(c.num_experts, c.num_experts_per_tok, c.hidden_size,
                                c.moe_intermediate_size, False, owner.moe_options)
        self.comm: MoeCommunication = moe_communication(parallel, self.experts) or SingleRank()
        shared = int(c.raw.get("n_shared_experts") or 0)
        self.shared_experts = LlamaMLP(c, parallel, c.moe_intermediate_size * shared) \
            if shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shared = None if self.shared_experts is None else self.shared_experts(x)
        # Routed here, on the rank holding the tokens: every exchange carries the routing.
        tokens, routing = self.comm.dispatch(x, self.gate(x))
        out = self.comm.combine(self.experts(tokens, routing))
        return out if shared is None else out + shared


class DeepseekV2ForCausalLM(MoeForCausalLM):
    # q_proj is MLA's own (no fused qkv); only the MLPs' gate/up fuse.
    STACKED_PARAMS: ClassVar[list[tuple[str, str, int]]] = [
        p for p in STACKED_PARAMS if p[1] == ".gate_up_proj."]
    # Read as matrices (MlaAttention._absorbed), not multiplied through: a block-scaled FP8
    # checkpoint's kv_b_proj is dequantised to the model dtype once loaded (fp8_model.py).
    HIGH_PRECISION_LINEARS: ClassVar[tuple[str, ...]] = ("kv_b_proj",)

    def make_model(self, max_positions: int) -> nn.Module:
        c = self.config
        r = c.raw
        rope_dim = int(r["qk_rope_head_dim"])
        model = super().make_model(max_positions)
        # The rope applies to the rope part only (rope_dim wide), not to the cache's head width.
        model.rotary_emb = RotaryEmbedding(rope_dim, max_positions, c.rope_theta, c.rope_scaling)
        for i, layer in enumerate(model.layers):  # type: ignore[union-attr]
            assert isinstance(layer, LlamaDecoderLayer)
            layer.self_attn = MlaAttention(c, i, model.rotary_emb, self.parallel)  # type: ignore[arg-type]
        return model

    def make_mlp(self, layer_id: int) -> nn.Module:
        if self.config.is_moe_layer(layer_id):
            return DeepseekMoe(self.config, self.parallel, self)
        return LlamaMLP(self.config, self.parallel)

    def load_tensor(self, name: str, tensor: torch.Tensor, params: dict[str, nn.Parameter],
                    modules: dict[str, nn.Module]) -> str | None:
        # Layers past the stack are V3's multi-token prediction layer: a draft head's
        # (models/deepseek_mtp.py, --speculative-algorithm NEXTN), not the model's.
        m = _LAYER.match(name)
        if m and int(m[1]) >= self.config.num_hidden_layers:
            return None
        return super().load_tensor(name, tensor, params, modules)


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    pass
