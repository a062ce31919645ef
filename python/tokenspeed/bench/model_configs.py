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
# Phi-4 (microsoft/phi-4 config.json): 40 layers, hidden 5120, 40 / 10 heads of 128, no rope
# scaling; 14.7B parameters.
PHI4: dict[str, Any] = {
    "architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "vocab_size": 100352,
    "hidden_size": 5120, "intermediate_size": 17920, "num_hidden_layers": 40,
    "num_attention_heads": 40, "num_key_value_heads": 10, "rms_norm_eps": 1e-5,
    "rope_theta": 250000.0, "max_position_embeddings": 16384,
    "original_max_position_embeddings": 16384, "rope_scaling": None, "sliding_window": None,
    "tie_word_embeddings": False, "hidden_act": "silu", "torch_dtype": "bfloat16",
    "bos_token_id": 100257, "eos_token_id": 100265,
}
# Gemma-3-12B's text tower (google/gemma-3-12b-it text_config) as a Gemma3ForCausalLM: 48
# layers, 5 local (window 1024, theta 10k) per global (theta 1M, linear x8), 16 / 8 heads of 256.
GEMMA3_12B: dict[str, Any] = {
    "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "vocab_size": 262208,
    "hidden_size": 3840, "intermediate_size": 15360, "num_hidden_layers": 48,
    "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 256,
    "query_pre_attn_scalar": 256, "sliding_window": 1024, "sliding_window_pattern": 6,
    "layer_types": ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(48)],
    "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
    "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "rms_norm_eps": 1e-6,
    "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 131072,
    "final_logit_softcapping": None, "attn_logit_softcapping": None, "tie_word_embeddings": True,
    "torch_dtype": "bfloat16", "bos_token_id": 2, "eos_token_id": 1,
}
# GPT-OSS-20B (openai/gpt-oss-20b config.json): 24 layers alternating sliding (128) / full,
# 64 / 8 heads of 64 with sinks, 32 experts top-4 of width 2880, YaRN x32; 21B parameters.
GPT_OSS_20B: dict[str, Any] = {
    "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "vocab_size": 201088,
    "hidden_size": 2880, "intermediate_size": 2880, "num_hidden_layers": 24,
    "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64,
    "num_local_experts": 32, "num_experts_per_tok": 4, "sliding_window": 128,
    "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(24)],
    "rope_theta": 150000.0, "rope_scaling": {
        "rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
        "original_max_position_embeddings": 4096, "truncate": False},
    "swiglu_limit": 7.0, "attention_bias": True, "rms_norm_eps": 1e-5,
    "max_position_embeddings": 131072, "tie_word_embeddings": False, "hidden_act": "silu",
    "torch_dtype": "bfloat16", "bos_token_id": 199998, "eos_token_id": 200002,
}
# DeepSeek-V2-Lite (deepseek-ai/DeepSeek-V2-Lite config.json): 27 layers, MLA (kv_lora 512, no
# q_lora, 16 heads of 128 + 64 rope), layer 0 dense, then 64 routed experts top-6 + 2 shared;
# 15.7B parameters. TokenSpeed caches full per-head K/V for it (docs/models.md).
DEEPSEEK_V2_LITE: dict[str, Any] = {
    "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "vocab_size": 102400,
    "hidden_size": 2048, "intermediate_size": 10944, "moe_intermediate_size": 1408,
    "num_hidden_layers": 27, "num_attention_heads": 16, "num_key_value_heads": 16,
    "q_lora_rank": None, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "v_head_dim": 128, "n_routed_experts": 64, "n_shared_experts": 2, "num_experts_per_tok": 6,
    "first_k_dense_replace": 1, "moe_layer_freq": 1, "n_group": 1, "topk_group": 1,
    "topk_method": "greedy", "scoring_func": "softmax", "norm_topk_prob": False,
    "routed_scaling_factor": 1.0, "rope_theta": 10000.0, "rope_scaling": {
        "type": "yarn", "factor": 40, "beta_fast": 32, "beta_slow": 1, "mscale": 0.707,
        "mscale_all_dim": 0.707, "original_max_position_embeddings": 4096},
    "max_position_embeddings": 163840, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
    "attention_bias": False, "hidden_act": "silu", "torch_dtype": "bfloat16",
    "bos_token_id": 100000, "eos_token_id": 100001,
}
# DeepSeek-V3 (deepseek-ai/DeepSeek-V3 config.json, as released): 61 layers, MLA (q_lora 1536,
# kv_lora 512, 128 heads of 128 + 64 rope), layers 0-2 dense (18432), then 256 routed experts of
# width 2048, top-8 in 4 of 8 groups by sigmoid scores + e_score_correction_bias (noaux_tc), 1
# shared; block-FP8 weights ([128, 128] tiles); 671B parameters, 37B active per token. The
# multi-token prediction layer (num_nextn_predict_layers) is past the stack: not served here.
DEEPSEEK_V3: dict[str, Any] = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 129280,
    "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
    "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128,
    "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "v_head_dim": 128, "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8,
    "first_k_dense_replace": 3, "moe_layer_freq": 1, "n_group": 8, "topk_group": 4,
    "topk_method": "noaux_tc", "scoring_func": "sigmoid", "norm_topk_prob": True,
    "routed_scaling_factor": 2.5, "num_nextn_predict_layers": 1, "rope_theta": 10000,
    "rope_scaling": {"type": "yarn", "factor": 40, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
                     "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096},
    "max_position_embeddings": 163840, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
    "attention_bias": False, "hidden_act": "silu", "torch_dtype": "bfloat16",
    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                            "weight_block_size": [128, 128]},
    "bos_token_id": 0, "eos_token_id": 1,
}
