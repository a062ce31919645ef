"""Model families (Llama, Qwen2, Qwen3) built from tokenspeed.layers."""
