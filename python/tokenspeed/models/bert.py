"""BERT encoders for `--is-embedding`: `BertModel` (sentence-transformers embedders, e.g.
all-MiniLM-L6-v2) and `BertForSequenceClassification` (cross-encoders: rerank, score,
classify). As HF: absolute position and token-type embeddings, post-LayerNorm layers, GELU.

Attention is bidirectional over each request's own tokens and keeps no KV cache: a pooling
request's whole prompt is in the step (the scheduler never chunks it), so each request is one
`scaled_dot_product_attention` call. One rank only (no tensor parallelism).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from tokenspeed.layers.attention import ForwardBatch
from tokenspeed.models.config import ModelConfig
from tokenspeed.models.pooling import PoolingConfig, classifier_labels, pool

_ACTIVATIONS = {"gelu": lambda x: F.gelu(x), "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
                "relu": F.relu}


def _eps(config: ModelConfig) -> float:
    return float(config.raw.get("layer_norm_eps", 1e-12))


class BertEmbeddings(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(c.vocab_size, c.hidden_size)
        self.position_embeddings = nn.Embedding(c.max_position_embeddings, c.hidden_size)
        self.token_type_embeddings = nn.Embedding(int(c.raw.get("type_vocab_size", 2)),
                                                  c.hidden_size)
        self.LayerNorm = nn.LayerNorm(c.hidden_size, eps=_eps(c))

    def forward(self, ids: torch.Tensor, positions: torch.Tensor,
                token_types: torch.Tensor) -> torch.Tensor:
        x = (self.word_embeddings(ids) + self.position_embeddings(positions)
             + self.token_type_embeddings(token_types))
        return self.LayerNorm(x)


class BertLayer(nn.Module):
    """Self-attention (q/k/v, output dense + residual + LayerNorm), then the MLP (intermediate
    dense + activation, output dense + residual + LayerNorm); HF's module names flattened."""

    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        h = c.hidden_size
        self.num_heads, self.head_dim = c.num_attention_heads, h // c.num_attention_heads
        self.query, self.key, self.value = nn.Linear(h, h), nn.Linear(h, h), nn.Linear(h, h)
        self.attn_out = nn.Linear(h, h)
        self.attn_norm = nn.LayerNorm(h, eps=_eps(c))
        self.intermediate = nn.Linear(h, c.intermediate_size)
        self.out = nn.Linear(c.intermediate_size, h)
        self.out_norm = nn.LayerNorm(h, eps=_eps(c))
        if c.hidden_act not in _ACTIVATIONS:
            raise NotImplementedError(f"BERT hidden_act {c.hidden_act!r} (supported: "
                                      f"{sorted(_ACTIVATIONS)})")
        self.act = _ACTIVATIONS[c.hidden_act]

    def forward(self, x: torch.Tensor, query_start: np.ndarray) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = (p(x).view(t, self.num_heads, self.head_dim).transpose(0, 1)
                   for p in (self.query, self.key, self.value))
        attn = torch.empty_like(q)
        for a, b in zip(query_start[:-1].tolist(), query_start[1:].tolist()):
            attn[:, a:b] = F.scaled_dot_product_attention(q[:, a:b], k[:, a:b], v[:, a:b])
        h = self.attn_norm(x + self.attn_out(attn.transpose(0, 1).reshape(t, -1)))
        return self.out_norm(h + self.out(self.act(self.intermediate(h))))


# HF name fragment → ours (BertLayer flattens HF's attention.self / attention.output / ...).
_RENAMES = [(".attention.self.", "."), (".attention.output.dense.", ".attn_out."),
            (".attention.output.LayerNorm.", ".attn_norm."),
            (".intermediate.dense.", ".intermediate."), (".output.dense.", ".out."),
            (".output.LayerNorm.", ".out_norm.")]


class BertEncoder(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        if c.raw.get("position_embedding_type", "absolute") != "absolute":
            raise NotImplementedError("BERT position_embedding_type "
                                      f"{c.raw['position_embedding_type']!r} (only absolute)")
        self.embeddings = BertEmbeddings(c)
        self.layer = nn.ModuleList(BertLayer(c) for _ in range(c.num_hidden_layers))

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch,
                token_types: torch.Tensor | None) -> torch.Tensor:
        if token_types is None:
            token_types = torch.zeros_like(ids)
        x = self.embeddings(ids, positions, token_types)
        for layer in self.layer:
            x = layer(x, batch.query_start)
        return x


class _BertBase(nn.Module):
    """What both BERT heads share: the encoder, the runner's hooks, HF-name loading."""

    PREFIX = ""  # the HF checkpoint's prefix of the encoder's tensors

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.bert = BertEncoder(config)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch,
                token_types: torch.Tensor | None = None) -> torch.Tensor:
        return self.bert(input_ids, positions, batch, token_types)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """No vocabulary head: the runner's memory profile and kernel warm-up call this."""
        return hidden

    def hf_name(self, name: str) -> str | None:
        """Our parameter name for an HF tensor name (None: not used)."""
        if name.endswith("position_ids"):
            return None
        name = name.removeprefix("bert.")
        if name.startswith(("embeddings.", "encoder.")):
            name = "bert." + name.replace("encoder.layer.", "layer.")
            for hf, ours in _RENAMES:
                name = name.replace(hf, ours)
        return name

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for hf, tensor in weights:
            name = self.hf_name(hf)
            if name is None or name not in params:
                continue  # e.g. BertModel's pooler: sentence-transformers does not use it
            p = params[name]
            if p.shape != tensor.shape:
                raise ValueError(f"{hf}: checkpoint shape {tuple(tensor.shape)} != parameter "
                                 f"shape {tuple(p.shape)}")
            with torch.no_grad():
                p.copy_(tensor.to(p.dtype))
            loaded.add(name)
        missing = set(params) - loaded
        if missing:
            raise KeyError(f"parameters missing from the checkpoint: {sorted(missing)[:8]}")


class BertModel(_BertBase):
    """Embeddings: the encoder's last hidden states pooled (mean for sentence-transformers)."""

    def __init__(self, config: ModelConfig, pooling: PoolingConfig) -> None:
        super().__init__(config)
        self.pooling = pooling

    def pool(self, hidden: torch.Tensor, batch: ForwardBatch, rows: np.ndarray) -> torch.Tensor:
        return pool(hidden, batch.query_start, rows, self.pooling)


class BertForSequenceClassification(_BertBase):
    """A cross-encoder: the [CLS] state through HF's pooler (dense + tanh) and classifier;
    the pooled vector is the logits, one per label (the server applies sigmoid / softmax)."""

    def __init__(self, config: ModelConfig, pooling: PoolingConfig | None = None) -> None:
        super().__init__(config)
        h = config.hidden_size
        self.pooler = nn.Linear(h, h)
        self.classifier = nn.Linear(h, len(classifier_labels(config.raw)))

    def hf_name(self, name: str) -> str | None:
        if name.startswith("bert.pooler.dense."):
            return "pooler." + name.removeprefix("bert.pooler.dense.")
        return super().hf_name(name)

    def pool(self, hidden: torch.Tensor, batch: ForwardBatch, rows: np.ndarray) -> torch.Tensor:
        cls = hidden[torch.as_tensor(batch.query_start[rows], device=hidden.device)]
        return self.classifier(torch.tanh(self.pooler(cls))).float()
