"""RMSNorm and fused residual-add + RMSNorm Triton kernels (one program per row, fp32 math)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rmsnorm_kernel(
    x_ptr,
    out_ptr,
    w_ptr,
    stride_x,
    stride_o,
    n_cols,
    eps,
    BLOCK: tl.constexpr,
):
    """out[row] = x[row] * rsqrt(mean(x[row]^2) + eps) * w."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n_cols
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, 0) / n_cols + eps)
    tl.store(out_ptr + row * stride_o + offs, (x * rstd * w).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _fused_add_rmsnorm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    stride_x,
    stride_r,
    n_cols,
    eps,
    BLOCK: tl.constexpr,
):
    """residual[row] += x[row]; x[row] = rmsnorm(residual[row]) * w (norm of the stored residual)."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n_cols
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    r = tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
    r = (r + x).to(res_ptr.dtype.element_ty)
    tl.store(res_ptr + row * stride_r + offs, r, mask=mask)
    r = r.to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(r * r, 0) / n_cols + eps)
    tl.store(x_ptr + row * stride_x + offs, (r * rstd * w).to(x_ptr.dtype.element_ty), mask=mask)


def _launch_params(n_cols: int, elem_size: int) -> tuple[int, int]:
    block = triton.next_power_of_2(n_cols)
    warps = min(16, max(1, block * elem_size // 2048))
    return block, warps


def _rows(t: torch.Tensor) -> torch.Tensor:
    assert t.stride(-1) == 1, "last dim must be contiguous"
    return t.reshape(-1, t.shape[-1])


def rmsnorm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None
) -> torch.Tensor:
    """RMSNorm over the last dim of x [..., N] with weight [N]; returns a new tensor (or fills out)."""
    n_cols = x.shape[-1]
    x2 = _rows(x)
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    o2 = _rows(out)
    if x2.shape[0] == 0:
        return out
    block, warps = _launch_params(n_cols, x.element_size())
    _rmsnorm_kernel[(x2.shape[0],)](x2, o2, weight, x2.stride(0), o2.stride(0), n_cols, eps,
                                     BLOCK=block, num_warps=warps)  # fmt: skip
    return out


def fused_add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """In place: residual += x; x = rmsnorm(residual) * weight (as vLLM's fused_add_rms_norm).

    x and residual: [..., N] with the same shape and a contiguous last dim; rows may be strided.
    """
    assert x.shape == residual.shape
    n_cols = x.shape[-1]
    x2, r2 = _rows(x), _rows(residual)
    assert x2.data_ptr() == x.data_ptr() and r2.data_ptr() == residual.data_ptr()
    if x2.shape[0] == 0:
        return
    block, warps = _launch_params(n_cols, x.element_size())
    _fused_add_rmsnorm_kernel[(x2.shape[0],)](x2, r2, weight, x2.stride(0), r2.stride(0), n_cols, eps,
                                              BLOCK=block, num_warps=warps)  # fmt: skip
