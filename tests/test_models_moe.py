"""MoE models (Qwen3-MoE, Mixtral) through the ModelRunner vs HF transformers, fp32 CPU: greedy
tokens and logits with both MoE backends (triton under the interpreter), GGUF loading, and the
expert/MoE-tensor-parallel split: simulated ranks' partial outputs sum to the one-rank output."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from test_models_numerics import TINY_NEW_TOKENS, TINY_PROMPTS, assert_matches_hf, hf_greedy, randomize
from transformers import AutoModelForCausalLM, MixtralConfig, PretrainedConfig, Qwen3MoeConfig

from tokenspeed.model_runner import ModelRunner

_BASE = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 3,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512}

TINY_MOE_CONFIGS: dict[str, PretrainedConfig] = {
    # 3 layers: layer 1 is dense (mlp_only_layers), so dense and sparse layers mix.
    "qwen3_moe_norm_topk": Qwen3MoeConfig(**_BASE, head_dim=32, num_experts=16, num_experts_per_tok=4,
                                          moe_intermediate_size=32, norm_topk_prob=True,
                                          mlp_only_layers=[1]),
    # decoder_sparse_step 2: only layer 1 is sparse; unnormalised top-k weights.
    "qwen3_moe_sparse_step": Qwen3MoeConfig(**_BASE, num_experts=8, num_experts_per_tok=2,
                                            moe_intermediate_size=48, norm_topk_prob=False,
                                            decoder_sparse_step=2),
    "mixtral": MixtralConfig(**_BASE, num_local_experts=8, num_experts_per_tok=2),
}


@pytest.fixture(scope="module")
def tiny_moe_models(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple]:
    """Per config: (checkpoint dir, HF model, HF tokens, HF logits), built on first use."""
    cache: dict[str, tuple] = {}

    def get(name: str) -> tuple:
        if name not in cache:
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(TINY_MOE_CONFIGS[name]).eval()
            randomize(model, seed=1)
            path = tmp_path_factory.mktemp(name)
            model.save_pretrained(path)
            cache[name] = (str(path), model, *hf_greedy(model, TINY_PROMPTS, TINY_NEW_TOKENS))
        return cache[name]

    return get


# The triton backend runs under the Triton interpreter here (~0.3 s per MoE layer call): one config
# through the runner; kernels/tests/test_moe.py covers its shapes, test_moe_layer_* below the layer.
CASES = [(name, "torch_native") for name in TINY_MOE_CONFIGS] + [("qwen3_moe_sparse_step", "triton")]


@pytest.mark.parametrize(("name", "backend"), CASES)
def test_tiny_moe_greedy_matches_hf(tiny_moe_models: Callable[[str], tuple], name: str,
                                    backend: str) -> None:
    path, _, ref_tokens, ref_logits = tiny_moe_models(name)
    runner = ModelRunner(path, page_size=16, max_slots=8, max_context_len=128, seed=0,
                         moe_backend=backend)
    assert runner.config.num_experts == TINY_MOE_CONFIGS[name].num_local_experts
    assert_matches_hf(runner, TINY_PROMPTS, ref_tokens, ref_logits, chunk_size=8)
