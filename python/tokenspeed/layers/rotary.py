"""Rotary position embedding (neox / HF rotate_half layout) with default, linear and llama3 scaling."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any]) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2], float32, as transformers computes them."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = scaling.get("rope_type", "default")
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    raise NotImplementedError(f"rope_type {kind!r} is not supported (default, linear, llama3)")


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    factor = float(scaling["factor"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Applies RoPE to q [T, Hq, D] and k [T, Hk, D] at the given positions [T]."""

    def __init__(self, head_dim: int, max_positions: int, theta: float,
                 scaling: dict[str, Any] | None = None) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, theta, scaling or {})
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos: torch.Tensor
        self.sin: torch.Tensor
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)
        self.head_dim = head_dim
        self._cos_sin: torch.Tensor | None = None  # [max_positions, D] cos | sin halves (CUDA)

    @staticmethod
    def _rotate_half(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)

    def cos_sin_cache(self) -> torch.Tensor:
        """The same frequencies in the layout of tokenspeed_kernels.rotary_embedding."""
        if self._cos_sin is None or self._cos_sin.device != self.cos.device:
            half = self.head_dim // 2
            self._cos_sin = torch.cat([self.cos[:, :half], self.sin[:, :half]], dim=-1).contiguous()
        return self._cos_sin

    def forward(self, positions: torch.Tensor, q: torch.Tensor,
                k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """On CUDA q and k are rotated in place (they may be views into a fused qkv tensor)."""
        if q.is_cuda:
            from tokenspeed_kernels import rotary_embedding

            rotary_embedding(positions, q, k, self.cos_sin_cache(), self.head_dim, is_neox=True)
            return q, k
        cos = self.cos[positions].to(q.dtype).unsqueeze(1)
        sin = self.sin[positions].to(q.dtype).unsqueeze(1)
        return (q * cos + self._rotate_half(q) * sin,
                k * cos + self._rotate_half(k) * sin)


@dataclass
class Rope:
    """RoPE at `positions`, handed to the attention layer so that a backend can fuse it with
    the KV-cache write (AttentionBackend.fuses_rope); `apply` is the unfused fallback."""

    rotary: RotaryEmbedding
    positions: torch.Tensor  # [T]

    def apply(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rotary(self.positions, q, k)

    def cos_sin_cache(self) -> torch.Tensor:
        return self.rotary.cos_sin_cache()
