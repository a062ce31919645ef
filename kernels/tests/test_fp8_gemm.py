"""FP8 linear kernels: per-token activation quantisation (vs torch, and its round-trip error
bound), the Triton W8A8 matmul and the FP8-weight GEMV (skinny_linear(weight_scale=)) against
dequantise-then-matmul fp32 references."""

from __future__ import annotations

import pytest
import torch

from helpers import TOL, rel_err
from tokenspeed_kernels import fp8_matmul, per_token_quant_fp8, skinny_linear
from tokenspeed_kernels.fp8_gemm import ref_per_token_quant_fp8
from tokenspeed_kernels.gemv import GemvConfig

E4M3 = torch.float8_e4m3fn
# fp32-output bound of the W8A8 matmul. The interpreter sums exactly in fp32. Hopper's fp8 tensor
# cores add each wgmma's 32 products with ~14 significant bits (run P measured 2e-5..2e-4 with
# Triton's default, which also keeps the running sum at that precision); the kernel promotes every
# 32 elements, so what remains is the per-instruction rounding. A real bug (mask, scale, layout) is
# off by >= 1e-2.
MATMUL_FP32_TOL = 3e-4 if torch.cuda.is_available() else 1e-5


def _per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-row fp8 weights and scales (the layout the runtime keeps)."""
    scale = w.float().abs().amax(dim=1).clamp_min(1e-12) / 448.0
    return (w.float() / scale[:, None]).clamp(-448, 448).to(E4M3), scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,k", [(1, 64), (5, 300), (3, 5000), (2, 14336), (2, 16385)])  # one pass; two
def test_per_token_quant(dtype: torch.dtype, m: int, k: int, device: str) -> None:
    gen = torch.Generator().manual_seed(m + k)
    x = torch.randn(m, k, generator=gen) * torch.logspace(-3, 3, m)[:, None]  # rows of any size
    x[0, :3] = 0.0
    x = x.to(dtype)
    q, s = per_token_quant_fp8(x.to(device))
    rq, rs = ref_per_token_quant_fp8(x)
    torch.testing.assert_close(s.cpu(), rs, rtol=1e-6, atol=0)
    assert torch.equal(q.cpu().view(torch.uint8), rq.view(torch.uint8))
    # Round trip: 3 mantissa bits -> relative error <= 2^-4 (subnormals: half a step of 2^-9).
    err = (q.cpu().float() * rs[:, None] - x.float()).abs()
    assert (err <= torch.maximum(x.float().abs() * 2**-4, rs[:, None] * 2**-10) * 1.0001).all()
    assert q.float().abs().amax(dim=1).min() == 448.0  # each row's amax maps to the max


@pytest.mark.parametrize("m,n,k", [(1, 40, 64), (37, 70, 100), (64, 33, 257)])
@pytest.mark.parametrize("bias", [False, True])
def test_fp8_matmul_matches_dequantised_reference(m: int, n: int, k: int, bias: bool, device: str) -> None:
    gen = torch.Generator().manual_seed(m * n + k)
    a, a_s = ref_per_token_quant_fp8(torch.randn(m, k, generator=gen))
    b, b_s = _per_channel(torch.randn(n, k, generator=gen) * 0.05)
    bvec = torch.randn(n, generator=gen) if bias else None
    ref = (a.float() * a_s[:, None]) @ (b.float() * b_s[:, None]).T
    if bvec is not None:
        ref += bvec
    dev = [t.to(device) if t is not None else None for t in (a, a_s, b, b_s, bvec)]
    out = fp8_matmul(dev[0], dev[1], dev[2], dev[3], torch.float32, bias=dev[4])
    assert out.shape == (m, n) and rel_err(out.cpu(), ref) < MATMUL_FP32_TOL
    out16 = fp8_matmul(*dev[:4], torch.bfloat16, bias=dev[4])
    assert out16.dtype == torch.bfloat16 and rel_err(out16.cpu(), ref) < TOL[torch.bfloat16]


@pytest.mark.gpu
def test_fp8_matmul_long_k_as_accurate_as_cublas() -> None:
    """Long K (down_proj's 14336): the promoted partial sums keep the error at cuBLAS's level,
    where Hopper's unpromoted accumulation drifts. Realistic magnitudes: activations O(1),
    weights ~ 1/sqrt(K)."""
    m, n, k = 64, 512, 14336
    gen = torch.Generator().manual_seed(5)
    a, a_s = ref_per_token_quant_fp8(torch.randn(m, k, generator=gen))
    b, b_s = _per_channel(torch.randn(n, k, generator=gen) * k**-0.5)
    ref = (a.double() * a_s.double()[:, None]) @ (b.double() * b_s.double()[:, None]).T
    dev = [t.cuda() for t in (a, a_s, b, b_s)]
    ours = rel_err(fp8_matmul(*dev, torch.float32).cpu(), ref)
    cublas = rel_err(torch._scaled_mm(dev[0], dev[2].t(), scale_a=dev[1].view(-1, 1),
                                      scale_b=dev[3].view(1, -1), out_dtype=torch.float32).cpu(), ref)
    unpromoted = rel_err(fp8_matmul(*dev, torch.float32, promote=0).cpu(), ref)
    print(f"rel err vs fp64: triton (promote 32) {ours:.2e}, cuBLAS {cublas:.2e}, unpromoted {unpromoted:.2e}")
    assert ours <= max(2 * cublas, 1e-5) and ours < MATMUL_FP32_TOL


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize("n,k", [(37, 100), (130, 2100), (1000, 96)])  # ragged; long K: split-K; a vocab-like N
def test_fp8_gemv_matches_dequantised_reference(dtype: torch.dtype, m: int, n: int, k: int,
                                                device: str) -> None:  # fmt: skip
    gen = torch.Generator().manual_seed(m + n + k)
    x = torch.randn(m, k, generator=gen).to(dtype)
    w, s = _per_channel(torch.randn(n, k, generator=gen) * 0.05)
    b = torch.randn(n, generator=gen).to(dtype)
    ref = x.float() @ (w.float() * s[:, None]).T + b.float()
    out = skinny_linear(x.to(device), w.to(device), b.to(device), weight_scale=s.to(device))
    assert out.dtype == dtype and rel_err(out.cpu(), ref) < TOL[dtype]


@pytest.mark.parametrize("cfg", [GemvConfig(block_n=4, block_k=32, num_warps=1),
                                 GemvConfig(block_n=4, block_k=64, num_warps=2, reduce_once=True, split_k=2),
                                 GemvConfig(block_n=16, block_k=32, use_dot=True, split_k=3),
                                 GemvConfig(block_n=2, block_k=64, num_warps=1, pdl=True),
                                 GemvConfig(block_n=4, block_k=64, num_warps=2, split_k=2, pdl=True),
                                 GemvConfig(block_n=16, block_k=32, use_dot=True, split_k=3, pdl=True),
                                 GemvConfig(block_n=2, block_k=512, num_warps=1, pdl=True),
                                 GemvConfig(block_n=2, block_k=64, num_warps=1, flat=True),
                                 GemvConfig(block_n=4, block_k=64, num_warps=2, reduce_once=True, split_k=2, flat=True),
                                 GemvConfig(block_n=4, block_k=32, num_warps=1, pdl=True, flat=True)],
                         ids=["fma", "fma-reduce-once-split2", "dot-split3", "fma-pdl", "fma-split2-pdl",
                              "dot-split3-pdl", "pdl-off-k-shorter-than-a-step", "flat", "flat-reduce-once-split2",
                              "flat-pdl"])
@pytest.mark.parametrize("m", [1, 5])  # flat applies at M=1 only (ignored at 5)
def test_fp8_gemv_configs(cfg: GemvConfig, m: int, device: str) -> None:
    """Both inner products (the dot path converts fp8 tiles to x's dtype), the fma path's
    reduce-once accumulator, split-K, programmatic dependent launch (its first W tile is
    loaded before the wait: a peeled first K step, per K slice; K shorter than one step runs
    without it) and the flat (2D) fma form of M=1."""
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(m, 333, generator=gen).to(torch.bfloat16)
    w, s = _per_channel(torch.randn(45, 333, generator=gen))
    ref = x.float() @ (w.float() * s[:, None]).T
    out = skinny_linear(x.to(device), w.to(device), weight_scale=s.to(device), config=cfg)
    assert rel_err(out.cpu(), ref) < TOL[torch.bfloat16]


@pytest.mark.gpu
@pytest.mark.parametrize("m,cfg", [
    (1, GemvConfig(block_n=2, block_k=1024, num_warps=1, pdl=True)),
    (1, GemvConfig(block_n=4, block_k=2048, num_warps=2, split_k=2, pdl=True)),
    (4, GemvConfig(block_n=64, block_k=256, num_warps=4, num_stages=4, use_dot=True, split_k=2, pdl=True)),
], ids=["fma", "fma-split2", "dot-split2"])
def test_fp8_gemv_pdl_waits_for_its_producer_in_a_cuda_graph(m: int, cfg: GemvConfig) -> None:
    """Programmatic dependent launch: the GEMV may start while the kernel that writes x is still
    running (a long reduction here), so it must read x only after griddepcontrol.wait. Replayed
    in a CUDA graph on fresh inputs, its output equals the same tile without PDL, bit for bit; a
    GEMV that read x early would see the previous replay's x."""
    from dataclasses import replace

    n, k, r = 4096, 4096, 2048
    gen = torch.Generator().manual_seed(m)
    w, s = (t.cuda() for t in _per_channel(torch.randn(n, k, generator=gen) * k**-0.5))
    big = torch.randn(m * k, r, generator=gen).to(torch.bfloat16).cuda()
    x = torch.empty(m, k, dtype=torch.bfloat16, device="cuda")
    out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")

    def step() -> None:
        torch.sum(big, dim=1, out=x.view(-1))  # the producer: ~m*k*r*2 bytes read, x written last
        skinny_linear(x, w, weight_scale=s, out=out, config=cfg)

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for trial in range(5):
        big.normal_(generator=None)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        want = skinny_linear(x, w, weight_scale=s, config=replace(cfg, pdl=False))
        assert torch.equal(out, want), f"replay {trial}: PDL GEMV differs from the plain launch"
