"""Quantization: FP8 weights (fp8.py, method resolution in methods.py) and the FP8 KV cache
(kv_cache.py)."""
