"""rotary_embedding (neox / GPT-J, llama3 scaling, partial rotary, strided q/k) and write_kv_to_pages."""

from __future__ import annotations

import math

import pytest
import torch

from helpers import TOL, rel_err
from tokenspeed_kernels import build_cos_sin_cache, rotary_embedding, write_kv_to_pages
from tokenspeed_kernels.reference import ref_rotary_embedding, ref_write_kv_to_pages

LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("head_dim,rotary_dim,hq,hkv", [(64, 64, 4, 1), (128, 128, 6, 2), (128, 64, 3, 3)])
def test_rotary(
    dtype: torch.dtype, is_neox: bool, head_dim: int, rotary_dim: int, hq: int, hkv: int, device: str
) -> None:
    gen = torch.Generator().manual_seed(head_dim + hq)
    total = 11
    cache = build_cos_sin_cache(rotary_dim, 4096, 500000.0, LLAMA3, device=device)
    positions = torch.randint(0, 4096, (total,), generator=gen).to(device)
    # q and k are views into one fused qkv buffer (token stride > row width), as in a real model.
    qkv = torch.randn(total, (hq + 2 * hkv) * head_dim, generator=gen).to(dtype=dtype, device=device)
    q, k, _ = qkv.split([hq * head_dim, hkv * head_dim, hkv * head_dim], dim=-1)
    ref_q, ref_k = ref_rotary_embedding(positions, q, k, cache, head_dim, is_neox)
    v_before = qkv[:, (hq + hkv) * head_dim :].clone()
    rotary_embedding(positions, q, k, cache, head_dim, is_neox)
    assert rel_err(q, ref_q) < TOL[dtype] and rel_err(k, ref_k) < TOL[dtype]
    assert torch.equal(qkv[:, (hq + hkv) * head_dim :], v_before)


def test_llama3_cache_matches_formula() -> None:
    cache = build_cos_sin_cache(128, 16, 500000.0, LLAMA3)
    inv = 1.0 / (500000.0 ** (torch.arange(0, 128, 2, dtype=torch.float64) / 128))
    wavelen = 2 * math.pi / inv
    # Highest frequencies unchanged, lowest divided by the factor.
    assert torch.allclose(cache[1, 0].double(), torch.cos(inv[0]), atol=1e-6)
    assert wavelen[-1] > 8192 and torch.allclose(cache[1, 63].double(), torch.cos(inv[-1] / 8), atol=1e-6)
    plain = build_cos_sin_cache(64, 8, 10000.0)
    assert plain.shape == (8, 64) and torch.allclose(plain[0, :32], torch.ones(32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("page_size,hkv,head_dim", [(1, 2, 64), (16, 3, 128)])
def test_write_kv_to_pages(dtype: torch.dtype, page_size: int, hkv: int, head_dim: int, device: str) -> None:
    gen = torch.Generator().manual_seed(page_size * hkv)
    num_pages, total = 12, 9
    shape = (num_pages, page_size, hkv, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype=dtype, device=device)
    v_cache = torch.randn(shape, generator=gen).to(dtype=dtype, device=device)
    kv = torch.randn(total, 2, hkv, head_dim, generator=gen).to(dtype=dtype, device=device)
    k, v = kv[:, 0], kv[:, 1]  # strided token dim
    slots = torch.randperm(num_pages * page_size, generator=gen)[:total]
    slots[3] = -1  # padding token: skipped
    slots = slots.to(device)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    ref_write_kv_to_pages(k, v, ref_k, ref_v, slots)
    write_kv_to_pages(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)


@pytest.mark.gpu
def test_rotary_kv_gpu_big(device: str) -> None:
    gen = torch.Generator().manual_seed(5)
    total, hq, hkv, d = 8192, 32, 8, 128
    cache = build_cos_sin_cache(d, 131072, 500000.0, LLAMA3, device=device)
    positions = torch.randint(0, 131072, (total,), generator=gen).to(device)
    qkv = torch.randn(total, (hq + 2 * hkv) * d, generator=gen).to(dtype=torch.bfloat16, device=device)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    ref_q, ref_k = ref_rotary_embedding(positions, q, k, cache, d, True)
    rotary_embedding(positions, q, k, cache, d, True)
    assert rel_err(q, ref_q) < 1e-2 and rel_err(k, ref_k) < 1e-2
    k_cache = torch.zeros(1024, 16, hkv, d, dtype=torch.bfloat16, device=device)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.randperm(1024 * 16, generator=gen)[:total].to(device)
    k3, v3 = k.view(total, hkv, d), v.view(total, hkv, d)
    write_kv_to_pages(k3, v3, k_cache, v_cache, slots)
    assert torch.equal(k_cache.view(-1, hkv, d)[slots], k3) and torch.equal(
        v_cache.view(-1, hkv, d)[slots], v3
    )
