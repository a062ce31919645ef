"""Qwen2: the Llama architecture with q/k/v biases (ModelConfig.attention_bias defaults on)."""

from __future__ import annotations

from tokenspeed.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    pass
