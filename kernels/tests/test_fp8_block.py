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


def _ref_block_moe(x: torch.Tensor, w13: torch.Tensor, s13: torch.Tensor, w2: torch.Tensor,
                   s2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Per expert: its tokens' activations rounded per 128-group, both GEMMs on dequantised
    operands in fp32 (the intermediate rounded the same way before the down GEMM)."""
    out = torch.zeros(x.shape, dtype=torch.float32)
    inter = w13.shape[1] // 2

    def w8a8(a: torch.Tensor, w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        return ref_w8a8_block_matmul(*ref_per_token_group_quant_fp8(a), w, s, BLOCK, torch.float32)

    for e in range(w13.shape[0]):
        tok, slot = torch.nonzero(ids == e, as_tuple=True)
        if tok.numel():
            h = w8a8(x[tok], w13[e], s13[e])
            h = torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]
            out.index_add_(0, tok, w8a8(h, w2[e], s2[e]) * weights[tok, slot, None])
    return out


@pytest.mark.parametrize("tokens,hidden,inter,experts,top_k", [
    (1, 100, 128, 8, 2), (5, 192, 128, 8, 2), (17, 256, 256, 4, 1)])
def test_fused_moe_with_block_scales_matches_reference(tokens: int, hidden: int, inter: int,
                                                        experts: int, top_k: int, device: str) -> None:
    from tokenspeed_kernels.moe import fused_moe, moe_route

    gen = torch.Generator().manual_seed(tokens + hidden)
    x = torch.randn(tokens, hidden, generator=gen)
    w13, s13, w2, s2 = [], [], [], []
    for _ in range(experts):  # tiles x1/8 .. x8 apart: a scale on the wrong tile shows
        for ws, ss, shape in ((w13, s13, (2 * inter, hidden)), (w2, s2, (hidden, inter))):
            tiles = 2.0 ** torch.randint(-3, 4, (-(-shape[0] // 128), -(-shape[1] // 128)), generator=gen)
            full = tiles.repeat_interleave(128, 0)[: shape[0]].repeat_interleave(128, 1)[:, : shape[1]]
            q, s = quantize_weight_blocks(torch.randn(*shape, generator=gen) * full / shape[1] ** 0.5)
            ws.append(q)
            ss.append(s)
    w13, s13, w2, s2 = (torch.stack(t) for t in (w13, s13, w2, s2))
    weights, ids = moe_route(torch.randn(tokens, experts, generator=gen), top_k, True)
    ref = _ref_block_moe(x, w13, s13, w2, s2, weights, ids)
    dev = [t.to(device) for t in (x, w13, w2, weights, ids, s13, s2)]
    out = fused_moe(*dev[:5], w13_scale=dev[5], w2_scale=dev[6], block=BLOCK)
    assert out.shape == x.shape and rel_err(out.cpu(), ref) < BLOCK_MATMUL_TOL * 10
