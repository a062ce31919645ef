"""Activations of gated MLPs."""

from __future__ import annotations

import torch
from torch import nn


class SiluAndMul(nn.Module):
    """silu(gate) * up on a fused [.., 2 * d] gate_up tensor (one Triton kernel on CUDA)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            from tokenspeed_kernels import silu_and_mul

            return silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return nn.functional.silu(gate) * up


class GeluTanhAndMul(nn.Module):
    """gelu_tanh(gate) * up on a fused gate_up tensor (Gemma's `gelu_pytorch_tanh`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return nn.functional.gelu(gate, approximate="tanh") * up
