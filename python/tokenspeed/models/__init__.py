"""Model families (Llama, Qwen2, Qwen3, Phi-3, and the MoE Qwen3-MoE and Mixtral) built from
tokenspeed.layers; their configs (config.py), the architecture registry (registry.py), and
checkpoint loading (weights.py)."""
