"""rmsnorm, fused_add_rmsnorm and silu_and_mul vs fp32 torch references."""

from __future__ import annotations

import pytest
import torch

from helpers import TOL, rel_err
from tokenspeed_kernels import fused_add_rmsnorm, rmsnorm, silu_and_mul
from tokenspeed_kernels.reference import ref_fused_add_rmsnorm, ref_rmsnorm, ref_silu_and_mul

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _rand(shape: tuple[int, ...], dtype: torch.dtype, device: str, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(shape, generator=gen).to(dtype=dtype, device=device)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", [(1, 64), (7, 576), (3, 1000)])
def test_rmsnorm(dtype: torch.dtype, rows: int, hidden: int, device: str) -> None:
    gen = torch.Generator().manual_seed(rows * hidden)
    x = _rand((rows, hidden), dtype, device, gen)
    w = _rand((hidden,), dtype, device, gen)
    out = torch.full_like(x, float("nan"))
    rmsnorm(x, w, 1e-6, out=out)
    assert rel_err(out, ref_rmsnorm(x, w, 1e-6)) < TOL[dtype]
    assert rmsnorm(x, w, 1e-6).dtype == dtype


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", [(1, 64), (5, 576), (3, 1000)])
def test_fused_add_rmsnorm(dtype: torch.dtype, rows: int, hidden: int, device: str) -> None:
    gen = torch.Generator().manual_seed(rows + hidden)
    x = _rand((rows, hidden), dtype, device, gen)
    res = _rand((rows, hidden), dtype, device, gen)
    w = _rand((hidden,), dtype, device, gen)
    ref_out, ref_res = ref_fused_add_rmsnorm(x, res, w, 1e-5)
    fused_add_rmsnorm(x, res, w, 1e-5)
    assert rel_err(res, ref_res) < TOL[dtype]
    assert rel_err(x, ref_out) < TOL[dtype]


def test_fused_add_rmsnorm_strided_rows(device: str) -> None:
    gen = torch.Generator().manual_seed(0)
    big = _rand((4, 256), torch.float32, device, gen)
    x = big[:, :128]  # row stride 256
    res = _rand((4, 128), torch.float32, device, gen)
    w = _rand((128,), torch.float32, device, gen)
    ref_out, ref_res = ref_fused_add_rmsnorm(x.clone(), res, w, 1e-6)
    tail = big[:, 128:].clone()
    fused_add_rmsnorm(x, res, w, 1e-6)
    assert rel_err(x, ref_out) < 1e-5 and rel_err(res, ref_res) < 1e-6
    assert torch.equal(big[:, 128:], tail)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,inter", [(1, 64), (9, 1536), (2, 1500)])
def test_silu_and_mul(dtype: torch.dtype, rows: int, inter: int, device: str) -> None:
    gen = torch.Generator().manual_seed(rows * inter)
    x = _rand((rows, 2 * inter), dtype, device, gen)
    out = torch.full((rows, inter), float("nan"), dtype=dtype, device=device)
    silu_and_mul(x, out=out)
    assert rel_err(out, ref_silu_and_mul(x)) < TOL[dtype]
    assert silu_and_mul(x).shape == (rows, inter)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_norm_act_gpu_big(dtype: torch.dtype, device: str) -> None:
    gen = torch.Generator().manual_seed(1)
    x = _rand((8192, 4096), dtype, device, gen)
    res = _rand((8192, 4096), dtype, device, gen)
    w = _rand((4096,), dtype, device, gen)
    assert rel_err(rmsnorm(x, w, 1e-5), ref_rmsnorm(x, w, 1e-5)) < TOL[dtype]
    ref_out, ref_res = ref_fused_add_rmsnorm(x, res, w, 1e-5)
    fused_add_rmsnorm(x, res, w, 1e-5)
    assert rel_err(x, ref_out) < TOL[dtype] and rel_err(res, ref_res) < TOL[dtype]
    y = _rand((4097, 2 * 14336), dtype, device, gen)
    assert rel_err(silu_and_mul(y), ref_silu_and_mul(y)) < TOL[dtype]
