"""rotary_embedding_write_kv (fused RoPE + paged KV write) vs the fp32 reference and vs the
two-kernel path (rotary_embedding then write_kv_to_pages), which it must match bit for bit."""

from __future__ import annotations

import pytest
import torch

from helpers import TOL, rel_err
from tokenspeed_kernels import (
    build_cos_sin_cache,
    rotary_embedding,
    rotary_embedding_write_kv,
    write_kv_to_pages,
)
from tokenspeed_kernels.reference import ref_rotary_embedding_write_kv

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}  # fmt: skip


def _inputs(total: int, hq: int, hkv: int, head_dim: int, page_size: int, dtype: torch.dtype, device: str,
            seed: int, num_pages: int = 12) -> dict[str, torch.Tensor]:  # fmt: skip
    """q/k/v as views into one fused qkv buffer, random caches, shuffled slots with two padding
    rows (-1)."""
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(total, (hq + 2 * hkv) * head_dim, generator=gen).to(dtype=dtype, device=device)
    shape = (num_pages, page_size, hkv, head_dim)
    slots = torch.randperm(num_pages * page_size, generator=gen)[:total]
    slots[1] = -1
    slots[total - 1] = -1
    return {
        "qkv": qkv,
        "positions": torch.randint(0, 4096, (total,), generator=gen).to(device),
        "k_cache": torch.randn(shape, generator=gen).to(dtype=dtype, device=device),
        "v_cache": torch.randn(shape, generator=gen).to(dtype=dtype, device=device),
        "slots": slots.to(device),
    }


def _split(qkv: torch.Tensor, hq: int, hkv: int, head_dim: int) -> list[torch.Tensor]:
    return list(qkv.split([hq * head_dim, hkv * head_dim, hkv * head_dim], dim=-1))


# GQA ratios 1, 4, 8, 3 (the last with partial rotary); head_dim 64 and 128.
SHAPES = [(2, 2, 64, 64), (8, 2, 128, 128), (8, 1, 64, 64), (6, 2, 128, 64)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("hq,hkv,head_dim,rotary_dim", SHAPES)
def test_rotary_write_kv_matches_reference(
    hq: int, hkv: int, head_dim: int, rotary_dim: int, page_size: int, dtype: torch.dtype, device: str
) -> None:
    total = 7 if page_size == 1 else 13
    s = _inputs(total, hq, hkv, head_dim, page_size, dtype, device, seed=hq * head_dim + page_size)
    cache = build_cos_sin_cache(rotary_dim, 4096, 500000.0, LLAMA3, device=device)
    q, k, v = _split(s["qkv"], hq, hkv, head_dim)
    k_before = k.clone()
    ref_kc, ref_vc = s["k_cache"].clone(), s["v_cache"].clone()
    ref_q, _ = ref_rotary_embedding_write_kv(s["positions"], q, k, v, cache, ref_kc, ref_vc, s["slots"])
    rotary_embedding_write_kv(s["positions"], q, k, v, cache, s["k_cache"], s["v_cache"], s["slots"])
    assert rel_err(q, ref_q) < TOL[dtype]
    assert rel_err(s["k_cache"], ref_kc) < TOL[dtype]
    assert torch.equal(s["v_cache"], ref_vc)  # v and every untouched (incl. padding) slot exact
    assert torch.equal(k, k_before)  # k itself stays unrotated by default


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("hq,hkv,head_dim,rotary_dim", SHAPES)
def test_rotary_write_kv_equals_two_kernel_path(
    hq: int, hkv: int, head_dim: int, rotary_dim: int, is_neox: bool, dtype: torch.dtype, device: str
) -> None:
    """Bit-identical q, k (rotate_k=True) and caches to rotary_embedding + write_kv_to_pages."""
    s = _inputs(9, hq, hkv, head_dim, 16, dtype, device, seed=hq + head_dim + is_neox)
    cache = build_cos_sin_cache(rotary_dim, 4096, 10000.0, device=device)
    qkv_ref, kc_ref, vc_ref = s["qkv"].clone(), s["k_cache"].clone(), s["v_cache"].clone()
    q, k, v = _split(qkv_ref, hq, hkv, head_dim)
    rotary_embedding(s["positions"], q, k, cache, head_dim, is_neox)
    write_kv_to_pages(k.unflatten(1, (hkv, head_dim)), v.unflatten(1, (hkv, head_dim)), kc_ref, vc_ref,
                      s["slots"])  # fmt: skip
    q, k, v = _split(s["qkv"], hq, hkv, head_dim)
    rotary_embedding_write_kv(s["positions"], q.unflatten(1, (hq, head_dim)), k, v, cache, s["k_cache"],
                              s["v_cache"], s["slots"], is_neox=is_neox, rotate_k=True)  # fmt: skip
    assert torch.equal(s["qkv"], qkv_ref)  # q and k rotated identically, v untouched
    assert torch.equal(s["k_cache"], kc_ref) and torch.equal(s["v_cache"], vc_ref)


def test_rotary_write_kv_empty(device: str) -> None:
    s = _inputs(3, 4, 2, 64, 1, torch.float32, device, seed=0)
    cache = build_cos_sin_cache(64, 4096, 10000.0, device=device)
    q, k, v = (x[:0] for x in _split(s["qkv"], 4, 2, 64))
    kc = s["k_cache"].clone()
    rotary_embedding_write_kv(s["positions"][:0], q, k, v, cache, s["k_cache"], s["v_cache"], s["slots"][:0])
    assert torch.equal(s["k_cache"], kc)


@pytest.mark.gpu
def test_rotary_write_kv_gpu_big(device: str) -> None:
    """Llama-3.1-8B shapes, 8192 tokens (many programs in flight), vs the two-kernel path."""
    hq, hkv, d = 32, 8, 128
    s = _inputs(8192, hq, hkv, d, 16, torch.bfloat16, device, seed=3, num_pages=1024)
    s["slots"][::97] = -1
    cache = build_cos_sin_cache(d, 131072, 500000.0, LLAMA3, device=device)
    s["positions"] = torch.randint(0, 131072, (8192,), device=device)
    qkv_ref, kc_ref, vc_ref = s["qkv"].clone(), s["k_cache"].clone(), s["v_cache"].clone()
    q, k, v = _split(qkv_ref, hq, hkv, d)
    rotary_embedding(s["positions"], q, k, cache, d)
    write_kv_to_pages(k.unflatten(1, (hkv, d)), v.unflatten(1, (hkv, d)), kc_ref, vc_ref, s["slots"])
    q, k, v = _split(s["qkv"], hq, hkv, d)
    rotary_embedding_write_kv(s["positions"], q, k, v, cache, s["k_cache"], s["v_cache"], s["slots"])
    assert torch.equal(q, qkv_ref[:, : hq * d])
    assert torch.equal(s["k_cache"], kc_ref) and torch.equal(s["v_cache"], vc_ref)
