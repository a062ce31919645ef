"""Which attention backend runs: built by name (`--attention-backend`) over the KV cache, and the
memory each sets aside beside it. The backends implement `attention.AttentionBackend`; this module
is the one place that knows all of them."""

from __future__ import annotations

import torch

from tokenspeed.layers.attention import AttentionBackend, check_backend
from tokenspeed.layers.flashinfer_attention import FlashInferBackend
from tokenspeed.layers.kv_cache import PagedKVCache
from tokenspeed.layers.torch_native_attention import TorchNativeBackend
from tokenspeed.layers.triton_attention import TritonBackend


def backend_memory_bytes(name: str, num_graphs: int) -> int:
    """Device memory a backend allocates beside the KV cache (workspaces), for the KV sizing."""
    if name == "flashinfer":
        return FlashInferBackend.memory_bytes(num_graphs)
    return 0


def create_backend(name: str, kv_cache: PagedKVCache, *, num_heads: int, head_dim: int,
                   max_context_len: int | None = None, sliding_window: int | None = None,
                   q_dtype: torch.dtype | None = None) -> AttentionBackend:
    """num_heads/head_dim: the model's query heads and head size (FlashInfer plans with them
    once per step, before any layer runs); q_dtype: the model's dtype (default: the cache's)."""
    check_backend(name)
    max_context_len = max_context_len or kv_cache.max_pages_per_slot * kv_cache.page_size
    if name == "torch_native":
        return TorchNativeBackend(kv_cache)
    if name == "flashinfer":
        return FlashInferBackend(kv_cache, num_heads, head_dim, sliding_window, q_dtype)
    return TritonBackend(kv_cache, max_context_len, sliding_window)
