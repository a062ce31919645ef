"""Pooling models (`--is-embedding`) through ModelRunner's pooling step vs HF transformers, fp32
CPU: a tiny random BERT embedder (mean pooling + Normalize, as sentence-transformers ships
them), a tiny random BERT cross-encoder (text pairs: token types) and a tiny random Qwen3
embedder (last-token pooling), each in one batched step of several prompts."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import BertConfig, BertForSequenceClassification, BertModel, Qwen3Config, Qwen3Model

from tokenspeed.worker.model_runner import ModelRunner
from tokenspeed.worker.plan import StepPlan

ATOL = 1e-4
PAGE = 4


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Non-trivial weights: random biases and norm scales too, so dropping one would show."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1.0 + 0.2 * noise if "norm" in name.lower() else 0.08 * noise)


def bert_config(**kw: object) -> BertConfig:
    return BertConfig(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                      intermediate_size=48, max_position_embeddings=64, **kw)


def sentence_transformers_files(path: Path, method: str) -> None:
    """modules.json + 1_Pooling/config.json as sentence-transformers writes them."""
    (path / "1_Pooling").mkdir()
    (path / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 32, "pooling_mode_cls_token": method == "cls",
         "pooling_mode_mean_tokens": method == "mean", "pooling_mode_lasttoken": method == "last"}))
    (path / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]))


def pool_once(path: Path, prompts: list[list[int]], segment_b: list[int] | None = None) -> np.ndarray:
    """One step of the pooling runner over every prompt (whole prompts, as the scheduler sends
    pooling requests); the pooled vectors in prompt order."""
    runner = ModelRunner(str(path), page_size=PAGE, num_pages=256, max_slots=8,
                         max_context_len=64, pooling=True)
    segment_b = segment_b or [0] * len(prompts)
    new = [{"slot": i, "temperature": 0.0, "pooling": True, "segment_b": b}
           for i, b in enumerate(segment_b)]
    tables, next_page = [], 0
    for i, p in enumerate(prompts):
        n = -(-len(p) // PAGE)
        tables.append((i, 0, list(range(next_page, next_page + n))))
        next_page += n
    plan = StepPlan.build(new=new, page_tables=tables,
                          scheduled=[(i, 0, p, True) for i, p in enumerate(prompts)])
    out = runner.launch(plan).wait()
    assert out.pooled is not None and out.slots.tolist() == list(range(len(prompts)))
    arrays = out.arrays()  # what crosses to the engine: one vector per event, no tokens
    assert np.frombuffer(arrays["event_tokens_len"], np.uint32).tolist() == [0] * len(prompts)
    assert len(arrays["event_pooled"]) == out.pooled.size * 4
    return out.pooled


PROMPTS = [[5, 17, 33, 2, 9, 41, 60], [7, 3], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]]


def test_bert_embedder_matches_hf_mean_pooled_and_normalized(tmp_path: Path) -> None:
    torch.manual_seed(0)
    hf = BertModel(bert_config()).eval()
    randomize(hf, seed=1)
    hf.save_pretrained(tmp_path)
    sentence_transformers_files(tmp_path, "mean")
    ours = pool_once(tmp_path, PROMPTS)
    for p, v in zip(PROMPTS, ours):
        with torch.no_grad():
            h = hf(torch.tensor([p])).last_hidden_state[0]
        ref = torch.nn.functional.normalize(h.mean(0), dim=0).numpy()
        np.testing.assert_allclose(v, ref, atol=ATOL)
        assert abs(np.linalg.norm(v) - 1.0) < 1e-5


def test_bert_cross_encoder_matches_hf_logits_on_text_pairs(tmp_path: Path) -> None:
    torch.manual_seed(0)
    hf = BertForSequenceClassification(bert_config(num_labels=1)).eval()
    randomize(hf, seed=2)
    hf.save_pretrained(tmp_path)
    # [CLS] a [SEP] b [SEP]: the second segment (token type 1) starts at `b`.
    pairs = [([1, 5, 6, 2], [7, 8, 9, 2]), ([1, 40, 2], [41, 42, 43, 44, 2])]
    prompts = [a + b for a, b in pairs]
    starts = [len(a) for a, _ in pairs]
    ours = pool_once(tmp_path, prompts, starts)
    for (a, b), v in zip(pairs, ours):
        types = torch.tensor([[0] * len(a) + [1] * len(b)])
        with torch.no_grad():
            ref = hf(torch.tensor([a + b]), token_type_ids=types).logits[0]
        np.testing.assert_allclose(v, ref.numpy(), atol=ATOL)
    # Token types matter: the same tokens as one segment give another score.
    single = pool_once(tmp_path, prompts[:1])
    assert abs(float(single[0][0]) - float(ours[0][0])) > 1e-3


@pytest.mark.parametrize("saved_as", ["Qwen3Model", "Qwen3ForCausalLM"])
def test_qwen3_embedder_matches_hf_last_token(tmp_path: Path, saved_as: str) -> None:
    cfg = Qwen3Config(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                      max_position_embeddings=64, tie_word_embeddings=True)
    torch.manual_seed(0)
    hf = Qwen3Model(cfg).eval()
    randomize(hf, seed=3)
    if saved_as == "Qwen3Model":
        hf.save_pretrained(tmp_path)
    else:  # Qwen3-Embedding ships `Qwen3ForCausalLM` configs; the embedder reads either
        from transformers import Qwen3ForCausalLM

        lm = Qwen3ForCausalLM(cfg).eval()
        lm.model.load_state_dict(hf.state_dict())
        lm.save_pretrained(tmp_path)
    ours = pool_once(tmp_path, PROMPTS)  # no modules.json: last token, normalized
    for p, v in zip(PROMPTS, ours):
        with torch.no_grad():
            h = hf(torch.tensor([p])).last_hidden_state[0, -1]
        np.testing.assert_allclose(v, torch.nn.functional.normalize(h, dim=0).numpy(), atol=ATOL)


@pytest.mark.parametrize("family", ["qwen3", "qwen2", "llama"])
def test_decoder_cross_encoder_matches_hf_sequence_classification(tmp_path: Path, family: str) -> None:
    """`*ForSequenceClassification` decoders (Qwen3-Reranker converted to sequence
    classification, as vLLM and sentence-transformers' CrossEncoder load it): the last token's
    state through `score`, one logit per label, as HF computes them."""
    import transformers

    small = {"vocab_size": 97, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}
    cfg_cls, model_cls = {
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForSequenceClassification),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForSequenceClassification),
        "llama": (transformers.LlamaConfig, transformers.LlamaForSequenceClassification),
    }[family]
    extra = {"head_dim": 8} if family == "qwen3" else {}
    hf = model_cls(cfg_cls(**small, **extra, num_labels=3, pad_token_id=0)).eval()
    randomize(hf, seed=5)
    hf.save_pretrained(tmp_path)
    ours = pool_once(tmp_path, PROMPTS)
    assert ours.shape == (len(PROMPTS), 3)
    for p, v in zip(PROMPTS, ours):
        with torch.no_grad():
            ref = hf(torch.tensor([p])).logits[0]
        np.testing.assert_allclose(v, ref.numpy(), atol=ATOL)
