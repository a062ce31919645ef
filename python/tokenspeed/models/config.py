"""ModelConfig: the architecture facts the worker needs, read from HF config.json or GGUF metadata."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope_theta: float
    # HF-style rope parameters minus the theta: {"rope_type": "llama3", "factor": ...}.
    rope_scaling: dict[str, Any] = field(default_factory=dict)
    # Features of each head that rotate (partial_rotary_factor * head_dim); 0: all of them.
    rotary_dim: int = 0
    # Sliding-window layers' own rope (Gemma 3: `rope_parameters["sliding_attention"]` or
    # `rope_local_base_freq`): (theta, scaling); None: the same rope as the full layers.
    sliding_rope: tuple[float, dict[str, Any]] | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    # Per layer: the attention window, or None for full attention.
    sliding_windows: list[int | None] = field(default_factory=list)
    torch_dtype: str = "bfloat16"
    hidden_act: str = "silu"
    # Mixture of experts (0 experts: a dense model). `moe_layers[i]`: layer i's MLP is sparse.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False  # renormalise the top-k routing weights to sum to 1
    moe_layers: list[bool] = field(default_factory=list)
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def mla_v_dim(self) -> int | None:
        """Multi-head latent attention (DeepSeek): kv_lora_rank, the width of the cached latent,
        which the absorbed attention reads as V (the first features of its one K "head")."""
        return int(self.raw["kv_lora_rank"]) if "kv_lora_rank" in self.raw else None

    def is_moe_layer(self, layer_id: int) -> bool:
        return bool(self.moe_layers) and self.moe_layers[layer_id]


def mtp_layers(raw: dict[str, Any]) -> int:
    """Multi-token prediction layers the checkpoint ships after its stack (DeepSeek-V3's
    `num_nextn_predict_layers`; 0: none)."""
    return int(raw.get("num_nextn_predict_layers") or 0)


def local_heads(config: ModelConfig, tp_size: int) -> tuple[int, int]:
    """(query heads, KV heads) one rank of an attention-TP group of `tp_size` holds: KV heads
    split, or one replicated head per rank when there are fewer KV heads than ranks."""
    return (config.num_attention_heads // tp_size,
            max(1, config.num_key_value_heads // tp_size))


# (The bare `*Model` names: decoder checkpoints saved as embedders; `*ForSequenceClassification`:
# decoder cross-encoders; models/pooling.py.)
_QKV_BIAS_BY_DEFAULT = {"Qwen2ForCausalLM", "Qwen2Model", "Qwen2ForSequenceClassification"}
_QK_NORM = {"Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Qwen3Model", "Qwen3ForSequenceClassification"}


def _moe(raw: dict[str, Any], arch: str, layers: int) -> dict[str, Any]:
    """Expert count, top-k, expert width, renormalisation and which layers are sparse.

    Mixtral: every layer sparse, experts as wide as `intermediate_size`, top-k always
    renormalised. Qwen3-MoE: `norm_topk_prob`; layer i is dense when listed in `mlp_only_layers`
    or when (i + 1) is not a multiple of `decoder_sparse_step` (as in HF Qwen3MoeDecoderLayer)."""
    experts = int(raw.get("num_experts") or raw.get("num_local_experts")
                  or raw.get("n_routed_experts") or 0)
    if experts == 0:
        return {}
    if arch.startswith("Deepseek"):  # dense up to first_k_dense_replace, then every freq-th
        first, freq = int(raw.get("first_k_dense_replace") or 0), int(raw.get("moe_layer_freq") or 1)
        return {"num_experts": experts, "num_experts_per_tok": int(raw["num_experts_per_tok"]),
                "moe_intermediate_size": int(raw["moe_intermediate_size"]),
                "norm_topk_prob": bool(raw.get("norm_topk_prob", False)),
                "moe_layers": [i >= first and i % freq == 0 for i in range(layers)]}
    if arch == "MixtralForCausalLM":
        return {"num_experts": experts, "num_experts_per_tok": int(raw["num_experts_per_tok"]),
                "moe_intermediate_size": int(raw["intermediate_size"]), "norm_topk_prob": True,
                "moe_layers": [True] * layers}
    step = int(raw.get("decoder_sparse_step") or 1)
    dense = set(raw.get("mlp_only_layers") or [])
    return {"num_experts": experts, "num_experts_per_tok": int(raw["num_experts_per_tok"]),
            "moe_intermediate_size": int(raw.get("moe_intermediate_size") or raw["intermediate_size"]),
            "norm_topk_prob": bool(raw.get("norm_topk_prob", False)),
            "moe_layers": [i not in dense and (i + 1) % step == 0 for i in range(layers)]}


def _sliding_rope(raw: dict[str, Any]) -> tuple[float, dict[str, Any]] | None:
    params = raw.get("rope_parameters") or {}
    if isinstance(params.get("sliding_attention"), dict):
        return _rope({**raw, "rope_parameters": params["sliding_attention"], "rope_scaling": None,
                      "rope_theta": None})
    if raw.get("rope_local_base_freq"):
        return float(raw["rope_local_base_freq"]), {}
    return None


def _rope(raw: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    """Theta and scaling from either the transformers-4 (`rope_theta`, `rope_scaling`) or -5
    (`rope_parameters`) spelling; per layer type (Gemma 3), the full-attention layers'. Phi-3's
    `original_max_position_embeddings` sits beside them and its older checkpoints call LongRoPE
    "su"."""
    params = dict(raw.get("rope_parameters") or {})
    if isinstance(params.get("full_attention"), dict):
        params = dict(params["full_attention"])
    scaling = dict(raw.get("rope_scaling") or {})
    theta = params.pop("rope_theta", None) or raw.get("rope_theta") or 10000.0
    merged = {**scaling, **params}
    if "type" in merged and "rope_type" not in merged:
        merged["rope_type"] = merged.pop("type")
    merged.pop("type", None)
    merged.pop("partial_rotary_factor", None)  # ModelConfig.rotary_dim
    if merged.get("rope_type") == "su":
        merged["rope_type"] = "longrope"
    if merged.get("rope_type", "default") == "default":
        merged = {}
    if merged.get("rope_type") in ("longrope", "yarn", "llama3"):
        merged.setdefault("original_max_position_embeddings",
                          raw.get("original_max_position_embeddings")
                          or raw.get("max_position_embeddings"))
    return float(theta), merged


def _rotary_dim(raw: dict[str, Any], head_dim: int) -> int:
    factor = raw.get("partial_rotary_factor") or (raw.get("rope_parameters") or {}).get(
        "partial_rotary_factor") or 1.0
    return int(head_dim * float(factor))


def _sliding_windows(raw: dict[str, Any], arch: str, layers: int) -> list[int | None]:
    window = raw.get("sliding_window")
    if window is None:
        return [None] * layers
    if raw.get("layer_types"):  # transformers >= 4.54 spells it out per layer
        return [window if t == "sliding_attention" else None for t in raw["layer_types"]]
    if arch.startswith("Qwen"):  # older Qwen configs: a switch plus the first full-attention layers
        if not raw.get("use_sliding_window", False):
            return [None] * layers
        first = raw.get("max_window_layers", layers)
        return [window if i >= first else None for i in range(layers)]
    return [window] * layers  # Mistral


# HF `model_type` → architecture, for config.json files without `architectures` (a config saved
# on its own rather than with a model).
_ARCH_BY_MODEL_TYPE = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                       "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                       "qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM",
                       "phi3": "Phi3ForCausalLM", "gemma3_text": "Gemma3ForCausalLM",
                       "gpt_oss": "GptOssForCausalLM", "deepseek_v2": "DeepseekV2ForCausalLM",
                       "deepseek_v3": "DeepseekV3ForCausalLM"}


def config_from_hf_dict(raw: dict[str, Any]) -> ModelConfig:
    arch = (raw.get("architectures")
            or [_ARCH_BY_MODEL_TYPE.get(raw.get("model_type", ""), "LlamaForCausalLM")])[0]
    heads = raw["num_attention_heads"]
    theta, scaling = _rope(raw)
    layers = raw["num_hidden_layers"]
    head_dim = raw.get("head_dim") or raw["hidden_size"] // heads
    kv_heads = raw.get("num_key_value_heads") or heads
    if "kv_lora_rank" in raw:  # DeepSeek MLA, absorbed: one latent "head" (latent | rope) per token
        head_dim, kv_heads = int(raw["kv_lora_rank"]) + int(raw["qk_rope_head_dim"]), 1
    return ModelConfig(
        architecture=arch,
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"],
        num_hidden_layers=raw["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=raw.get("max_position_embeddings", 4096),
        rope_theta=theta,
        rope_scaling=scaling,
        rotary_dim=_rotary_dim(raw, head_dim),
        sliding_rope=_sliding_rope(raw),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=bool(raw.get("attention_bias", arch in _QKV_BIAS_BY_DEFAULT)),
        mlp_bias=bool(raw.get("mlp_bias", False)),
        qk_norm=arch in _QK_NORM,
        sliding_windows=_sliding_windows(raw, arch, layers),
        torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "bfloat16"),
        hidden_act=raw.get("hidden_act") or raw.get("hidden_activation") or "silu",
        **_moe(raw, arch, layers),
        raw=raw,
    )


def check_expert_parallel(config: ModelConfig, ep_size: int, moe_tp_size: int = 1) -> None:
    """Start-up check of the MoE parallel sizes against the model; the message names both values."""
    if ep_size > 1 and config.num_experts == 0:
        raise ValueError(f"--ep-size {ep_size}: model {config.architecture} has no experts "
                         "(expert parallelism needs a mixture-of-experts model)")
    if config.num_experts and config.num_experts % ep_size:
        raise ValueError(f"--ep-size {ep_size} does not divide the model's {config.num_experts} "
                         f"experts ({config.architecture})")
    if config.num_experts and config.moe_intermediate_size % moe_tp_size:
        raise ValueError(f"--moe-tp-size {moe_tp_size} does not divide the experts' intermediate "
                         f"size {config.moe_intermediate_size} ({config.architecture})")


def merge_config(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """`base` with `overrides` merged over it: nested objects key by key (so
    `{"rope_scaling": {"factor": 4}}` keeps the other rope fields, as vLLM's --hf-overrides
    does), any other value replaced."""
    out = dict(base)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge_config(out[key], value)
        else:
            out[key] = value
    return out


# Multimodal checkpoints served as their text tower (the front end refuses image parts):
# architecture -> (the tower's causal-LM architecture, its `text_config` model_type).
TEXT_TOWERS = {"Gemma3ForConditionalGeneration": ("Gemma3ForCausalLM", "gemma3_text")}


def text_tower_config(raw: dict[str, Any]) -> dict[str, Any]:
    """A multimodal config.json's `text_config` as a causal LM's config, with transformers'
    defaults filled in: the hub's configs list only the fields that differ from them."""
    from transformers import AutoConfig

    arch, model_type = TEXT_TOWERS[raw["architectures"][0]]
    text = dict(raw.get("text_config") or {})
    full = AutoConfig.for_model(text.pop("model_type", None) or model_type, **text).to_dict()
    dtype = full.get("torch_dtype") or full.get("dtype") or raw.get("torch_dtype") or raw.get("dtype")
    # The checkpoint's quantization covers the tower's tensors too.
    quant = {"quantization_config": raw["quantization_config"]} if "quantization_config" in raw else {}
    return {**full, **quant, "architectures": [arch], "torch_dtype": dtype}


def read_config_json(model_dir: str | os.PathLike[str],
                     overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """The model's config.json with `--json-model-override-args` merged over it (a multimodal
    checkpoint's: its text tower's, see TEXT_TOWERS): what every reader of the model's config
    (launcher and workers) sees."""
    path = os.path.join(model_dir, "config.json")
    if not os.path.exists(path):
        raise FileNotFoundError(f"no config.json in model directory {str(model_dir)!r}")
    with open(path) as f:
        raw = json.load(f)
    raw = raw if overrides is None else merge_config(raw, overrides)
    return text_tower_config(raw) if (raw.get("architectures") or [""])[0] in TEXT_TOWERS else raw


def load_hf_config(model_dir: str, overrides: dict[str, Any] | None = None) -> ModelConfig:
    return config_from_hf_dict(read_config_json(model_dir, overrides))


# GGUF `general.architecture` → HF architecture name.
GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
}


def config_from_gguf_fields(fields: dict[str, Any], has_output_tensor: bool) -> ModelConfig:
    """Build the config from GGUF key/values (`{arch}.block_count`, ...)."""
    arch = fields["general.architecture"]
    if arch not in GGUF_ARCHITECTURES:
        raise NotImplementedError(f"GGUF architecture {arch!r} is not supported "
                                  f"(supported: {sorted(GGUF_ARCHITECTURES)})")

    def get(key: str, default: Any = None) -> Any:
        return fields.get(f"{arch}.{key}", default)

    hidden = get("embedding_length")
    heads = get("attention.head_count")
    vocab = get("vocab_size") or fields["tokenizer.vocab_size"]
    raw: dict[str, Any] = {
        "architectures": [GGUF_ARCHITECTURES[arch]],
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": get("feed_forward_length"),
        "num_hidden_layers": get("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": get("attention.head_count_kv", heads),
        "head_dim": get("attention.key_length") or hidden // heads,
        "rms_norm_eps": get("attention.layer_norm_rms_epsilon", 1e-6),
        "max_position_embeddings": get("context_length", 4096),
        "rope_theta": get("rope.freq_base", 10000.0),
        "tie_word_embeddings": not has_output_tensor,
        "torch_dtype": "bfloat16",
    }
    experts = get("expert_count") or 0
    if experts:
        # llama.cpp stores Mixtral as `llama` with experts; it renormalises the top-k weights of
        # both Mixtral and Qwen3-MoE unless the file says otherwise (`expert_weights_norm`).
        if arch == "llama":
            raw["architectures"] = ["MixtralForCausalLM"]
        raw.update(num_experts=experts, num_experts_per_tok=get("expert_used_count"),
                   moe_intermediate_size=get("expert_feed_forward_length") or get("feed_forward_length"),
                   norm_topk_prob=bool(get("expert_weights_norm", True)))
        if raw["intermediate_size"] is None:  # every layer sparse: no dense width in the file
            raw["intermediate_size"] = raw["moe_intermediate_size"]
    if get("rope.scaling.type") == "linear":
        raw["rope_scaling"] = {"rope_type": "linear", "factor": get("rope.scaling.factor")}
    return config_from_hf_dict(raw)
