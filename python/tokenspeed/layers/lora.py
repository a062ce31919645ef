"""LoRA on a linear layer, for a batch that mixes adapters: y = base(x) + (x A_s^T) (scale B_s)^T
for each row, s the row's adapter slot in the layer's weight pool (-1: the base model, no delta).

One `LoraWeights` per adapted linear layer holds the pool: A [slots, nsub*R, in] and B [slots,
out, R], R the largest rank (--max-lora-rank; smaller adapters are zero-padded, which adds
nothing), nsub the fused sub-projections (q/k/v, gate/up: sub i reads rank block i of x A^T
and writes its own output columns). The adapter's scaling is folded into B when it is loaded.
Under tensor parallelism a column-parallel layer holds all of A and its rows of B, a
row-parallel one its columns of A and all of B, so the delta is sharded as the base output
is (a row-parallel delta is a partial sum, added before the all-reduce).

Where the base weight allows it (same dtype as the adapters, not FP8, the pool's A rows at
most STACK_MAX_FRACTION of the base rows and STACK_MAX_BYTES), A lives *under* the base
weight in one stacked tensor [W; A_0; ..; A_{S-1}] (the base weight parameter is a view of its
first rows): the per-token path (CUDA graphs) then runs one GEMM for the base output and every
slot's x A^T, and one merge kernel per layer (`bgmv_merge`) instead of a shrink and an expand
launch. Loading an adapter writes its A into those rows as before (`self.a` is a view of them).

All layers share one `LoraBatch`, which the model runner fills before each forward: the
per-token slots (a fixed-size device buffer, so CUDA graphs replay it) and, for eager steps,
the adapter segments. On CUDA the Triton kernels of `tokenspeed_kernels.lora` run; elsewhere
`lora_reference`, the segmented gather matmul the kernels are tested against.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class LoraBatch:
    """This step's adapters, as every LoRA layer reads them.

    token_slot: int32 [capacity] on the device, the pool slot of each token (-1: base; rows past
    the step's tokens too). `active`: some token uses an adapter (else layers skip LoRA).
    `per_token`: run the per-token kernels on `token_slot` (CUDA graphs). Otherwise the host
    segments (start, length, slot) of the adapter rows, and their device copies, drive the
    segment kernels (CUDA) or the reference (CPU)."""

    token_slot: torch.Tensor
    active: bool = False
    per_token: bool = False
    segments: np.ndarray = field(default_factory=lambda: np.zeros((0, 3), np.int32))
    segments_dev: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    max_len: int = 0  # the longest segment (the segment kernels' grid), once per step
    kernels: bool = False  # run the Triton kernels off CUDA too (tests, TRITON_INTERPRET=1)

    def set_segments(self, segments: np.ndarray) -> None:
        """Adapter segments (rows of start, length, slot; slot >= 0) of an eager step."""
        self.segments = segments
        self.active = len(segments) > 0
        self.per_token = False
        self.max_len = int(segments[:, 1].max()) if self.active else 0
        if self.active and (self.token_slot.is_cuda or self.kernels):
            from tokenspeed.layers.host_copy import to_device_int64

            start, length, slot = to_device_int64(list(segments.T), self.token_slot.device)
            self.segments_dev = (start, length, slot)


# The stacked GEMM is used when the pool's A rows (slots x nsub x rank) add at most this
# fraction of the base weight's rows (Llama-3.1-8B, 8 slots of rank 16: 6% on qkv_proj), which
# bounds the extra work of compute-bound (extend graph) steps, and at most STACK_MAX_BYTES:
# a batch-1 decode reads every slot's A, used or not, and the launch plus shrink it saves are
# worth a few us of weight streaming (~16 MiB at 4 TB/s; Llama-3.1-8B, 8 slots of rank 64:
# 15 MiB on down_proj). Estimates: kernels/bench/bench_lora.py --rank/--slots measures both.
STACK_MAX_FRACTION = 0.5
STACK_MAX_BYTES = 16 << 20


class LoraWeights:
    """The adapter pool of one linear layer (not an nn.Module: checkpoint loading and
    `named_parameters` never see it)."""

    def __init__(self, batch: LoraBatch, in_features: int, sub_sizes: list[int], rank: int,
                 slots: int, dtype: torch.dtype, device: torch.device) -> None:
        self.batch = batch
        self.sub_sizes = list(sub_sizes)
        self.sub_offsets = tuple(np.cumsum(self.sub_sizes[:-1]).tolist())
        self.rank = rank
        self.a = torch.zeros(slots, len(sub_sizes) * rank, in_features, dtype=dtype, device=device)
        self.b = torch.zeros(slots, sum(sub_sizes), rank, dtype=dtype, device=device)
        # [W; A_0; ..] and its bias [b; 0..] when stacked (`stack_base`), else None.
        self.stacked: torch.Tensor | None = None
        self.stacked_bias: torch.Tensor | None = None

    def stack_base(self, weight: torch.Tensor, bias: torch.Tensor | None,
                   quantized: bool) -> bool:
        """Move the base weight (and bias) into one tensor with the pool's A under it, the
        parameters becoming views of it, when the stacked GEMM can serve this layer."""
        slots, n, k = self.a.shape
        out = weight.shape[0]
        if (quantized or weight.dtype != self.a.dtype or weight.device != self.a.device
                or tuple(weight.shape) != (out, k) or slots * n > STACK_MAX_FRACTION * out
                or slots * n * k * weight.element_size() > STACK_MAX_BYTES):
            return False
        stacked = torch.empty(out + slots * n, k, dtype=weight.dtype, device=weight.device)
        stacked[:out].copy_(weight.data)
        stacked[out:].copy_(self.a.reshape(slots * n, k))
        weight.data = stacked[:out]
        self.a = stacked[out:].view(slots, n, k)
        if bias is not None:
            self.stacked_bias = torch.zeros(out + slots * n, dtype=bias.dtype, device=bias.device)
            self.stacked_bias[:out].copy_(bias.data)
            bias.data = self.stacked_bias[:out]
        self.stacked = stacked
        return True

    def clear(self, slot: int) -> None:
        self.a[slot].zero_()
        self.b[slot].zero_()

    def set_sub(self, slot: int, sub: int, a: torch.Tensor, b: torch.Tensor) -> None:
        """Sub-projection `sub` of the adapter in `slot`: a [r, in] (this rank's columns),
        b [out_sub, r] (this rank's rows), already scaled; r <= the pool's rank."""
        r = a.shape[0]
        if r > self.rank:
            raise ValueError(f"adapter rank {r} > the pool's rank {self.rank} (--max-lora-rank)")
        off = sum(self.sub_sizes[:sub])
        self.a[slot, sub * self.rank:sub * self.rank + r].copy_(a)
        self.b[slot, off:off + self.sub_sizes[sub], :r].copy_(b)

    def stacked_step(self, x: torch.Tensor) -> bool:
        """Whether this step runs the stacked GEMM (`merge`): per-token steps (CUDA graphs)."""
        batch = self.batch
        return (self.stacked is not None and batch.per_token and batch.active
                and x.shape[0] > 0 and (x.is_cuda or batch.kernels))

    def merge(self, out: torch.Tensor) -> torch.Tensor:
        """The stacked GEMM's output [T, OUT + slots*N] -> base + LoRA delta [T, OUT]."""
        from tokenspeed_kernels.lora import bgmv_merge

        return bgmv_merge(out, self.b, self.batch.token_slot, self.sub_offsets, self.rank)

    def add_to(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y + this step's LoRA delta (in place when y is written by a kernel)."""
        batch = self.batch
        if not batch.active or x.shape[0] == 0:
            return y
        if not x.is_cuda and not batch.kernels:
            return lora_reference(x, self.a, self.b, batch.segments, self.sub_sizes, self.rank, y)
        from tokenspeed_kernels.lora import bgmv_expand, bgmv_shrink, sgmv_expand, sgmv_shrink

        if batch.per_token or batch.segments_dev is None:
            slots = batch.token_slot
            partials = bgmv_shrink(x, self.a, slots)
            return bgmv_expand(partials, self.b, slots, y, self.sub_offsets, self.rank)
        xa = torch.empty(x.shape[0], self.a.shape[1], dtype=x.dtype, device=x.device)
        start, length, slot = batch.segments_dev
        sgmv_shrink(x, self.a, start, length, slot, batch.max_len, xa)
        return sgmv_expand(xa, self.b, start, length, slot, batch.max_len, y,
                           tuple(self.sub_sizes), self.rank)


def lora_reference(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, segments: np.ndarray,
                   sub_sizes: list[int], rank: int, y: torch.Tensor) -> torch.Tensor:
    """The segmented gather matmul in plain torch: for each segment (start, length, slot) of
    adapter rows, y[rows, cols of sub i] += (x[rows] A_slot^T)[:, rank block i] B_slot,i^T."""
    for start, length, slot in segments.tolist():
        rows = slice(start, start + length)
        xa = x[rows] @ a[slot].T
        col = 0
        for i, size in enumerate(sub_sizes):
            y[rows, col:col + size] += xa[:, i * rank:(i + 1) * rank] @ b[slot, col:col + size].T
            col += size
    return y


def token_segments(token_slot: np.ndarray) -> np.ndarray:
    """Runs of equal slots >= 0 in a per-token slot array: rows of (start, length, slot)."""
    if len(token_slot) == 0:
        return np.zeros((0, 3), np.int32)
    change = np.flatnonzero(np.diff(token_slot)) + 1
    starts = np.concatenate([[0], change])
    lengths = np.diff(np.concatenate([starts, [len(token_slot)]]))
    slots = token_slot[starts]
    keep = slots >= 0
    return np.stack([starts[keep], lengths[keep], slots[keep]], axis=1).astype(np.int32)
