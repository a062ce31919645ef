"""FP8 helpers shared by the kernels: the torch dtypes, their ranges, and the cache-store cast.

An FP8 KV cache holds x / scale rounded to float8 (e4m3fn or e5m2), clamped to the format's
finite range (torch's cast would turn an overflow into NaN for e4m3fn); readers dequantise
stored * scale. Kernels fold the K scale into the softmax scale and the V scale into the output,
so the inner loops only convert fp8 to the query's dtype, which is exact.

Triton's interpreter rounds fp32 -> fp8 wrongly (a mantissa carry is dropped, so 1.97 becomes 1.0,
and subnormals are garbled), so under TRITON_INTERPRET=1 the stores compute the fp8 bit pattern
themselves (round to nearest even in fp32 arithmetic) and write it through a uint8 view of the
cache. On a GPU the hardware conversion does the same rounding.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenspeed_kernels._utils import interpreting

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
# (mantissa bits, exponent bias) of each format.
_FORMAT = {torch.float8_e4m3fn: (3, 7), torch.float8_e5m2: (2, 15)}


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


def fp8_max(dtype: torch.dtype) -> float:
    """Largest finite value of an fp8 dtype (448 for e4m3fn, 57344 for e5m2)."""
    return float(torch.finfo(dtype).max)


def quantize_fp8(x: torch.Tensor, scale: float | torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x / scale rounded to `dtype`, clamped to its range: what the Triton cache stores write
    (same operations: fp32 multiply by the reciprocal, clamp, round to nearest even)."""
    inv = 1.0 / scale if isinstance(scale, float) else scale.float().reciprocal()
    m = fp8_max(dtype)
    return (x.float() * inv).clamp(-m, m).to(dtype)


@triton.jit
def _fp8_bits(y, MANT: tl.constexpr, BIAS: tl.constexpr):
    """uint8 pattern of fp32 y (finite, within the format's range) rounded to nearest even."""
    a = tl.abs(y)
    min_exp = 1.0 - BIAS
    e = tl.maximum(tl.floor(tl.log2(tl.maximum(a, 1e-30))), min_exp)
    t = a / tl.exp2(e - MANT)  # the magnitude in units of the last place
    f = tl.floor(t)
    d = t - f
    odd = (f - 2.0 * tl.floor(f * 0.5)) == 1.0
    m = tl.where((d > 0.5) | ((d == 0.5) & odd), f + 1.0, f)
    carry = m >= 2.0 * (1 << MANT)  # rounded up into the next binade
    e = tl.where(carry, e + 1.0, e)
    m = tl.where(carry, m * 0.5, m)
    normal = m >= (1 << MANT)  # else a subnormal (exponent field 0)
    field = tl.where(normal, (e + BIAS) * (1 << MANT) + m - (1 << MANT), m)
    negative = y.to(tl.int32, bitcast=True) < 0  # the sign bit: -0.0 stays -0
    return (field + tl.where(negative, 128.0, 0.0)).to(tl.uint8)


@triton.jit
def cache_value(x, inv_scale, out_ty: tl.constexpr, QUANT: tl.constexpr, FP8_MAX: tl.constexpr,
                MANT: tl.constexpr, BIAS: tl.constexpr):
    """The value stored in a cache of element type out_ty. QUANT 0: a plain cast; 1: x * inv_scale
    clamped and cast to fp8; 2: the same as a uint8 bit pattern (interpreter)."""
    if QUANT == 0:
        return x.to(out_ty)
    else:
        y = x.to(tl.float32) * inv_scale
        y = tl.minimum(tl.maximum(y, -FP8_MAX), FP8_MAX)
        if QUANT == 1:
            return y.to(out_ty)
        else:
            return _fp8_bits(y, MANT, BIAS)


def store_args(cache: torch.Tensor, scale: float) -> tuple[torch.Tensor, float, dict[str, object]]:
    """(cache to pass, inv_scale, constexprs QUANT/FP8_MAX/MANT/BIAS) for a store into `cache`."""
    if not is_fp8(cache.dtype):
        return cache, 1.0, {"QUANT": 0, "FP8_MAX": 0.0, "MANT": 0, "BIAS": 0}
    mant, bias = _FORMAT[cache.dtype]
    emulate = interpreting()
    return (cache.view(torch.uint8) if emulate else cache, 1.0 / scale,
            {"QUANT": 2 if emulate else 1, "FP8_MAX": fp8_max(cache.dtype), "MANT": mant, "BIAS": bias})
