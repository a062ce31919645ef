"""Block-scaled FP8 (DeepSeek-V3's 128x128 weight scales): per-token-group activation quantisation
vs torch (bit-exact, with its round-trip bound) and the Triton W8A8 block matmul vs the
dequantise-both fp32 reference, at M/N/K on and off the 128 grid."""

from __future__ import annotations

import pytest
import torch

from helpers import rel_err
from tokenspeed_kernels.fp8_block import (
    dequantize_block,
    per_token_group_quant_fp8,
    ref_per_token_group_quant_fp8,
    ref_w8a8_block_matmul,
    w8a8_block_matmul,
)

E4M3 = torch.float8_e4m3fn
BLOCK = (128, 128)
# The interpreter sums each K-block exactly in fp32; a GPU's fp8 tensor cores round each wgmma's
# partial sums (see test_fp8_gemm.py's MATMUL_FP32_TOL). A wrong scale index, mask or layout is
# off by >= 1e-2 (test_a_wrong_scale_layout_is_caught).
BLOCK_MATMUL_TOL = 3e-4 if torch.cuda.is_available() else 1e-5


def quantize_weight_blocks(w: torch.Tensor, block: tuple[int, int] = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (fp8 [N, K], scale_inv [ceil(N/bn), ceil(K/bk)]): each tile's amax maps to 448,
    as DeepSeek's checkpoints hold them."""
    bn, bk = block
    n, k = w.shape
    rows, cols = -(-n // bn), -(-k // bk)
    padded = torch.nn.functional.pad(w.float(), (0, cols * bk - k, 0, rows * bn - n))
    scale = padded.view(rows, bn, cols, bk).abs().amax(dim=(1, 3)).clamp_min(1e-12) / 448.0
    full = scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    return (w.float() / full).clamp(-448, 448).to(E4M3), scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,k", [(1, 128), (5, 300), (3, 64), (4, 1000)])
def test_group_quant_matches_torch(dtype: torch.dtype, m: int, k: int, device: str) -> None:
    gen = torch.Generator().manual_seed(m + k)
    x = torch.randn(m, k, generator=gen) * torch.logspace(-3, 3, k)[None, :]  # groups of any size
    x[0, :128] = 0.0  # an all-zero group: the scale floors, q is 0
    x = x.to(dtype)
    q, s = per_token_group_quant_fp8(x.to(device))
    rq, rs = ref_per_token_group_quant_fp8(x)
    assert s.shape == (m, -(-k // 128)) and q.dtype == E4M3
    torch.testing.assert_close(s.cpu(), rs, rtol=1e-6, atol=0)
    assert torch.equal(q.cpu().view(torch.uint8), rq.view(torch.uint8))
    err = (dequantize_block(q.cpu(), rs, (1, 128)) - x.float()).abs()
    bound = torch.maximum(x.float().abs() * 2**-4, rs.repeat_interleave(128, 1)[:, :k] * 2**-10)
    assert (err <= bound * 1.0001).all()


@pytest.mark.parametrize("m,n,k", [(1, 128, 128), (7, 200, 300), (33, 576, 256), (64, 130, 1000)])
def test_block_matmul_matches_dequantised_reference(m: int, n: int, k: int, device: str) -> None:
    gen = torch.Generator().manual_seed(m * n + k)
    a_q, a_s = ref_per_token_group_quant_fp8(torch.randn(m, k, generator=gen))
    w = torch.randn(n, k, generator=gen) * torch.logspace(-2, 0, n)[:, None]  # tiles of any scale
    b_q, b_s = quantize_weight_blocks(w)
    ref = ref_w8a8_block_matmul(a_q, a_s, b_q, b_s, BLOCK, torch.float32)
    dev = [t.to(device) for t in (a_q, a_s, b_q, b_s)]
    out = w8a8_block_matmul(*dev, BLOCK, torch.float32)
    assert out.shape == (m, n) and rel_err(out.cpu(), ref) < BLOCK_MATMUL_TOL
    out16 = w8a8_block_matmul(*dev, BLOCK, torch.bfloat16)
    assert out16.dtype == torch.bfloat16 and rel_err(out16.cpu(), ref) < 1e-2
    # And the whole W8A8 error against the unquantised product is the fp8 rounding of both.
    x = dequantize_block(a_q, a_s, (1, 128))
    assert rel_err(out.cpu(), x @ w.T) < 0.05


def test_a_wrong_scale_layout_is_caught(device: str) -> None:
    """The test above can fail: a weight-scale grid transposed in its tiles changes the result
    far beyond the tolerance."""
    gen = torch.Generator().manual_seed(9)
    a_q, a_s = ref_per_token_group_quant_fp8(torch.randn(9, 256, generator=gen))
    w = torch.randn(256, 256, generator=gen) * torch.tensor([[1.0, 0.01], [0.1, 3.0]]).repeat_interleave(
        128, 0).repeat_interleave(128, 1)
    b_q, b_s = quantize_weight_blocks(w)
    ref = ref_w8a8_block_matmul(a_q, a_s, b_q, b_s, BLOCK, torch.float32)
    dev = [t.to(device) for t in (a_q, a_s, b_q, b_s.T.contiguous())]
    assert rel_err(w8a8_block_matmul(*dev, BLOCK, torch.float32).cpu(), ref) > 1e-2


def test_empty_rows(device: str) -> None:
    b_q, b_s = quantize_weight_blocks(torch.randn(40, 64))
    a_q, a_s = per_token_group_quant_fp8(torch.zeros(0, 64, device=device))
    assert a_s.shape == (0, 1)
    out = w8a8_block_matmul(a_q, a_s, b_q.to(device), b_s.to(device), BLOCK, torch.bfloat16)
    assert out.shape == (0, 40)
