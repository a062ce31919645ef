"""paged_extend_attention vs the fp32 torch reference (prefix + causal new tokens, GQA, pages)."""

from __future__ import annotations

import pytest
import torch

from helpers import TOL, make_paged_cache, rel_err
from tokenspeed_kernels import paged_extend_attention
from tokenspeed_kernels.reference import ref_paged_extend_attention


def _run(
    prefix_lens: list[int],
    new_lens: list[int],
    hkv: int,
    group: int,
    head_dim: int,
    page_size: int,
    dtype: torch.dtype,
    device: str,
    seed: int,
) -> None:
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [p + n for p, n in zip(prefix_lens, new_lens)]
    k_cache, v_cache, page_table = make_paged_cache(seq_lens, page_size, hkv, head_dim, dtype, device, gen)
    starts = [0]
    for n in new_lens:
        starts.append(starts[-1] + n)
    q = torch.randn(starts[-1], hkv * group, head_dim, generator=gen).to(dtype=dtype, device=device)

    def i32(xs: list[int]) -> torch.Tensor:
        return torch.tensor(xs, dtype=torch.int32, device=device)

    args = (page_table, i32(starts), i32(prefix_lens), i32(seq_lens), head_dim**-0.5)
    out = torch.full_like(q, float("nan"))
    paged_extend_attention(q, k_cache, v_cache, *args, out=out)
    ref = ref_paged_extend_attention(q, k_cache, v_cache, *args)
    tol = 3e-4 if dtype == torch.float32 else TOL[dtype]
    err = rel_err(out, ref)
    assert err < tol, f"rel err {err:.2e}"


@pytest.mark.parametrize("group", [1, 3, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("page_size", [1, 16])
def test_extend_shapes(group: int, head_dim: int, page_size: int, device: str) -> None:
    # prefix 0 (plain prefill), a long prefix with 1 new token, odd sizes straddling tiles.
    _run([0, 33, 7, 100], [7, 1, 70, 33], 1, group, head_dim, page_size, torch.float32, device, seed=group)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_extend_dtypes(dtype: torch.dtype, device: str) -> None:
    _run([17, 0], [40, 9], 2, 2, 64, 16, dtype, device, seed=3)


def test_extend_empty_request(device: str) -> None:
    # A request with no new tokens (q_start_loc repeats) must be skipped cleanly.
    _run([5, 12, 0], [3, 0, 4], 1, 2, 64, 16, torch.float32, device, seed=4)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("group", [1, 4])
def test_extend_gpu_big(dtype: torch.dtype, group: int, device: str) -> None:
    _run([0, 1000, 4095, 300], [1500, 777, 1, 2048], 8, group, 128, 16, dtype, device, seed=group)
    _run([0, 31], [300, 129], 4, group, 64, 1, dtype, device, seed=group + 9)
