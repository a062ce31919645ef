"""Shared test helpers: relative error, tolerances, paged-cache builders."""

from __future__ import annotations

import torch

TOL = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in fp64; NaN anywhere gives inf."""
    o, r = out.double(), ref.double()
    if not torch.isfinite(o).all():
        return float("inf")
    return ((o - r).norm() / r.norm().clamp_min(1e-30)).item()


def make_paged_cache(
    seq_lens: list[int],
    page_size: int,
    hkv: int,
    head_dim: int,
    dtype: torch.dtype,
    device: str,
    gen: torch.Generator,
    spare_pages: int = 3,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random K/V caches and a shuffled (non-contiguous) page table covering seq_lens."""
    pages_per = [(n + page_size - 1) // page_size for n in seq_lens]
    total_pages = sum(pages_per) + spare_pages
    max_pages = max(pages_per) + 1
    shape = (total_pages, page_size, hkv, head_dim)
    k_cache = torch.randn(shape, generator=gen, dtype=torch.float32).to(dtype=dtype, device=device)
    v_cache = torch.randn(shape, generator=gen, dtype=torch.float32).to(dtype=dtype, device=device)
    perm = torch.randperm(total_pages, generator=gen)
    page_table = torch.full((len(seq_lens), max_pages), -1, dtype=torch.int32)
    used = 0
    for b, n in enumerate(pages_per):
        page_table[b, :n] = perm[used : used + n].to(torch.int32)
        used += n
    # Spare pages and the tail of each last page hold NaN: any read past seq_len poisons the output.
    for p in perm[used:].tolist():
        k_cache[p] = float("nan")
        v_cache[p] = float("nan")
    for b, n in enumerate(seq_lens):
        if n % page_size:
            last = int(page_table[b, pages_per[b] - 1])
            k_cache[last, n % page_size :] = float("nan")
            v_cache[last, n % page_size :] = float("nan")
    # Unused entries point at a NaN page.
    page_table[page_table < 0] = int(perm[-1])
    return k_cache, v_cache, page_table.to(device)
