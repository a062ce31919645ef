"""tokenspeed_kernels.batch_invariant (--enable-deterministic-inference): the matmul agrees with
torch and gives a row the same bits whatever M; the paged attention agrees with the CPU tiled
attention (tokenspeed.layers.batch_invariant.attend) and gives a query token the same bits
whether its prompt is attended whole, in chunks, or token by token (decode)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tokenspeed_kernels.batch_invariant import attention, attention_blocks, matmul


def test_matmul_matches_torch_and_is_invariant_in_m(device: str) -> None:
    g = torch.Generator(device=device).manual_seed(0)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    w = torch.randn(96, 80, device=device, generator=g).to(dtype)
    x = torch.randn(70, 80, device=device, generator=g).to(dtype)
    torch.testing.assert_close(matmul(x, w.t()).float(), x.float() @ w.float().t(),
                               rtol=2e-2, atol=2e-2)
    alone = matmul(x[:1], w.t())[0]
    for m in (1, 2, 65, 70):
        batch = torch.randn(m, 80, device=device, generator=g).to(dtype)
        batch[m - 1] = x[0]
        assert torch.equal(matmul(batch, w.t())[m - 1], alone), m


def _paged(k: torch.Tensor, page_size: int, perm: torch.Tensor) -> torch.Tensor:
    """[L, Hk, D] keys into pages [P, page_size, Hk, D], logical page i at physical perm[i]."""
    pages = k.view(-1, page_size, *k.shape[1:])
    out = torch.zeros_like(pages)
    out[perm] = pages
    return out


@pytest.mark.parametrize("with_sinks", [False, True])
def test_attention_matches_and_is_invariant_to_chunking(with_sinks: bool, device: str) -> None:
    """with_sinks: per-head sink logits (GPT-OSS) in the softmax's denominator."""
    g = torch.Generator(device="cpu").manual_seed(1)
    length, hk, grp, d, page = 80, 2, 3, 32, 4
    q = torch.randn(length, hk * grp, d, generator=g)
    k, v = torch.randn(length, hk, d, generator=g), torch.randn(length, hk, d, generator=g)
    sinks = 2.0 + 1.5 * torch.randn(hk * grp, generator=g) if with_sinks else None
    perm = torch.randperm(length // page, generator=g)
    kc, vc = (_paged(x, page, perm).to(device) for x in (k, v))
    table = perm.to(torch.int32)[None].to(device)
    scale = d ** -0.5

    def run(start: int, end: int) -> torch.Tensor:
        n = end - start
        out = torch.empty(n, hk * grp, d, device=device)
        blocks = attention_blocks(np.asarray([n]), np.asarray([start]), np.asarray([0]), grp)
        return attention(q[start:end].to(device), kc, vc, table,
                         torch.from_numpy(blocks).to(device), scale, out,
                         sinks=None if sinks is None else sinks.to(device)).cpu()

    from tokenspeed.layers.batch_invariant import attend

    whole = run(0, length)
    ref = attend(q.view(length, hk, grp, d), k, v, scale,
                 sinks=None if sinks is None else sinks.view(hk, grp)).view(length, hk * grp, d)
    torch.testing.assert_close(whole, ref, rtol=1e-4, atol=1e-4)
    for chunk in (64, 7):
        for start in range(0, length, chunk):
            end = min(start + chunk, length)
            assert torch.equal(run(start, end), whole[start:end]), (chunk, start)
    for start in (0, 63, 64, length - 1):  # decode rows, on both sides of a tile boundary
        assert torch.equal(run(start, start + 1), whole[start:start + 1]), start
