"""Mixtral (8x7B, 8x22B): Mistral attention with 8 experts per layer, top-2, weights renormalised.
HF names the block `block_sparse_moe` and the expert matrices w1 (gate), w3 (up), w2 (down)."""

from __future__ import annotations

from typing import ClassVar

from tokenspeed.models.moe_base import MoeForCausalLM


class MixtralForCausalLM(MoeForCausalLM):
    RENAMES = ((".block_sparse_moe.", ".mlp."),)
    EXPERT_SHARDS: ClassVar[dict[str, str]] = {"w1": "gate", "w3": "up", "w2": "down"}
