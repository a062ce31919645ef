"""GPU checks of --enable-deterministic-inference (run on the device machine):
the Triton batch-invariant matmul against torch (bf16 tolerance) and invariant in M, the torch
tiled attention invariant on CUDA (the Triton attention kernel's own checks are in
kernels/tests/test_batch_invariant_kernels.py), and a real server on CUDA (triton backend)
answering a greedy and a seeded request with the same tokens and logprob floats alone, after a
prefix hit and inside a batch of 32.

    python -m pytest -q tests/test_gpu_deterministic.py kernels/tests/test_batch_invariant_kernels.py
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from tokenspeed.layers import batch_invariant as bi

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("k, n", [(4096, 4096), (4096, 14336), (14336, 4096), (576, 49152)])
def test_triton_matmul_matches_torch_and_is_invariant_in_m(k: int, n: int) -> None:
    from tokenspeed_kernels.batch_invariant import matmul

    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(n, k, device="cuda", generator=g, dtype=torch.bfloat16) * 0.02
    x = torch.randn(300, k, device="cuda", generator=g, dtype=torch.bfloat16)
    ref = x.float() @ w.float().t()
    got = matmul(x, w.t())
    torch.testing.assert_close(got.float(), ref, rtol=2e-2, atol=2e-2)
    alone = matmul(x[:1], w.t())[0]
    for m in (1, 2, 7, 8, 64, 65, 257, 300):
        for pos in {0, m - 1}:
            batch = torch.randn(m, k, device="cuda", generator=g, dtype=torch.bfloat16)
            batch[pos] = x[0]
            assert torch.equal(matmul(batch, w.t())[pos], alone), (m, pos)


def test_cuda_attention_is_invariant_to_chunking() -> None:
    g = torch.Generator(device="cuda").manual_seed(1)
    length, hk, grp, d = 300, 8, 4, 128
    q = torch.randn(length, hk, grp, d, device="cuda", generator=g, dtype=torch.bfloat16)
    k = torch.randn(length, hk, d, device="cuda", generator=g, dtype=torch.bfloat16)
    v = torch.randn(length, hk, d, device="cuda", generator=g, dtype=torch.bfloat16)
    whole = bi.attend(q, k, v, d ** -0.5)
    for chunk in (256, 64, 13, 1):
        for start in range(0, length, chunk):
            end = min(start + chunk, length)
            assert torch.equal(bi.attend(q[start:end], k[:end], v[:end], d ** -0.5),
                               whole[start:end]), (chunk, start)


def test_server_on_cuda_alone_vs_batch(tmp_path: Path) -> None:
    sys.path.insert(0, os.path.dirname(__file__))
    import test_e2e_deterministic as e2e

    from server_harness import start_server, stop_server

    # The harness passes --device cpu first; the later spelling wins.
    srv = start_server(str(tmp_path), *e2e.FLAGS, "--enable-deterministic-inference",
                       "--device", "cuda")
    try:
        assert "one Triton kernel for every query row" in srv.log()
        got = e2e.runs(srv)
        for name, base in (("prefix_hit", "alone"), ("batch", "alone"),
                           ("sampled_batch", "sampled_alone")):
            assert got[name] == got[base], name
    finally:
        stop_server(srv)
