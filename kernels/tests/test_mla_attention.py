"""mla_decode_attention (absorbed MLA over a paged latent cache) vs the fp32 torch reference:
decode rows, prefill-chunk rows (own page-table row, causal kv_lens), DeepSeek-V3's 512 + 64
latent and a small one, head counts that do and do not fill a 16-head block, splits, dtypes."""

from __future__ import annotations

import pytest
import torch

from helpers import TOL, make_paged_cache, rel_err
from tokenspeed_kernels.mla_attention import mla_decode_attention
from tokenspeed_kernels.mla_extend import mla_extend_attention
from tokenspeed_kernels.reference import ref_mla_attention


def _run(seq_lens: list[int], heads: int, latent: int, rope: int, page_size: int,
         dtype: torch.dtype, device: str, num_splits: int | None, prefill: bool, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    kv_cache, _, page_table = make_paged_cache(seq_lens, page_size, 1, latent + rope, dtype, device, gen)
    if prefill:  # every request's last 5 tokens (or all) are new: one query row each
        rows = [b for b, n in enumerate(seq_lens) for _ in range(min(5, n))]
        lens = [p + 1 for n in seq_lens for p in range(max(0, n - 5), n)]
    else:
        rows, lens = list(range(len(seq_lens))), list(seq_lens)
    q = torch.randn(len(lens), heads, latent + rope, generator=gen).to(dtype=dtype, device=device)
    kv_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    row_t = torch.tensor(rows, dtype=torch.int32, device=device) if prefill else None
    scale = 0.7 * (128 + rope) ** -0.5  # the original head's scale (x YaRN mscale), not the width's
    out = mla_decode_attention(q, kv_cache, page_table, kv_lens, scale, latent, rows=row_t,
                               num_splits=num_splits)
    ref = ref_mla_attention(q, kv_cache, page_table, kv_lens, scale, latent, row_t)
    assert out.shape == (len(lens), heads, latent) and out.dtype == dtype
    err = rel_err(out, ref)
    assert err < TOL[dtype], f"rel err {err:.2e}"


@pytest.mark.parametrize("heads", [1, 16, 20])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("prefill", [False, True], ids=["decode", "prefill"])
def test_mla_small_latent(heads: int, page_size: int, prefill: bool, device: str) -> None:
    _run([1, 7, 40], heads, 32, 8, page_size, torch.float32, device, None, prefill, seed=heads)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_mla_deepseek_v3_dims(num_splits: int, device: str) -> None:
    _run([3, 70], 16, 512, 64, 16, torch.float32, device, num_splits, False, seed=num_splits)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_mla_dtypes(dtype: torch.dtype, device: str) -> None:
    _run([5, 130], 32, 512, 64, 64, dtype, device, None, False, seed=2)


@pytest.mark.gpu
def test_mla_long_context_many_heads(device: str) -> None:
    """DeepSeek-V3's 128 heads (one rank) over long contexts: split-K across thousands of keys."""
    _run([4096, 1000, 17, 8191], 128, 512, 64, 64, torch.bfloat16, device, None, False, seed=3)


def _run_extend(seq_lens: list[int], new: list[int], heads: int, latent: int, rope: int,
                page_size: int, dtype: torch.dtype, device: str, seed: int) -> None:
    """mla_extend_attention over requests whose last new[b] of seq_lens[b] tokens are new
    (new == seq_len: a fresh prompt) vs the reference with one row per new token."""
    gen = torch.Generator().manual_seed(seed)
    kv_cache, _, page_table = make_paged_cache(seq_lens, page_size, 1, latent + rope, dtype, device, gen)
    rows = [b for b, k in enumerate(new) for _ in range(k)]
    lens = [p + 1 for n, k in zip(seq_lens, new) for p in range(n - k, n)]
    q = torch.randn(len(lens), heads, latent + rope, generator=gen).to(dtype=dtype, device=device)
    starts = torch.tensor([0, *new], dtype=torch.int32).cumsum(0).to(torch.int32).to(device)
    prefix = torch.tensor([n - k for n, k in zip(seq_lens, new)], dtype=torch.int32, device=device)
    scale = 0.7 * (128 + rope) ** -0.5
    out = mla_extend_attention(q, kv_cache, page_table, starts, prefix, scale, latent)
    ref = ref_mla_attention(q, kv_cache, page_table, torch.tensor(lens), scale, latent, torch.tensor(rows))
    assert out.shape == (len(lens), heads, latent) and out.dtype == dtype
    err = rel_err(out, ref)
    assert err < TOL[dtype], f"rel err {err:.2e}"


@pytest.mark.parametrize("heads", [1, 16, 20])
@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_mla_extend_small_latent(heads: int, page_size: int, device: str) -> None:
    """Fresh prompts, chunks after a cached prefix and a one-token request in one launch."""
    _run_extend([9, 40, 23, 6], [9, 13, 1, 6], heads, 32, 8, page_size, torch.float32, device,
                seed=heads + page_size)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_mla_extend_deepseek_v3_dims(dtype: torch.dtype, device: str) -> None:
    _run_extend([7, 45], [7, 10], 16, 512, 64, 16, dtype, device, seed=5)


@pytest.mark.gpu
def test_mla_extend_long_prompts(device: str) -> None:
    """DeepSeek-V3's 128 heads: a fresh 1000-token prompt and 700-token chunk after a long prefix."""
    _run_extend([1000, 4800, 64], [1000, 700, 64], 128, 512, 64, 64, torch.bfloat16, device, seed=6)
