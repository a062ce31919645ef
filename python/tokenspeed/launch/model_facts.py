"""What the launcher reads from a model directory besides its weights: the context length, the
vocabulary, the pooling facts of an embedding model, the generation defaults and the flags its
checkpoint cannot serve."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from tokenspeed.models.config import mtp_layers, read_config_json

logger = logging.getLogger(__name__)


def model_context_length(model_dir: Path, overrides: dict[str, Any] | None = None) -> int:
    cfg = read_config_json(model_dir, overrides)
    return int(cfg.get("max_position_embeddings") or cfg.get("max_seq_len") or 4096)


def model_vocab_size(model_dir: Path, overrides: dict[str, Any] | None = None) -> int:
    """The model's vocabulary (its logits' width; may exceed the tokenizer's)."""
    cfg = read_config_json(model_dir, overrides)
    return int(cfg.get("vocab_size") or cfg.get("text_config", {}).get("vocab_size") or 0)


def checkpoint_refusal(cfg: Any, model_dir: Path) -> str | None:
    """Flags the checkpoint cannot serve, as one line, before any worker starts (a worker
    would refuse them too, after a spawn): an unsupported --quantization or checkpoint
    quantization_config (or --lm-head-quantization fp8 without FP8 weights), NEXTN drafting
    without an MTP layer. None: nothing to refuse."""
    from tokenspeed.layers.quantization.methods import QuantizationError, resolve_quantization

    raw = read_config_json(model_dir, cfg.json_model_override_args)
    try:
        resolve_quantization(cfg.quantization, raw, str(model_dir), cfg.lm_head_quantization)
    except QuantizationError as e:
        return str(e)
    if cfg.speculative_algorithm == "NEXTN" and not mtp_layers(raw):
        return (f"not supported yet: --speculative-algorithm NEXTN for {model_dir}: it has no "
                "multi-token prediction layer to draft with (num_nextn_predict_layers is 0 or "
                "absent; DeepSeek-V3's checkpoints have one)")
    return None


def pooling_facts(model_dir: Path, overrides: dict[str, Any] | None = None
                  ) -> tuple[list[str], int]:
    """`--is-embedding`: the classifier's labels (none for an embedding model) and the floats
    of one pooled vector (models/pooling.py; imported here only when pooling)."""
    from tokenspeed.models.pooling import model_pooling_facts

    return model_pooling_facts(read_config_json(model_dir, overrides))


GENERATION_DEFAULT_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def sampling_defaults(model_dir: Path, source: str) -> dict[str, float]:
    """Sampling values a request gets for the fields it omits: with `--sampling-defaults model`
    the model's generation_config.json values (as vLLM applies them), with `openai` none."""
    path = Path(model_dir) / "generation_config.json"
    if source != "model" or not path.is_file():
        return {}
    try:
        gen = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: {e}") from e
    out = {k: float(gen[k]) for k in GENERATION_DEFAULT_FIELDS if isinstance(gen.get(k), (int, float))}
    if out:
        logger.info("default sampling parameters from %s: %s (--sampling-defaults openai to ignore)",
                    path, out)
    return out
