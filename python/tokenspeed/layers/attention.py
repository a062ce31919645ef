"""Attention: the per-step ForwardBatch, the backend interface, and the Attention layer."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from tokenspeed.layers.host_copy import to_device_int64
from tokenspeed.layers.kv_cache import PagedKVCache
from tokenspeed.layers.rotary import Rope


@dataclass
class ForwardBatch:
    """Everything one forward pass needs, built once per step by the model runner.

    Requests are in plan order; request i owns tokens [query_start[i], query_start[i + 1]) of the
    flat token dimension, at positions start_pos[i] ... start_pos[i] + num_tokens[i] - 1.
    """

    input_ids: torch.Tensor  # [T] int64, device
    positions: torch.Tensor  # [T] int64, device
    out_cache_loc: torch.Tensor  # [T] int64, device: flat KV index where each token's K/V go
    slots: np.ndarray  # [B] host
    num_tokens: np.ndarray  # [B] host
    start_pos: np.ndarray  # [B] host
    query_start: np.ndarray  # [B + 1] host, cumulative num_tokens
    kv_cache: PagedKVCache
    backend: AttentionBackend
    # Backend-private metadata, filled by backend.prepare().
    metadata: Any = field(default=None)
    # Device copies (int64) of slots, seq_lens, query_start and start_pos: the model runner
    # stages them with the token inputs in one transfer; `device_arrays` makes them otherwise.
    request_arrays: tuple[torch.Tensor, ...] | None = None
    # Hybrid KV layout: the batch as sliding-window layers see it (their pool, table and
    # backend; worker/swa_layout.py); None: every layer reads this one.
    swa: ForwardBatch | None = None

    @property
    def seq_lens(self) -> np.ndarray:
        return self.start_pos + self.num_tokens

    def device_arrays(self) -> tuple[torch.Tensor, ...]:
        """(slots, seq_lens, query_start, start_pos) on the device, int64."""
        if self.request_arrays is None:
            self.request_arrays = tuple(to_device_int64(
                [self.slots, self.seq_lens, self.query_start, self.start_pos],
                self.input_ids.device))
        return self.request_arrays


def padding_batch(kv_cache: PagedKVCache, backend: AttentionBackend,
                  device: torch.device) -> ForwardBatch:
    """One padding token (id 0, position 0, its K/V at flat index 0 of `kv_cache`, a one-page
    scratch cache), prepared: a data-parallel attention group's share of a lockstep forward
    pass it has no rows for."""
    zero = torch.zeros(1, dtype=torch.int64, device=device)
    batch = ForwardBatch(
        input_ids=zero, positions=zero, out_cache_loc=zero, slots=np.zeros(1, np.int64),
        num_tokens=np.ones(1, np.int64), start_pos=np.zeros(1, np.int64),
        query_start=np.asarray([0, 1], np.int64), kv_cache=kv_cache, backend=backend)
    backend.prepare(batch)
    return batch


class AttentionBackend(ABC):
    """Writes the new K/V into the paged cache and attends causally over each request's context.

    `prepare` runs once per step (host-side metadata); `forward` runs once per layer.
    A backend with `fuses_rope` also takes `rope=` in forward and applies RoPE to q and k
    itself (with the KV write); the others get q and k already rotated.
    """

    name: str = ""
    fuses_rope: bool = False
    supports_sinks: bool = False  # per-head attention sinks (GPT-OSS), see Attention.forward
    # Latent (MLA) layers: one K "head" per token whose first v_head_dim features are V, read
    # from a `v_from_k` cache; the output is v_head_dim wide per query head.
    supports_mla: bool = False

    @abstractmethod
    def prepare(self, batch: ForwardBatch) -> None: ...

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: Attention,
                batch: ForwardBatch) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hk, D] → output [T, Hq * D]."""

    # --- decode CUDA graphs (backends in GRAPH_BACKENDS) -------------------------------------
    # A captured graph reads the backend's metadata from static buffers; before each replay the
    # backend refreshes them from the host's view of the batch, without waiting for the GPU.

    def init_graphs(self, sizes: list[int]) -> None:
        """Allocate what graphs of these batch sizes read (called once, before capture)."""
        raise NotImplementedError(f"attention backend {self.name!r} has no CUDA graph support")

    def graph_metadata(self, bs: int, positions: torch.Tensor) -> Any:
        """The metadata a graph of `bs` decode rows is captured with; `positions` is the
        graph's static [bs] position buffer."""
        raise NotImplementedError

    def prepare_replay(self, bs: int, slots: np.ndarray, positions: np.ndarray,
                       slots_dev: torch.Tensor) -> None:
        """Refresh the graph's metadata for the real rows (host arrays, len <= bs; the rest is
        padding: one token of context, no KV write). `slots_dev`: the [bs] padded slots on the
        device."""
        raise NotImplementedError


class Attention(nn.Module):
    """Parameter-free attention layer: carries head geometry and delegates to the backend.
    `has_sinks`: the model passes per-head sink logits to forward (GPT-OSS): one more score per
    query that joins the softmax's denominator and no value. `v_head_dim` (multi-head latent
    attention, absorbed): V is K's first v_head_dim features (the cache's `v_from_k`), and each
    head's output is that wide."""

    def __init__(self, layer_id: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 scaling: float, sliding_window: int | None = None,
                 has_sinks: bool = False, v_head_dim: int | None = None) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} not a multiple of num_kv_heads {num_kv_heads}")
        self.layer_id = layer_id
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scaling = scaling
        self.sliding_window = sliding_window
        self.has_sinks = has_sinks
        self.v_head_dim = v_head_dim or head_dim
        self.latent = v_head_dim is not None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch,
                rope: Rope | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """rope: RoPE still to apply to q and k (after any q/k norm): fused into the backend's
        KV write where it can, else applied here first. sinks: [num_heads] sink logits."""
        if batch.swa is not None and self.sliding_window is not None:
            batch = batch.swa
        backend = batch.backend
        extra = {} if sinks is None else {"sinks": sinks}
        if rope is None:
            return backend.forward(q, k, v, self, batch, **extra)
        if backend.fuses_rope:
            return backend.forward(q, k, v, self, batch, rope=rope, **extra)  # type: ignore[call-arg]
        q, k = rope.apply(q, k)
        return backend.forward(q, k, v, self, batch, **extra)


def check_layers(backend: AttentionBackend, model: nn.Module) -> None:
    """Fail at start-up on a model whose attention layers need what the backend lacks."""
    if not backend.supports_sinks and any(isinstance(m, Attention) and m.has_sinks
                                          for m in model.modules()):
        raise ValueError(f"attention backend {backend.name!r} has no attention sinks (GPT-OSS) "
                         "yet; use --attention-backend triton or torch_native")
    if not any(isinstance(m, Attention) and m.latent for m in model.modules()):
        return
    if not backend.supports_mla:
        raise ValueError(f"attention backend {backend.name!r} has no multi-head latent attention "
                         "(DeepSeek) yet; use --attention-backend triton or torch_native")
    from tokenspeed.layers import batch_invariant

    if batch_invariant.enabled():  # its kernels assume K and V of one width
        raise ValueError("--enable-deterministic-inference is not supported yet for multi-head "
                         "latent attention models (DeepSeek-V2/V3)")


BACKENDS = ("torch_native", "triton", "flashinfer")
GRAPH_BACKENDS = ("triton", "flashinfer")  # backends whose decode steps CUDA graphs can capture


def resolve_backend_name(name: str | None, device: torch.device) -> str:
    """"auto"/None: triton on CUDA, torch_native elsewhere."""
    if name in (None, "", "auto"):
        return "triton" if device.type == "cuda" else "torch_native"
    return name


def check_backend(name: str, device: torch.device | None = None) -> None:
    """Fail early (before any weight is loaded) on a backend that cannot be built here."""
    if name == "triton" and device is not None and device.type != "cuda":
        from tokenspeed_kernels._utils import interpreting

        if not interpreting():  # compiled kernels given CPU tensors fail at the first step
            raise ValueError(f"attention_backend 'triton' needs a CUDA device (device is "
                             f"{device.type}; use torch_native, or TRITON_INTERPRET=1 for a slow "
                             "CPU run)")
    if name in ("torch_native", "triton"):
        return
    if name == "flashinfer":
        try:
            import flashinfer  # noqa: F401
        except ImportError as e:
            raise ValueError("attention_backend 'flashinfer' needs the flashinfer package "
                             "(pip install flashinfer-python), which is not importable here "
                             f"({e}); use triton or torch_native") from e
        if device is not None and device.type != "cuda":
            raise ValueError(f"attention_backend 'flashinfer' runs on CUDA only, not on {device}; "
                             "use torch_native")
        return
    raise ValueError(f"unknown attention_backend {name!r} (available: {', '.join(BACKENDS)})")
