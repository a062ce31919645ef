"""Model configs of the benchmark scenarios (public facts, BENCHMARKS.md), for dummy-weight runs."""

from __future__ import annotations

from typing import Any

LLAMA31_8B: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256,
    "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0, "max_position_embeddings": 131072, "tie_word_embeddings": False,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "torch_dtype": "bfloat16",
    "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009],
}
SMOLLM2_135M: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 49152,
    "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
    "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64, "rms_norm_eps": 1e-5,
    "rope_theta": 100000.0, "max_position_embeddings": 8192, "tie_word_embeddings": True,
    "hidden_act": "silu", "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2,
}
# Qwen3-30B-A3B (Qwen/Qwen3-30B-A3B config.json): 48 layers, every MLP sparse, 128 experts of
# width 768, top-8 renormalised; 30.5B parameters (61 GB in bf16), 3.3B active per token.
QWEN3_30B_A3B: dict[str, Any] = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 151936,
    "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
    "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
    "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1,
    "mlp_only_layers": [], "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
    "max_position_embeddings": 40960, "tie_word_embeddings": False, "attention_bias": False,
    "use_sliding_window": False, "sliding_window": None, "max_window_layers": 48,
    "hidden_act": "silu", "torch_dtype": "bfloat16", "bos_token_id": 151643, "eos_token_id": 151645,
}
