"""FP8 KV cache settings: the storage dtype of `--kv-cache-dtype` and the per-layer K/V scales.

Scales (dequantised value = stored fp8 * scale) come from, in order of precedence:

1. `--quantization-param-path FILE`: a JSON file in vLLM's `QuantParamSchema` layout (the one
   vLLM's and SGLang's `kv_cache_scales.json` tools write), one scale per layer used for K and V:

       {"model_type": "llama",
        "kv_cache": {"dtype": "float8_e4m3fn",
                     "scaling_factor": {"0": {"0": 0.0152, "1": 0.0178, ...}}}}

   The outer key of `scaling_factor` is the tensor-parallel rank, the inner one the layer index;
   every layer of this rank must be present. TokenSpeed also accepts separate K and V scales per
   layer as `{"k": 0.0152, "v": 0.0211}` in place of the number.
2. The checkpoint's `k_scale` / `v_scale` tensors (compressed-tensors `kv_cache_scheme`, ModelOpt
   `kv_cache_quant_algo`): `model.layers.N.self_attn.{k_scale,v_scale}`, the ModelOpt spelling
   `model.layers.N.self_attn.{k_proj.k_scale,v_proj.v_scale}`, or an older single `kv_scale`.
3. 1.0, which suits models whose K/V activations stay well inside the fp8 range (|x| <= 448 for
   e4m3).
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

logger = logging.getLogger(__name__)

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


def quantize_fp8(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """x / scale rounded to fp8 `dtype`, clamped to its finite range: the torch twin of
    tokenspeed_kernels.fp8.quantize_fp8 (this one needs no Triton: the torch_native backend)."""
    m = float(torch.finfo(dtype).max)
    return (x.float() * (1.0 / scale)).clamp(-m, m).to(dtype)

# `--kv-cache-dtype` spellings (the flag table lists the same) → storage dtype; None = the model's.
KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {
    "auto": None,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
}

_SCALE_NAME = re.compile(
    r"^model\.layers\.(\d+)\.self_attn\.(?:attn\.|k_proj\.|v_proj\.)?(k_scale|v_scale|kv_scale)$")


def resolve_kv_cache_dtype(name: str | None, model_dtype: torch.dtype,
                           mla: bool = False) -> torch.dtype:
    """mla: the model caches MLA latents (DeepSeek), which have no fp8 path yet."""
    if name in (None, ""):
        name = "auto"
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype {name!r} not in {sorted(KV_CACHE_DTYPES)}")
    dtype = KV_CACHE_DTYPES[name]
    if mla and dtype is not None and is_fp8(dtype):
        raise ValueError(f"--kv-cache-dtype {name} is not supported yet for multi-head latent "
                         "attention models (DeepSeek-V2/V3): their latent KV cache runs in the "
                         "model dtype; use --kv-cache-dtype auto")
    return model_dtype if dtype is None else dtype


@dataclass
class KVScales:
    """Per-layer K and V scales; layers absent from both dicts use 1.0."""

    k: dict[int, float] = field(default_factory=dict)
    v: dict[int, float] = field(default_factory=dict)
    source: str = "default (1.0)"

    def lists(self, num_layers: int) -> tuple[list[float], list[float]]:
        return ([self.k.get(i, 1.0) for i in range(num_layers)],
                [self.v.get(i, 1.0) for i in range(num_layers)])


def load_kv_scales_json(path: str, num_layers: int, tp_rank: int = 0) -> KVScales:
    """Scales of this TP rank from a `--quantization-param-path` file (layout in the module doc)."""
    with open(path) as f:
        doc = json.load(f)
    kv = doc.get("kv_cache") if isinstance(doc, dict) else None
    by_rank = kv.get("scaling_factor") if isinstance(kv, dict) else None
    if not by_rank or kv is None:
        raise ValueError(f"{path}: expected {{'kv_cache': {{'scaling_factor': {{tp_rank: {{layer: "
                         "scale}}}}}}}} (vLLM's QuantParamSchema)")
    dtype = kv.get("dtype", "float8_e4m3fn")
    if dtype not in ("float8_e4m3fn", "float8_e5m2"):
        raise ValueError(f"{path}: kv_cache.dtype {dtype!r}, expected float8_e4m3fn or float8_e5m2")
    layers = by_rank.get(str(tp_rank)) or {}
    if not layers:
        raise ValueError(f"{path}: no scaling_factor entry for tensor-parallel rank {tp_rank} "
                         f"(ranks present: {sorted(by_rank)})")
    scales = KVScales(source=path)
    for key, value in layers.items():
        layer = int(key)
        if isinstance(value, dict):
            scales.k[layer], scales.v[layer] = float(value["k"]), float(value["v"])
        else:
            scales.k[layer] = scales.v[layer] = float(value)
    missing = [i for i in range(num_layers) if i not in scales.k]
    if missing:
        raise ValueError(f"{path}: no KV cache scale for layers {missing[:8]} of rank {tp_rank}")
    bad = [s for s in [*scales.k.values(), *scales.v.values()] if not s > 0]
    if bad:
        raise ValueError(f"{path}: KV cache scales must be positive, got {bad[:4]}")
    return scales


def resolve_kv_scales(kv_dtype: torch.dtype, num_layers: int, from_checkpoint: KVScales,
                      param_path: str | None) -> tuple[list[float], list[float]]:
    """Per-layer (K, V) scales of an fp8 cache: --quantization-param-path, else the
    checkpoint's, else 1.0; all 1.0 for other caches."""
    if not is_fp8(kv_dtype):
        if param_path:
            raise ValueError("--quantization-param-path holds FP8 KV cache scales; it needs "
                             "--kv-cache-dtype fp8 (or fp8_e4m3 / fp8_e5m2)")
        return KVScales().lists(num_layers)
    scales = load_kv_scales_json(param_path, num_layers) if param_path else from_checkpoint
    logger.info("fp8 KV cache (%s): scales from %s", kv_dtype, scales.source)
    return scales.lists(num_layers)


def split_kv_scales(tensors: Iterator[tuple[str, torch.Tensor]],
                    sink: KVScales | None) -> Iterator[tuple[str, torch.Tensor]]:
    """Pass a checkpoint's tensors through, taking out its K/V cache scales (into `sink`, when
    given) and the static activation scales (`input_scale`), which TokenSpeed replaces by
    dynamic per-token scales."""
    for name, tensor in tensors:
        if name.endswith(".input_scale"):
            continue
        m = _SCALE_NAME.match(name)
        if m is None:
            yield name, tensor
            continue
        if sink is not None:
            layer, kind = int(m.group(1)), m.group(2)
            value = float(tensor.to(torch.float32).max())  # scalar or per shard: the safe one (Tensor or LazyTensor)
            if kind in ("k_scale", "kv_scale"):
                sink.k[layer] = value
            if kind in ("v_scale", "kv_scale"):
                sink.v[layer] = value
            sink.source = "checkpoint"
