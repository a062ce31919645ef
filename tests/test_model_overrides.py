"""`--json-model-override-args` / `--hf-overrides`: one merge of the JSON over config.json
(models/config.py `read_config_json`), read alike by the launcher's model facts and the
workers' checkpoint config."""

from __future__ import annotations

import json
from pathlib import Path

from tokenspeed.launch.model_facts import model_context_length, model_vocab_size, pooling_facts
from tokenspeed.models.config import merge_config, read_config_json
from tokenspeed.models.weights import open_checkpoint

BASE = {"architectures": ["LlamaForCausalLM"], "vocab_size": 97, "hidden_size": 32,
        "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 64, "rms_norm_eps": 1e-5,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 32}}


def model_dir(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(BASE))
    return tmp_path


def test_nested_objects_merge_key_by_key_and_other_values_are_replaced() -> None:
    merged = merge_config(BASE, {"rope_scaling": {"factor": 4.0}, "architectures": ["X"]})
    assert merged["rope_scaling"] == {**BASE["rope_scaling"], "factor": 4.0}
    assert merged["architectures"] == ["X"]
    assert BASE["rope_scaling"]["factor"] == 8.0  # the base is left as it was


def test_launcher_and_worker_read_the_same_overridden_config(tmp_path: Path) -> None:
    d = model_dir(tmp_path)
    over = {"max_position_embeddings": 128, "vocab_size": 101, "rms_norm_eps": 1e-3}
    assert (model_context_length(d), model_vocab_size(d)) == (64, 97)
    assert (model_context_length(d, over), model_vocab_size(d, over)) == (128, 101)
    assert read_config_json(d, over)["rms_norm_eps"] == 1e-3
    cfg = open_checkpoint(str(d), "dummy", over).config
    assert (cfg.max_position_embeddings, cfg.vocab_size, cfg.rms_norm_eps) == (128, 101, 1e-3)
    assert open_checkpoint(str(d), "dummy").config.vocab_size == 97


def test_an_override_can_make_a_decoder_a_classifier(tmp_path: Path) -> None:
    d = model_dir(tmp_path)
    assert pooling_facts(d) == ([], 32)
    over = {"architectures": ["LlamaForSequenceClassification"], "id2label": {"0": "bad", "1": "good"}}
    assert pooling_facts(d, over) == (["bad", "good"], 2)
    two_way = {"architectures": ["Qwen3ForSequenceClassification"],
               "classifier_from_token": ["no", "yes"], "is_original_qwen3_reranker": True}
    assert pooling_facts(d, two_way) == (["yes"], 1)
