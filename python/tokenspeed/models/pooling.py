"""Pooling models (`--is-embedding`): how a prompt's hidden states become one vector.

A pooling request is prefill-only: its whole prompt runs in one step (rust/engine: the
scheduler never chunks it), so the step's hidden states of request i are rows
[query_start[i], query_start[i + 1]) and the model pools them into one float32 vector:
an embedding (mean / CLS / last token, then optionally L2-normalised, as the checkpoint's
sentence-transformers `modules.json` says) or a classifier's logits (a cross-encoder).

Decoder embedders (Qwen3-Embedding, gte-Qwen2: `Qwen3ForCausalLM` / `Qwen2Model` checkpoints
used as embedders) run the generation model's layers unchanged (causal, paged KV) and pool the
last token by default. Decoder classifiers (`Qwen3ForSequenceClassification` and kin, e.g.
Qwen3-Reranker converted to sequence classification, as vLLM and sentence-transformers load it)
put the last token's state through their `score` head.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from tokenspeed.layers.attention import ForwardBatch
from tokenspeed.models.config import ModelConfig

POOLING_METHODS = ("mean", "cls", "last")
# sentence-transformers' Pooling config switches → our method.
_ST_MODES = {"pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls",
             "pooling_mode_lasttoken": "last"}
# Modules of a sentence-transformers pipeline we run (others, e.g. Dense, are refused).
_ST_TRANSFORMER = "sentence_transformers.models.Transformer"
_ST_POOLING = "sentence_transformers.models.Pooling"
_ST_NORMALIZE = "sentence_transformers.models.Normalize"


@dataclass(frozen=True)
class PoolingConfig:
    method: str
    normalize: bool
    # A decoder classifier whose head is made of its LM head's rows (vLLM's config fields
    # `classifier_from_token` and `is_original_qwen3_reranker`): those tokens' ids, and whether
    # the head is the one row "second minus first" (an original Qwen3-Reranker: "no", "yes").
    head_token_ids: tuple[int, ...] = ()
    two_way: bool = False


def is_classifier(config: ModelConfig) -> bool:
    return config.architecture.endswith("ForSequenceClassification")


def classifier_labels(raw: dict) -> list[str]:
    """Label names by index: a head made of token rows is named by its tokens (one label, the
    positive token, when two-way); else config.json `id2label`, else `num_labels` generic
    names."""
    tokens = raw.get("classifier_from_token")
    if tokens:
        return [str(tokens[-1])] if raw.get("is_original_qwen3_reranker") else list(map(str, tokens))
    id2label = raw.get("id2label") or {}
    n = len(id2label) or int(raw.get("num_labels") or 2)
    return [str(id2label.get(str(i), id2label.get(i, f"LABEL_{i}"))) for i in range(n)]


def model_pooling_facts(raw: dict) -> tuple[list[str], int]:
    """(label names, floats per pooled vector) of the model whose config.json is `raw`: a
    classifier's labels and their count, or no labels and the embedding width (hidden size)."""
    arch = (raw.get("architectures") or [""])[0]
    if arch.endswith("ForSequenceClassification"):
        labels = classifier_labels(raw)
        return labels, len(labels)
    return [], int(raw.get("hidden_size") or raw.get("text_config", {}).get("hidden_size") or 0)


def head_tokens(raw: dict, model_dir: str | None) -> tuple[tuple[int, ...], bool]:
    """(token ids, two-way) of a classifier head made from the LM head (see PoolingConfig),
    the tokens looked up in the model directory's tokenizer.json; ((), False) for none."""
    tokens = raw.get("classifier_from_token")
    if not tokens:
        return (), False
    two_way = bool(raw.get("is_original_qwen3_reranker"))
    if two_way and len(tokens) != 2:
        raise ValueError("is_original_qwen3_reranker needs classifier_from_token to name two "
                         f"tokens (the negative, then the positive), got {tokens!r}")
    from tokenizers import Tokenizer

    path = os.path.join(model_dir or "", "tokenizer.json")
    if not os.path.exists(path):
        raise FileNotFoundError(f"classifier_from_token: no tokenizer.json in {model_dir!r} to "
                                "look the tokens up in")
    tokenizer = Tokenizer.from_file(path)
    ids = []
    for t in tokens:
        i = tokenizer.token_to_id(str(t))
        if i is None:
            raise ValueError(f"classifier_from_token: {t!r} is not a token of {path}")
        ids.append(i)
    return tuple(ids), two_way


def read_pooling_config(model_dir: str | None, default_method: str) -> PoolingConfig:
    """From sentence-transformers' `modules.json` (+ `1_Pooling/config.json`) when present;
    else `default_method`, normalised (what vLLM does for an embedding model without one)."""
    path = os.path.join(model_dir, "modules.json") if model_dir else ""
    if not path or not os.path.exists(path):
        return PoolingConfig(default_method, True)
    with open(path) as f:
        modules = json.load(f)
    method, normalize = default_method, False
    for m in modules:
        kind = m.get("type", "")
        if kind == _ST_POOLING:
            method = _pooling_mode(os.path.join(model_dir, m.get("path", ""), "config.json"))
        elif kind == _ST_NORMALIZE:
            normalize = True
        elif kind != _ST_TRANSFORMER:
            raise NotImplementedError(f"{path}: sentence-transformers module {kind!r} is not "
                                      "supported (only Transformer, Pooling and Normalize)")
    return PoolingConfig(method, normalize)


def _pooling_mode(path: str) -> str:
    with open(path) as f:
        cfg = json.load(f)
    on = [mode for key, mode in _ST_MODES.items() if cfg.get(key)]
    other = [k for k, v in cfg.items() if k.startswith("pooling_mode") and v and k not in _ST_MODES]
    if other or len(on) != 1:
        raise NotImplementedError(f"{path}: pooling {other or on} is not supported (one of "
                                  f"{sorted(_ST_MODES)})")
    return on[0]


def pool(hidden: torch.Tensor, query_start: np.ndarray, rows: np.ndarray,
         cfg: PoolingConfig) -> torch.Tensor:
    """One float32 vector per request index in `rows` (requests whose whole prompt is in the
    step), [len(rows), hidden]."""
    out = []
    for i in rows.tolist():
        a, b = int(query_start[i]), int(query_start[i + 1])
        if cfg.method == "mean":
            v = hidden[a:b].float().mean(dim=0)
        elif cfg.method == "cls":
            v = hidden[a].float()
        else:
            v = hidden[b - 1].float()
        out.append(v)
    vectors = torch.stack(out) if out else hidden.new_zeros(0, hidden.shape[-1]).float()
    if cfg.normalize:
        vectors = torch.nn.functional.normalize(vectors, p=2, dim=-1)
    return vectors


class DecoderEmbedding(nn.Module):
    """A decoder-only model (Llama / Qwen2 / Qwen3 layers) used as an embedder: its final
    hidden states (after the last norm) pooled; the LM head is not loaded. Reads checkpoints
    saved as `*ForCausalLM` (`model.` prefix) or as the bare `*Model` (no prefix)."""

    def __init__(self, inner: nn.Module, pooling: PoolingConfig) -> None:
        super().__init__()
        self.inner = inner
        self.config = inner.config
        self.pooling = pooling
        del inner.lm_head  # an embedder has no vocabulary logits

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch,
                token_types: torch.Tensor | None = None) -> torch.Tensor:
        return self.inner(input_ids, positions, batch)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """No vocabulary head: the runner's memory profile and kernel warm-up call this."""
        return hidden

    def pool(self, hidden: torch.Tensor, batch: ForwardBatch, rows: np.ndarray) -> torch.Tensor:
        return pool(hidden, batch.query_start, rows, self.pooling)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.inner.named_parameters())
        modules = dict(self.inner.named_modules())
        loaded: set[str] = set()
        for name, tensor in weights:
            if name.startswith("lm_head."):
                continue
            if not name.startswith("model."):
                name = "model." + name
            target = self.inner.load_tensor(name, tensor, params, modules)
            if target is not None:
                loaded.add(target)
        missing = set(params) - loaded
        if missing:
            raise KeyError(f"parameters missing from the checkpoint: {sorted(missing)[:8]}")


class DecoderClassifier(DecoderEmbedding):
    """A decoder with a classification head (HF's `*ForSequenceClassification` for Llama / Qwen2
    / Qwen3): the last token's final hidden state through `score` (a linear map, no bias); the
    pooled vector is the logits, one per label (the server applies sigmoid / softmax, as for a
    BERT cross-encoder). A prompt is whole in its step, so its last row is its last token (HF
    pools the last non-padding token: the same one). With `pooling.head_token_ids` the head is
    built from the checkpoint's LM head instead (an original Qwen3-Reranker: p(yes) =
    sigmoid(logit_yes - logit_no), its softmax over the two)."""

    def __init__(self, inner: nn.Module, num_labels: int, pooling: PoolingConfig) -> None:
        super().__init__(inner, PoolingConfig("last", normalize=False))
        self.head_token_ids, self.two_way = pooling.head_token_ids, pooling.two_way
        self.score = nn.Linear(inner.config.hidden_size, num_labels, bias=False)

    def pool(self, hidden: torch.Tensor, batch: ForwardBatch, rows: np.ndarray) -> torch.Tensor:
        last = torch.as_tensor(batch.query_start[rows + 1] - 1, device=hidden.device)
        return self.score(hidden[last]).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        from_tokens = bool(self.head_token_ids)
        head_source = ("model.embed_tokens.weight", "embed_tokens.weight") \
            if self.config.tie_word_embeddings else ("lm_head.weight",)
        wanted = head_source if from_tokens else ("score.weight",)
        found = False

        def body() -> Iterable[tuple[str, torch.Tensor]]:
            nonlocal found
            for name, tensor in weights:
                if name in wanted:
                    self._fill_head(tensor)
                    found = True
                if name != "score.weight":
                    yield name, tensor

        super().load_weights(body())
        if not found:
            raise KeyError(f"parameters missing from the checkpoint: {list(wanted)[:1]} (the "
                           "classification head of a *ForSequenceClassification model"
                           + (", made from the LM head's rows" if from_tokens else "") + ")")

    def _fill_head(self, tensor: torch.Tensor) -> None:
        """`score.weight` from the checkpoint, or from the vocabulary rows of the head tokens."""
        if self.head_token_ids:
            rows = torch.cat([tensor.narrow(0, i, 1) for i in self.head_token_ids]).float()
            tensor = rows[1:] - rows[:1] if self.two_way else rows
        if tuple(tensor.shape) != tuple(self.score.weight.shape):
            raise ValueError(f"score.weight: checkpoint shape {tuple(tensor.shape)} != "
                             f"{tuple(self.score.weight.shape)} (labels x hidden)")
        with torch.no_grad():
            self.score.weight.copy_(tensor.to(self.score.weight.dtype))

