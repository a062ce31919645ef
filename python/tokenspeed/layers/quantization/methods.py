"""Which weight quantization a model runs with: `--quantization` and the checkpoint's own
`quantization_config`, resolved once at start, before any weight is read.

Supported: FP8 (e4m3) weights with one scale per output channel and dynamic per-token activation
scales. They come from either
* `--quantization fp8` on a bf16/fp16/fp32 checkpoint: each linear weight is quantised while
  loading (scale = max |row| / 448);
* an FP8 checkpoint, loaded as it is:
  - compressed-tensors (llm-compressor): `quantization_config = {"quant_method":
    "compressed-tensors", "format": "float-quantized" | "naive-quantized", "config_groups":
    {name: {"targets": ["Linear"], "weights": {"type": "float", "num_bits": 8, "strategy":
    "channel" | "tensor", ...}, "input_activations": {...} | null}}, "ignore": [...]}`; tensors
    `weight` (fp8), `weight_scale` ([N, 1] or [1]), `input_scale` (static; dropped);
  - ModelOpt: `quantization_config = {"quant_method": "modelopt", "quant_algo": "FP8" |
    "FP8_PER_CHANNEL_PER_TOKEN", "exclude_modules": [...]}` or the same under "quantization" in
    `hf_quant_config.json`; tensors `weight`, `weight_scale` (scalar or [N]), `input_scale`;
  - vLLM/HF `{"quant_method": "fp8"}` with per-tensor `weight_scale` (no `weight_block_size`);
  - block-wise FP8 as DeepSeek-V3/R1 (and Kimi-K2) ship it: `{"quant_method": "fp8", "fmt":
    "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}`; tensors `weight`
    (fp8 [N, K]) and `weight_scale_inv` (fp32 [ceil(N/128), ceil(K/128)], W = weight * the
    scale of its 128x128 tile; "inv" names DeepSeek's convention, it multiplies). The weights stay
    fp8 in memory with their block scales (fp8.py's fp8_block_linear: activations quantised per
    token per 128-group, a block-scaled W8A8 GEMM), the routed experts too (layers/moe.py).
    Every linear the checkpoint ships so is FP8: MLA's q_a/q_b/kv_a_proj_with_mqa/o_proj, the
    dense and shared-expert MLPs, the routed experts; the router (`mlp.gate`), embeddings, norms
    and the LM head stay in the model dtype. One exception: MLA's `kv_b_proj` is never multiplied
    through as a linear (its halves W_UK / W_UV are absorbed into the query and the output), so
    it is dequantised to the model dtype once loaded (fp8_model.py; V3: 16.8M weights a layer).
    Only 128x128 blocks, e4m3 and dynamic activations load; a fused layer (gate_up) or a tensor-
    parallel shard must cut the weight on the block grid (V3's shapes do at TP 8).
Per-tensor weight scales are expanded to per-channel ones (the same numbers, exactly). Static
activation scales are replaced by dynamic per-token ones, which are at least as accurate.
Anything else (AWQ, GPTQ, bitsandbytes, INT8, ...) fails here, naming the method.

The LM head (`--lm-head-quantization`): `auto` quantises it to FP8 with the other linears when
TokenSpeed quantises the checkpoint (`--quantization fp8`): at batch-1 decode it is the largest
single read (Llama-3.1-8B: 1.05 GB of bf16 per token, ~0.35 ms on an H100), and FP8 halves it.
An FP8 checkpoint's head stays as the checkpoint has it: high precision where its config excludes
it (most do), FP8 where the checkpoint ships it so (`lm_head.weight_scale` beside an fp8
`lm_head.weight`: compressed-tensors or ModelOpt configs that do not ignore `lm_head`). `fp8`
forces it (an FP8 checkpoint's high-precision head is quantised once loaded); `none` keeps it in
the model dtype, as vLLM does (an FP8 head of the checkpoint is dequantised once loaded). A tied
head (SmolLM2) gets its own FP8 copy; the embedding lookup keeps the model dtype.
"""

from __future__ import annotations

import fnmatch
import glob
import json
import os
import re
from dataclasses import dataclass, replace
from typing import Any

SUPPORTED = ("fp8: '--quantization fp8' quantises a bf16/fp16/fp32 checkpoint while loading; FP8 "
             "checkpoints in the compressed-tensors, ModelOpt (FP8, FP8_PER_CHANNEL_PER_TOKEN), "
             "per-tensor 'fp8' and block-wise 'fp8' (weight_block_size [128, 128], DeepSeek-V3) "
             "formats load as they are")
# Spellings of --quantization that name FP8 (vLLM/SGLang accept the checkpoint formats' names).
FP8_FLAG_NAMES = ("fp8", "compressed-tensors", "compressed_tensors", "modelopt", "modelopt_fp8")
LM_HEAD_CHOICES = ("auto", "fp8", "none")  # --lm-head-quantization (the flag table's choices)


class QuantizationError(ValueError):
    """An unsupported or malformed quantization setting (raised before loading weights)."""


@dataclass(frozen=True)
class Fp8Config:
    """FP8 weights. checkpoint_format: None when TokenSpeed quantises a high-precision checkpoint;
    else the format the checkpoint's fp8 tensors are in. ignore: module-name patterns (HF names)
    kept in high precision. lm_head: the LM head's matmul runs on FP8 weights too (quantised
    after loading; a tied head gets its own FP8 copy, the embedding keeps the model dtype).
    checkpoint_lm_head: the checkpoint's LM head is FP8 itself (it ships lm_head.weight_scale):
    it loads as FP8, and is dequantised once loaded when lm_head is False. weight_block: the
    checkpoint's weights carry one scale per [block_n, block_k] tile (`weight_scale_inv`)."""

    checkpoint_format: str | None = None
    ignore: tuple[str, ...] = ()
    lm_head: bool = False
    checkpoint_lm_head: bool = False
    # (block_n, block_k) of a block-scaled checkpoint (DeepSeek-V3: (128, 128)); None: per channel.
    weight_block: tuple[int, int] | None = None

    def ignores(self, hf_name: str) -> bool:
        for pattern in self.ignore:
            if pattern.startswith("re:"):
                if re.match(pattern[3:], hf_name):
                    return True
            elif fnmatch.fnmatchcase(hf_name, pattern) or hf_name.endswith("." + pattern):
                return True
        return False


def _unsupported(method: str, where: str) -> QuantizationError:
    return QuantizationError(f"quantization method {method!r} ({where}) is not supported; "
                             f"supported: {SUPPORTED}")


def _compressed_tensors(qc: dict[str, Any]) -> Fp8Config:
    where = "compressed-tensors checkpoint"
    fmt = qc.get("format", "float-quantized")
    if fmt not in ("float-quantized", "naive-quantized"):
        raise _unsupported(f"compressed-tensors/{fmt}", where)
    for name, group in (qc.get("config_groups") or {}).items():
        w = group.get("weights") or {}
        if w.get("type") != "float" or int(w.get("num_bits", 0)) != 8:
            raise _unsupported(f"compressed-tensors/{w.get('type')}{w.get('num_bits')}", where)
        if w.get("strategy") not in ("channel", "tensor"):
            raise _unsupported(f"compressed-tensors FP8 with {w.get('strategy')!r} weight scales "
                               f"(group {name})", where)
        act = group.get("input_activations")
        if act and (act.get("type") != "float" or int(act.get("num_bits", 0)) != 8):
            raise _unsupported(f"compressed-tensors activations {act.get('type')}{act.get('num_bits')}",
                               where)
    return Fp8Config("compressed-tensors", tuple(qc.get("ignore") or ()))


def _modelopt(qc: dict[str, Any]) -> Fp8Config:
    inner = qc.get("quantization") if isinstance(qc.get("quantization"), dict) else qc
    algo = str(inner.get("quant_algo") or "")
    if algo.upper() not in ("FP8", "FP8_PER_CHANNEL_PER_TOKEN"):
        raise _unsupported(f"modelopt/{algo}", "ModelOpt checkpoint")
    return Fp8Config("modelopt", tuple(inner.get("exclude_modules") or ()))


def _weight_block(qc: dict[str, Any]) -> tuple[int, int] | None:
    """The block of a block-wise `fp8` config (None without `weight_block_size`); only DeepSeek's
    layout loads: 128x128 tiles, e4m3 weights, dynamic activations."""
    block = qc.get("weight_block_size")
    if not block:
        return None
    where = "checkpoint quantization_config"
    if [int(b) for b in block] != [128, 128]:
        raise _unsupported(f"fp8 with weight_block_size {list(block)} (block-wise FP8 loads with "
                           "[128, 128] blocks only, as DeepSeek-V3 ships them)", where)
    if str(qc.get("fmt", "e4m3")).lower() != "e4m3":
        raise _unsupported(f"block-wise fp8 with fmt {qc.get('fmt')!r} (only e4m3)", where)
    if str(qc.get("activation_scheme", "dynamic")).lower() != "dynamic":
        raise _unsupported(f"block-wise fp8 with activation_scheme {qc.get('activation_scheme')!r} "
                           "(only dynamic: activations are quantised per token per 128-group)", where)
    return (128, 128)


def checkpoint_quantization(hf_config: dict[str, Any], model_dir: str | None = None) -> Fp8Config | None:
    """The quantization a checkpoint's config.json (or ModelOpt's hf_quant_config.json) declares,
    and whether its LM head is FP8 (read from the tensor names, not the config: whether a
    format's targets cover the head varies, the tensors say it)."""
    qc = hf_config.get("quantization_config")
    if qc is None and model_dir and os.path.isfile(os.path.join(model_dir, "hf_quant_config.json")):
        with open(os.path.join(model_dir, "hf_quant_config.json")) as f:
            qc = {"quant_method": "modelopt", **json.load(f)}
    if not qc:
        return None
    method = str(qc.get("quant_method", "")).lower()
    if method == "compressed-tensors":
        cfg = _compressed_tensors(qc)
    elif method == "modelopt":
        cfg = _modelopt(qc)
    elif method == "fp8":
        ignore = tuple(qc.get("ignored_layers") or qc.get("modules_to_not_convert") or ())
        cfg = Fp8Config("fp8", ignore, weight_block=_weight_block(qc))
    else:
        raise _unsupported(method or str(qc), "checkpoint quantization_config")
    head = model_dir is not None and not hf_config.get("tie_word_embeddings", False) \
        and _has_tensor(model_dir, "lm_head.weight_scale")
    return replace(cfg, checkpoint_lm_head=head)


def _has_tensor(model_dir: str, name: str) -> bool:
    """Whether the safetensors checkpoint in model_dir holds tensor `name` (the index, else each
    file's header: no tensor is read)."""
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            return name in (json.load(f).get("weight_map") or {})
    from safetensors import safe_open

    for path in sorted(glob.glob(os.path.join(model_dir, "*.safetensors"))):
        with safe_open(path, framework="pt") as h:
            if name in set(h.keys()):  # a handle is not a dict
                return True
    return False


def resolve_quantization(method: str | None, hf_config: dict[str, Any],
                         model_dir: str | None = None, lm_head: str = "auto") -> Fp8Config | None:
    """The FP8 setup to load with, or None for no quantization; QuantizationError otherwise.
    lm_head: --lm-head-quantization (see the module docstring)."""
    if lm_head not in LM_HEAD_CHOICES:
        raise QuantizationError(f"--lm-head-quantization {lm_head!r}: expected one of {LM_HEAD_CHOICES}")
    cfg = checkpoint_quantization(hf_config, model_dir)
    if method not in (None, "", "none"):
        if method.lower() not in FP8_FLAG_NAMES:
            raise _unsupported(method, "--quantization")
        cfg = cfg or Fp8Config()
    if cfg is None:
        if lm_head == "fp8":
            raise QuantizationError("--lm-head-quantization fp8 needs FP8 weights (--quantization fp8 "
                                    "or an FP8 checkpoint)")
        return None
    if lm_head == "fp8" or (lm_head == "auto" and (cfg.checkpoint_format is None
                                                    or cfg.checkpoint_lm_head)):
        return replace(cfg, lm_head=True)
    return cfg
