"""Rotary position embedding (neox / HF rotate_half layout) with default, linear, llama3, YaRN and
LongRoPE scaling, over the first `rotary_dim` features of each head (partial rotary: Phi-4-mini)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any]) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2], float32, as transformers computes them (LongRoPE:
    the short factors'; `rope_tables` also has the long ones)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = scaling.get("rope_type", "default")
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    if kind == "yarn":
        return _yarn(head_dim, theta, scaling)[0]
    if kind == "longrope":
        return inv_freq / torch.tensor(scaling["short_factor"], dtype=torch.float32)
    raise NotImplementedError(f"rope_type {kind!r} is not supported "
                              "(default, linear, llama3, yarn, longrope)")


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


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(dim: int, theta: float, scaling: dict[str, Any]) -> tuple[torch.Tensor, float]:
    """YaRN (transformers' `_compute_yarn_parameters`): inverse frequencies blended between
    interpolated and extrapolated by a ramp over the dimensions, and the cos/sin scale."""
    factor = float(scaling["factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention_factor = (_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)
                            if mscale and mscale_all else _yarn_mscale(factor))
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


def rope_tables(rotary_dim: int, max_positions: int, theta: float, scaling: dict[str, Any],
                max_position_embeddings: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) [max_positions, rotary_dim] in float32, the YaRN / LongRoPE cos/sin scale
    applied.

    LongRoPE: one factor set for every position, chosen by the context this server admits
    (`max_positions`): the long factors when it exceeds `original_max_position_embeddings`, else
    the short ones. transformers picks by each sequence's length and, when a generation crosses
    the original window, recomputes its whole cache with the long factors; here a key's rotation
    never changes after it is cached (nor between requests sharing a prefix). So: the same as
    transformers for every sequence longer than the original window on a long-context server,
    and for every sequence on a server whose context fits the original window."""
    kind = scaling.get("rope_type", "default")
    positions = torch.arange(max_positions, dtype=torch.float32)[:, None]
    scale = 1.0
    if kind == "yarn":
        inv_freq, scale = _yarn(rotary_dim, theta, scaling)
    elif kind == "longrope":
        old_len = int(scaling["original_max_position_embeddings"])
        factor = scaling.get("factor") or (max_position_embeddings or old_len) / old_len
        scale = scaling.get("attention_factor") or (
            1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(old_len)))
        which = "long_factor" if max_positions > old_len else "short_factor"
        inv_freq = (rope_inv_freq(rotary_dim, theta, {})
                    / torch.tensor(scaling[which], dtype=torch.float32))
    else:
        inv_freq = rope_inv_freq(rotary_dim, theta, scaling)
    freqs = positions * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * scale, emb.sin() * scale


class RotaryEmbedding(nn.Module):
    """Applies RoPE to q [T, Hq, D] and k [T, Hk, D] at the given positions [T]; with
    `rotary_dim` < D only the first rotary_dim features of each head rotate."""

    def __init__(self, head_dim: int, max_positions: int, theta: float,
                 scaling: dict[str, Any] | None = None, rotary_dim: int | None = None,
                 max_position_embeddings: int | None = None) -> None:
        super().__init__()
        self.rotary_dim = rotary_dim or head_dim
        cos, sin = rope_tables(self.rotary_dim, max_positions, theta, scaling or {},
                               max_position_embeddings)
        self.cos: torch.Tensor
        self.sin: torch.Tensor
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self.head_dim = head_dim
        self._cos_sin: torch.Tensor | None = None  # [max_positions, R] cos | sin halves (CUDA)

    @staticmethod
    def _rotate_half(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)

    def cos_sin_cache(self) -> torch.Tensor:
        """The same frequencies in the layout of tokenspeed_kernels.rotary_embedding."""
        if self._cos_sin is None or self._cos_sin.device != self.cos.device:
            half = self.rotary_dim // 2
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
        r = self.rotary_dim

        def rotate(x: torch.Tensor) -> torch.Tensor:
            if r == x.shape[-1]:
                return x * cos + self._rotate_half(x) * sin
            head = x[..., :r]
            return torch.cat((head * cos + self._rotate_half(head) * sin, x[..., r:]), dim=-1)

        return rotate(q), rotate(k)


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
