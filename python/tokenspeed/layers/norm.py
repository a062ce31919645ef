"""RMSNorm, computed in float32 like the HF reference; fused Triton kernels on CUDA."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            from tokenspeed_kernels import rmsnorm

            return rmsnorm(x, self.weight, self.eps)
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)

    def add_forward(self, x: torch.Tensor,
                    residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(rmsnorm(residual + x), residual + x). On CUDA both happen in place in one kernel:
        x and residual are overwritten, so both must be tensors the caller owns."""
        if x.is_cuda and x.is_contiguous() and residual.is_contiguous():
            from tokenspeed_kernels import fused_add_rmsnorm

            fused_add_rmsnorm(x, residual, self.weight, self.eps)
            return x, residual
        residual = residual + x
        return self(residual), residual


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: scale (1 + weight), applied in float32 before the cast back (HF
    Gemma3RMSNorm); the checkpoint's weights are centred on 0."""

    dummy_value = 0.0  # dummy weights: the neutral scale

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)
