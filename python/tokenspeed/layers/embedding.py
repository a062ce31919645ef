"""Vocab-parallel token embedding and LM head: rank r owns vocab rows [r * V/tp, (r + 1) * V/tp)
(the vocab padded up to a multiple of tp_size; padded rows are zero and cut from the logits)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tokenspeed.distributed.groups import tp_all_gather, tp_all_reduce
from tokenspeed.layers.linear import linear


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__()
        self.vocab_size, self.tp_rank, self.tp_size = vocab_size, tp_rank, tp_size
        self.rows = -(-vocab_size // tp_size)  # rows per rank
        self.start = tp_rank * self.rows
        self.end = min(self.start + self.rows, vocab_size)  # real (unpadded) rows end here
        self.weight = nn.Parameter(torch.empty(self.rows, hidden_size), requires_grad=False)

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard: int = 0) -> None:
        full_shape = (self.vocab_size, param.shape[1])
        if tuple(loaded.shape) != full_shape:
            raise ValueError(f"embedding: checkpoint shape {tuple(loaded.shape)} != "
                             f"full parameter shape {full_shape}")
        local = loaded.narrow(0, self.start, self.end - self.start) if self.tp_size > 1 else loaded
        with torch.no_grad():
            param.zero_()
            param[: self.end - self.start].copy_(local.to(param.dtype))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return nn.functional.embedding(input_ids, self.weight)
        # Ids outside this rank's rows look up row 0 and are zeroed; the all-reduce sums the one
        # rank that owns each id with zeros from the others (exact).
        local = input_ids - self.start
        mine = (local >= 0) & (local < self.rows)
        out = nn.functional.embedding(torch.where(mine, local, 0), self.weight)
        out = out * mine.unsqueeze(-1).to(out.dtype)
        return tp_all_reduce(out)


class LMHead(VocabEmbedding):
    """Projects hidden states to logits; may share its weight with the embedding (tied).
    FP8 (--lm-head-quantization, layers/quantization/fp8.py): `weight` fp8 with per-row fp32
    `weight_scale`; a tied head then holds its own fp8 copy and the embedding keeps its table."""

    def __init__(self, vocab_size: int, hidden_size: int, tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__(vocab_size, hidden_size, tp_rank, tp_size)
        self.weight_scale: nn.Parameter | None = None  # set by FP8 quantization

    def tie(self, embedding: VocabEmbedding) -> None:
        self.weight = embedding.weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        logits = linear(hidden, self.weight, weight_scale=self.weight_scale)
        if self.tp_size == 1:
            return logits.float()
        # Every rank gets the full logits (and samples; rank 0's tokens are kept, see
        # distributed.sync_sampled_tokens). An all-gather rather than a gather to rank 0: it is
        # what NCCL captures in a CUDA graph, and the sampler state stays the same on all ranks.
        return tp_all_gather(logits, dim=-1)[..., : self.vocab_size].float()
