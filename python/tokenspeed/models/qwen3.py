"""Qwen3: the Llama architecture with per-head q/k RMSNorm (ModelConfig.qk_norm) and explicit head_dim."""

from __future__ import annotations

from tokenspeed.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    pass
