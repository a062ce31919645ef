"""DeepSeek-V2 / V3 (DeepseekV2ForCausalLM, DeepseekV3ForCausalLM; Kimi-K2, DeepSeek-R1 share V3).

Multi-head latent attention, computed here in its expanded form: q from `q_proj` (or the
low-rank `q_a_proj` → `q_a_layernorm` → `q_b_proj`), the latent `kv_a_proj_with_mqa` → normed
latent (kv_lora_rank) + one shared rope key part, `kv_b_proj` expanding the latent into each
head's no-rope key and value. The KV cache holds full per-head K (nope | rope) and V (zero-padded
to K's width), not the compressed latent: correct everywhere, but kv_lora_rank + rope per token
is what DeepSeek's MLA caches (~1/30 of this here). The rope part is interleaved (pairs of
features), de-interleaved before a neox rotation (the same q.k); YaRN's mscale_all_dim scales
the softmax by mscale^2.

MoE: dense MLPs up to `first_k_dense_replace`, then routed experts plus always-on shared ones;
routing V2: softmax, greedy or group-limited (group score = max); V3: sigmoid scores plus the
`e_score_correction_bias` for the choice, groups scored by their top-2 sum, weights the
unbiased scores renormalised (`norm_topk_prob`); both scaled by `routed_scaling_factor`."""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from tokenspeed.distributed.groups import ParallelState
from tokenspeed.layers.attention import Attention, ForwardBatch
from tokenspeed.layers.linear import ColumnLinear, RowLinear
from tokenspeed.layers.moe import FusedMoE, Routing
from tokenspeed.layers.norm import RMSNorm
from tokenspeed.layers.rotary import RotaryEmbedding, _yarn_mscale
from tokenspeed.models.config import ModelConfig
from tokenspeed.models.llama import STACKED_PARAMS, LlamaDecoderLayer, LlamaMLP
from tokenspeed.models.moe_base import MoeForCausalLM


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
        # K and V share the cache's head width (nope + rope); V is zero-padded to it.
        self.attn = Attention(layer_id, self.heads, self.heads, qk, scaling=scaling)

    def forward(self, positions: torch.Tensor, x: torch.Tensor,
                batch: ForwardBatch) -> torch.Tensor:
        t = x.shape[0]
        if self.q_lora:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        else:
            q = self.q_proj(x)
        q = q.view(t, self.heads, self.nope + self.rope)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora, self.rope], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent)).view(t, self.heads, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        q_pe, k_pe = self.rotary[0](positions, _deinterleave(q[..., self.nope:]),
                                    _deinterleave(k_pe.reshape(t, 1, self.rope)))
        q = torch.cat([q[..., : self.nope], q_pe], dim=-1)
        k = torch.cat([k_nope, k_pe.expand(t, self.heads, self.rope)], dim=-1)
        v = nn.functional.pad(v, (0, self.nope + self.rope - self.v_dim))
        out = self.attn(q, k, v, batch).view(t, self.heads, -1)[..., : self.v_dim]
        return self.o_proj(out.reshape(t, -1))


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
            g = choice.view(x.shape[0], self.groups, -1)
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
    def __init__(self, config: ModelConfig, parallel: ParallelState, owner: MoeForCausalLM) -> None:
        super().__init__()
        if parallel.world.size > 1:
            raise NotImplementedError("DeepSeek MoE layers run on one rank only so far")
        c = config
        self.gate = DeepseekRouter(c)
        self.experts = FusedMoE(c.num_experts, c.num_experts_per_tok, c.hidden_size,
                                c.moe_intermediate_size, False, owner.moe_options)
        shared = int(c.raw.get("n_shared_experts") or 0)
        self.shared_experts = LlamaMLP(c, parallel, c.moe_intermediate_size * shared) \
            if shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.experts(x, self.gate(x))
        return out if self.shared_experts is None else out + self.shared_experts(x)


class DeepseekV2ForCausalLM(MoeForCausalLM):
    # q_proj is MLA's own (no fused qkv); only the MLPs' gate/up fuse.
    STACKED_PARAMS: ClassVar[list[tuple[str, str, int]]] = [
        p for p in STACKED_PARAMS if p[1] == ".gate_up_proj."]

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


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    pass
