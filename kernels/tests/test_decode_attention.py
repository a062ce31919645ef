"""paged_decode_attention vs the fp32 torch reference (GQA, head dims, page sizes, splits, dtypes)."""

from __future__ import annotations

import pytest
import torch

from helpers import TOL, make_paged_cache, rel_err
from tokenspeed_kernels import paged_decode_attention
from tokenspeed_kernels.reference import ref_paged_decode_attention


def _run(
    seq_lens: list[int],
    hkv: int,
    group: int,
    head_dim: int,
    page_size: int,
    dtype: torch.dtype,
    device: str,
    num_splits: int | None,
    seed: int,
) -> None:
    gen = torch.Generator().manual_seed(seed)
    k_cache, v_cache, page_table = make_paged_cache(seq_lens, page_size, hkv, head_dim, dtype, device, gen)
    q = torch.randn(len(seq_lens), hkv * group, head_dim, generator=gen).to(dtype=dtype, device=device)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    scale = head_dim**-0.5
    out = torch.full_like(q, float("nan"))
    paged_decode_attention(q, k_cache, v_cache, page_table, lens, scale, out=out, num_splits=num_splits)
    ref = ref_paged_decode_attention(q, k_cache, v_cache, page_table, lens, scale)
    err = rel_err(out, ref)
    assert err < TOL[dtype], f"rel err {err:.2e}"


@pytest.mark.parametrize("group", [1, 3, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("page_size", [1, 16])
def test_decode_shapes(group: int, head_dim: int, page_size: int, device: str) -> None:
    _run([1, 7, 33, 300], 2, group, head_dim, page_size, torch.float32, device, None, seed=group * head_dim)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_decode_dtypes(dtype: torch.dtype, device: str) -> None:
    _run([5, 130], 2, 4, 64, 16, dtype, device, None, seed=1)


@pytest.mark.parametrize("num_splits", [1, 3, 8])
def test_decode_splits(num_splits: int, device: str) -> None:
    # 8 splits over seq 7 leaves most splits empty; the reduce must weigh them 0.
    _run([7, 200], 1, 8, 64, 16, torch.float32, device, num_splits, seed=num_splits)


def test_decode_output_dtype_and_alloc(device: str) -> None:
    gen = torch.Generator().manual_seed(0)
    k_cache, v_cache, page_table = make_paged_cache([9], 4, 1, 64, torch.bfloat16, device, gen)
    q = torch.randn(1, 2, 64, generator=gen).to(dtype=torch.bfloat16, device=device)
    lens = torch.tensor([9], dtype=torch.int32, device=device)
    out = paged_decode_attention(q, k_cache, v_cache, page_table, lens, 0.125)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    ref = ref_paged_decode_attention(q, k_cache, v_cache, page_table, lens, 0.125)
    assert rel_err(out, ref) < TOL[torch.bfloat16]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_decode_gpu_big(dtype: torch.dtype, group: int, device: str) -> None:
    gen = torch.Generator().manual_seed(7)
    seq_lens = torch.randint(1, 5000, (37,), generator=gen).tolist() + [8192, 1]
    _run(seq_lens, 8, group, 128, 16, dtype, device, None, seed=group)
    _run(seq_lens[:5], 8, group, 128, 1, dtype, device, 16, seed=group + 1)
