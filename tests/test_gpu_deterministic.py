"""GPU checks of --enable-deterministic-inference (run on the device machine):
the Triton batch-invariant matmul against torch (bf16 tolerance) and invariant in M, the torch
tiled attention invariant on CUDA (the Triton attention kernel's own checks are in
kernels/tests/test_batch_invariant_kernels.py), and a real server on CUDA (triton backend)
answering a greedy and a seeded request with the same tokens and logprob floats alone, after a
prefix hit and inside a batch of 32 (a 4-layer Llama-3.1-8B-shaped dummy model: needs a Llama-3
tokenizer.json, TOKENSPEED_LLAMA3_TOKENIZER or .carry/llama3/tokenizer.json).

    python -m pytest -q tests/test_gpu_deterministic.py kernels/tests/test_batch_invariant_kernels.py
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from tokenspeed.bench.model_configs import LLAMA31_8B
from tokenspeed.layers import batch_invariant as bi

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
ROOT = Path(__file__).resolve().parents[1]
TOKENIZER = Path(os.environ.get("TOKENSPEED_LLAMA3_TOKENIZER",
                                ROOT / ".carry/llama3/tokenizer.json"))


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


def test_triton_attention_bf16_llama_shape() -> None:
    """8 prompts of 1024 tokens (Llama-3.1-8B heads, bf16 paged cache): a token's output is
    bit-equal whether its prompt is attended whole, as a 64-token chunk or as a decode, and
    close to SDPA. Seen on an H200: max error 0.0075, 0.66 ms for the 8x1024 prefill."""
    import numpy as np

    from tokenspeed_kernels.batch_invariant import attention, attention_blocks

    torch.manual_seed(0)
    pages, ps, hk, g, d, length, reqs = 4096, 16, 8, 4, 128, 1024, 8
    kc = torch.randn(pages, ps, hk, d, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    table = torch.randperm(pages, device="cuda")[: reqs * length // ps].view(reqs, -1)
    table = table.to(torch.int32)
    q = torch.randn(reqs * length, hk * g, d, device="cuda", dtype=torch.bfloat16)

    def run(n: list[int], start: list[int], q_start: list[int], qq: torch.Tensor,
            tab: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(qq)
        blocks = attention_blocks(np.asarray(n), np.asarray(start), np.asarray(q_start), g)
        return attention(qq, kc, vc, tab, torch.from_numpy(blocks).cuda(), d ** -0.5, out)

    full = run([length] * reqs, [0] * reqs, [i * length for i in range(reqs)], q, table)
    mine = table[3:4]
    base = 3 * length
    decode = run([1], [length - 1], [0], q[base + length - 1:base + length], mine)
    chunk = run([64], [500], [0], q[base + 500:base + 564], mine)
    assert torch.equal(decode[0], full[base + length - 1])
    assert torch.equal(chunk, full[base + 500:base + 564])
    keys = kc[mine[0].long()].reshape(length, hk, d).transpose(0, 1)[:, None].float()
    vals = vc[mine[0].long()].reshape(length, hk, d).transpose(0, 1)[:, None].float()
    ref = torch.nn.functional.scaled_dot_product_attention(
        q[base:base + length].view(length, hk, g, d).permute(1, 2, 0, 3).float(), keys, vals,
        is_causal=True, scale=d ** -0.5).permute(2, 0, 1, 3).reshape(length, hk * g, d)
    torch.testing.assert_close(full[base:base + length].float(), ref, rtol=2e-2, atol=2e-2)


def _complete(url: str, prompt: str, seed: int | None = None) -> tuple[list, list]:
    """Through httpx (the GPU machine has no openai package): tokens and logprob floats."""
    import httpx

    body = {"model": "default", "prompt": prompt, "max_tokens": 8, "logprobs": 1,
            **({"temperature": 0} if seed is None else {"temperature": 0.9, "seed": seed})}
    body["model"] = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=600)
    r.raise_for_status()
    lp = r.json()["choices"][0]["logprobs"]
    return lp["tokens"], lp["token_logprobs"]


@pytest.mark.skipif(not TOKENIZER.exists(), reason=f"no Llama-3 tokenizer at {TOKENIZER}")
def test_server_on_cuda_alone_vs_batch(tmp_path: Path) -> None:
    """A 4-layer Llama-3.1-8B-shaped model (dummy weights, bf16) behind a real server with the
    flag and --chunked-prefill-size 64: a greedy request alone, after a prefix hit and inside a
    batch of 32 (and a seeded sampled one alone and in the batch) gives the same tokens and
    logprob floats. Dummy weights give near-flat logits: any batch dependence shows."""
    import httpx

    from server_harness import start_server, stop_server

    sys.path.insert(0, os.path.dirname(__file__))
    from test_e2e_deterministic import FLAGS, SEEDED, SHARER, R, others

    model = tmp_path / "llama31-8b-4l"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({**LLAMA31_8B, "num_hidden_layers": 4,
                                                   "eos_token_id": 128001}))
    shutil.copy(TOKENIZER, model / "tokenizer.json")
    srv = start_server(str(tmp_path), str(model), *FLAGS, "--enable-deterministic-inference",
                       "--device", "cuda", "--load-format", "dummy", "--dtype", "bfloat16",
                       "--context-length", "4096")
    try:
        assert "one Triton kernel for every query row" in srv.log()

        def flush() -> None:
            httpx.post(f"{srv.url}/flush_cache", timeout=30).raise_for_status()

        flush()
        alone, sampled = _complete(srv.url, R), _complete(srv.url, SEEDED, 7)
        flush()
        _complete(srv.url, SHARER)
        assert _complete(srv.url, R) == alone  # a prefix hit on SHARER's pages
        flush()
        batch = [*others()[:16], R, *others()[16:30], SEEDED]
        with ThreadPoolExecutor(len(batch)) as pool:
            got = list(pool.map(lambda p: _complete(srv.url, p, 7 if p == SEEDED else None),
                                batch))
        assert got[16] == alone
        assert got[-1] == sampled
    finally:
        stop_server(srv)
