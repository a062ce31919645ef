"""prefill_attention (fresh prompts, K/V read from strided QKV views with TMA) vs torch's causal
attention per request, GQA; on the CPU under the Triton interpreter with small tiles."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from helpers import TOL, rel_err
from tokenspeed_kernels import prefill_attention, prefill_layout_ok, prefill_supported
from tokenspeed_kernels.reference import softmax_with_sinks


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: list[int],
               sinks: torch.Tensor | None = None) -> torch.Tensor:
    out, start, group = torch.empty_like(q, dtype=torch.float32), 0, q.shape[1] // k.shape[1]
    for n in lens:
        qi, ki, vi = (t[start:start + n].float().transpose(0, 1) for t in (q, k, v))
        ki, vi = ki.repeat_interleave(group, 0), vi.repeat_interleave(group, 0)
        if sinks is None:
            o = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=q.shape[-1] ** -0.5)
        else:
            s = (qi @ ki.transpose(1, 2)) * q.shape[-1] ** -0.5
            s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
            o = softmax_with_sinks(s, sinks, 0) @ vi
        out[start:start + n] = o.transpose(0, 1)
        start += n
    return out


@pytest.mark.parametrize(("lens", "group", "head_dim", "sinks"), [
    ([70, 33, 130], 2, 64, False),  # lengths off the tiles; each request's tiles read into the next
    ([1, 5, 200], 4, 128, False),   # a one-token prompt; the last request's tiles read past the end
    ([257], 1, 64, False),
    ([90, 7], 2, 256, False),       # Gemma 3's wide heads (the default tiles' shared memory)
    ([70, 1, 130], 4, 64, True),    # GPT-OSS: per-head attention sinks
    ([3000, 1500, 17], 8, 64, True),  # GPT-OSS-20B's heads (8 x 8, D=64), long prompts
])
def test_prefill_matches_causal_attention(lens: list[int], group: int, head_dim: int, sinks: bool,
                                          device: str) -> None:
    if device != "cuda" and sum(lens) > 1000:
        pytest.skip("long prompts: GPU only")
    gen = torch.Generator().manual_seed(len(lens) * 100 + group)
    hkv, total = 2, sum(lens)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    # One fused row per token, as the QKV projection leaves them: q, k, v are strided views.
    qkv = torch.randn(total, (hkv * group + 2 * hkv) * head_dim, generator=gen).to(device, dtype)
    q, k, v = (t.view(total, -1, head_dim)
               for t in qkv.split([hkv * group * head_dim, hkv * head_dim, hkv * head_dim], 1))
    sink = (2.0 + 1.5 * torch.randn(hkv * group, generator=gen)).to(device, dtype) if sinks else None
    starts = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32,
                          device=device)
    # Small tiles on the CPU (the interpreter is slow); the default ones on a GPU.
    config = None if device == "cuda" else (32, 16, 4, 2)
    out = prefill_attention(q, k, v, starts, head_dim ** -0.5, max(lens), config=config, sinks=sink)
    err = rel_err(out, _reference(q, k, v, lens, sink))
    assert err < (3e-4 if dtype == torch.float32 else TOL[dtype]), f"rel err {err:.2e}"


def test_supported_only_where_tma_runs() -> None:
    assert not prefill_supported(torch.device("cpu"), torch.bfloat16, 128)
    if torch.cuda.is_available():
        dev = torch.device("cuda")
        assert prefill_supported(dev, torch.float32, 128) is False
        assert prefill_supported(dev, torch.bfloat16, 96) is False
        assert prefill_supported(dev, torch.bfloat16, 128) == (torch.cuda.get_device_capability()[0] >= 9)


def test_layout_check_accepts_fused_qkv_views_only() -> None:
    qkv = torch.zeros(10, (4 + 2 + 2) * 64, dtype=torch.bfloat16)
    q, k, v = (t.view(10, -1, 64) for t in qkv.split([256, 128, 128], 1))
    assert prefill_layout_ok(q, k, v) and prefill_layout_ok(q[3:], k[3:], v[3:])
    assert not prefill_layout_ok(q.transpose(0, 1))  # heads not adjacent within a token's row
    odd = torch.zeros(10, 8 * 64 + 1, dtype=torch.bfloat16)[:, :512].view(10, 8, 64)
    assert not prefill_layout_ok(odd)  # rows 1026 bytes apart: not 16-byte aligned
    assert not prefill_layout_ok(qkv.view(-1)[1:1 + 5 * 64].view(5, 1, 64))  # base off by 2 bytes
