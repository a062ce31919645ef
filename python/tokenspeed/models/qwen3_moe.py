"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3 attention (q/k norm) with sparse MLPs of
`num_experts` experts, top `num_experts_per_tok`, weights renormalised when `norm_topk_prob`;
`decoder_sparse_step`/`mlp_only_layers` keep some layers dense (ModelConfig.moe_layers)."""

from __future__ import annotations

from tokenspeed.models.moe_base import MoeForCausalLM


class Qwen3MoeForCausalLM(MoeForCausalLM):
    pass
