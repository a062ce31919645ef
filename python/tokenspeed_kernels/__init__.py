"""TokenSpeed's Triton kernels; the runtime imports kernels only through this package."""

from tokenspeed_kernels.activation import silu_and_mul
from tokenspeed_kernels.decode_attention import default_num_splits, paged_decode_attention
from tokenspeed_kernels.extend_attention import extend_config, extend_tiles, paged_extend_attention
from tokenspeed_kernels.fp8_gemm import fp8_matmul, per_token_quant_fp8
from tokenspeed_kernels.gemv import skinny_linear
from tokenspeed_kernels.kv_cache import write_kv_to_pages
from tokenspeed_kernels.mla_attention import mla_decode_attention, mla_num_splits
from tokenspeed_kernels.mla_extend import mla_extend_attention
from tokenspeed_kernels.moe import fused_moe, moe_align, moe_route
from tokenspeed_kernels.norm import fused_add_rmsnorm, rmsnorm
from tokenspeed_kernels.prefill_attention import (
    prefill_attention,
    prefill_config,
    prefill_layout_ok,
    prefill_supported,
)
from tokenspeed_kernels.rotary import build_cos_sin_cache, rotary_embedding
from tokenspeed_kernels.rotary_kv import rotary_embedding_write_kv

__all__ = [
    "build_cos_sin_cache",
    "default_num_splits",
    "extend_config",
    "extend_tiles",
    "fp8_matmul",
    "fused_add_rmsnorm",
    "fused_moe",
    "mla_decode_attention",
    "mla_extend_attention",
    "mla_num_splits",
    "moe_align",
    "moe_route",
    "paged_decode_attention",
    "paged_extend_attention",
    "per_token_quant_fp8",
    "prefill_attention",
    "prefill_config",
    "prefill_layout_ok",
    "prefill_supported",
    "rmsnorm",
    "rotary_embedding",
    "rotary_embedding_write_kv",
    "silu_and_mul",
    "skinny_linear",
    "write_kv_to_pages",
]
