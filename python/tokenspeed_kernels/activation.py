"""Gated activations: `gated_act` (a jit function, also the fused MoE GEMM's epilogue) and the
SiLU-and-mul (SwiGLU gate) Triton kernel: out = silu(x[:, :I]) * x[:, I:]."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

ACTIVATIONS = ("silu", "swiglu_oai")  # gated_act's ACT values, by index


@triton.jit
def gated_act(g, u, ACT: tl.constexpr, alpha, limit):
    """fp32 gate g and up u -> ACT 0 (silu): silu(g) * u; ACT 1 (swiglu_oai, GPT-OSS): g clamped
    above at `limit`, u to [-limit, limit], then (u + 1) * g * sigmoid(alpha * g)."""
    if ACT == 1:
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
        return (u + 1.0) * (g / (1.0 + tl.exp(-alpha * g)))
    else:
        return g / (1.0 + tl.exp(-g)) * u


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,
    out_ptr,
    stride_x,
    stride_o,
    inter,
    BLOCK: tl.constexpr,
):
    """One program = one row x BLOCK columns of the output."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    g = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * stride_x + inter + offs, mask=mask, other=0.0).to(tl.float32)
    y = gated_act(g, u, 0, 1.0, 0.0)
    tl.store(out_ptr + row * stride_o + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x: [..., 2*I] (gate then up) -> [..., I] in x.dtype."""
    inter = x.shape[-1] // 2
    assert x.stride(-1) == 1
    if out is None:
        out = torch.empty((*x.shape[:-1], inter), dtype=x.dtype, device=x.device)
    x2 = x.reshape(-1, x.shape[-1])
    o2 = out.view(-1, inter)
    rows = x2.shape[0]
    if rows == 0:
        return out
    block = min(1024, triton.next_power_of_2(inter))
    _silu_and_mul_kernel[(rows, triton.cdiv(inter, block))](
        x2, o2, x2.stride(0), o2.stride(0), inter, BLOCK=block, num_warps=4
    )
    return out
