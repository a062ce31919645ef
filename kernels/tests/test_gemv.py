"""skinny_linear (Triton GEMV for small M) vs an fp32 torch reference."""

from __future__ import annotations

import pytest
import torch

from helpers import TOL, rel_err
from tokenspeed_kernels.gemv import GemvConfig, skinny_linear


def _rand(shape: tuple[int, ...], dtype: torch.dtype, device: str, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(shape, generator=gen).to(dtype=dtype, device=device)


def _ref(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    r = x.float() @ w.float().T
    return r + b.float() if b is not None else r


def _poisoned(m: int, n: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    return torch.full((m, n), float("nan"), dtype=dtype, device=device)


# (N, K): ragged ones (not multiples of any block size), SmolLM2-ish ones, a long-K one (split-K path).
SHAPES = [(37, 100), (1000, 576), (64, 1030), (130, 2100)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("n,k", SHAPES)
def test_skinny_linear(dtype: torch.dtype, m: int, n: int, k: int, device: str) -> None:
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    x = _rand((m, k), dtype, device, gen)
    w = _rand((n, k), dtype, device, gen)
    b = _rand((n,), dtype, device, gen)
    out = _poisoned(m, n, dtype, device)
    assert skinny_linear(x, w, b, out=out) is out
    assert rel_err(out, _ref(x, w, b)) < TOL[dtype]
    y = skinny_linear(x, w)
    assert y.shape == (m, n) and y.dtype == dtype
    assert rel_err(y, _ref(x, w, None)) < TOL[dtype]


@pytest.mark.parametrize(
    "cfg",
    [
        GemvConfig(block_n=4, block_k=32, num_warps=1),
        GemvConfig(block_n=16, block_k=64, use_dot=True),
        GemvConfig(block_n=16, block_k=32, use_dot=True, split_k=3),
        GemvConfig(block_n=8, block_k=64, split_k=4),
        GemvConfig(block_n=2, block_k=64, num_warps=1, flat=True),
        GemvConfig(block_n=4, block_k=32, num_warps=1, reduce_once=True, split_k=2, flat=True),
    ],
    ids=["fma", "dot", "dot-split3", "fma-split4", "flat", "flat-reduce-once-split2"],
)
@pytest.mark.parametrize("m", [1, 5])
def test_skinny_linear_configs(cfg: GemvConfig, m: int, device: str) -> None:
    """Both inner products and split-K, on a shape ragged in N and K; bias only in the split path's reduce."""
    gen = torch.Generator().manual_seed(m)
    n, k = 45, 333
    x = _rand((m, k), torch.bfloat16, device, gen)
    w = _rand((n, k), torch.bfloat16, device, gen)
    b = _rand((n,), torch.bfloat16, device, gen)
    out = _poisoned(m, n, torch.bfloat16, device)
    skinny_linear(x, w, b, out=out, config=cfg)
    assert rel_err(out, _ref(x, w, b)) < TOL[torch.bfloat16]


def test_skinny_linear_strided_and_fp16(device: str) -> None:
    """x rows and out rows may be strided (views into wider buffers); fp16 works too."""
    gen = torch.Generator().manual_seed(7)
    dtype = torch.float16
    xbig = _rand((3, 200), dtype, device, gen)
    x = xbig[:, :150]
    w = _rand((70, 150), dtype, device, gen)
    obig = _poisoned(3, 100, dtype, device)
    out = obig[:, 10:80]
    skinny_linear(x, w, out=out)
    assert rel_err(out, _ref(x, w, None)) < TOL[dtype]
    assert obig[:, :10].isnan().all() and obig[:, 80:].isnan().all()


def test_skinny_linear_deterministic(device: str) -> None:
    gen = torch.Generator().manual_seed(3)
    x = _rand((4, 1500), torch.bfloat16, device, gen)
    w = _rand((96, 1500), torch.bfloat16, device, gen)
    a = skinny_linear(x, w)
    assert torch.equal(a, skinny_linear(x, w))


def test_skinny_linear_large_m_falls_back(device: str) -> None:
    gen = torch.Generator().manual_seed(5)
    x = _rand((20, 64), torch.float32, device, gen)
    w = _rand((48, 64), torch.float32, device, gen)
    b = _rand((48,), torch.float32, device, gen)
    out = _poisoned(20, 48, torch.float32, device)
    skinny_linear(x, w, b, out=out)
    assert rel_err(out, _ref(x, w, b)) < TOL[torch.float32]


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 2, 4, 8])
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 14336), (1728, 576), (576, 1536), (49152, 576)])
def test_skinny_linear_gpu_shapes(m: int, n: int, k: int, device: str) -> None:
    """The production shape classes (Llama-3.1-8B, SmolLM2-135M) with the default configs."""
    gen = torch.Generator().manual_seed(n + m)
    x = _rand((m, k), torch.bfloat16, device, gen)
    w = _rand((n, k), torch.bfloat16, device, gen) * k**-0.5
    b = _rand((n,), torch.bfloat16, device, gen)
    out = _poisoned(m, n, torch.bfloat16, device)
    skinny_linear(x, w, b, out=out)
    assert rel_err(out, _ref(x, w, b)) < TOL[torch.bfloat16]


@pytest.mark.gpu
def test_skinny_linear_cuda_graph(device: str) -> None:
    """Captured once, replayed on new x contents: same results as eager."""
    gen = torch.Generator().manual_seed(11)
    x = _rand((2, 4096), torch.bfloat16, device, gen)
    w = _rand((4096, 4096), torch.bfloat16, device, gen) * 4096**-0.5
    out = _poisoned(2, 4096, torch.bfloat16, device)
    skinny_linear(x, w, out=out)  # compile before capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        skinny_linear(x, w, out=out)
    x.copy_(_rand((2, 4096), torch.bfloat16, device, gen))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, skinny_linear(x, w))
