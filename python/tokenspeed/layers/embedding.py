"""Token embedding and LM head (vocab-parallel seam: each rank would own a vocab range)."""

from __future__ import annotations

import torch
from torch import nn

from tokenspeed.layers.linear import linear


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__()
        if tp_size != 1:
            raise NotImplementedError("vocab-parallel embedding is not implemented yet")
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size), requires_grad=False)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: int = 0) -> None:
        if param.shape != loaded.shape:
            raise ValueError(f"embedding: checkpoint shape {tuple(loaded.shape)} != "
                             f"parameter shape {tuple(param.shape)}")
        with torch.no_grad():
            param.copy_(loaded.to(param.dtype))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return nn.functional.embedding(input_ids, self.weight)


class LMHead(VocabEmbedding):
    """Projects hidden states to logits; may share its weight with the embedding (tied)."""

    def tie(self, embedding: VocabEmbedding) -> None:
        self.weight = embedding.weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        # With vocab parallelism: all-gather the per-rank logits here.
        return linear(hidden, self.weight).float()
