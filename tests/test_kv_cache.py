"""The paged KV cache's page table: host and device copies updated together, validated first."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tokenspeed.layers.kv_cache import PagedKVCache


def _cache() -> PagedKVCache:
    return PagedKVCache(num_layers=1, num_pages=64, page_size=4, num_kv_heads=1, head_dim=8,
                        dtype=torch.float32, device="cpu", max_slots=4, max_context_len=32)


def _update(cache: PagedKVCache, runs: list[tuple[int, int, list[int]]]) -> None:
    cache.update_page_table(np.array([r[0] for r in runs], np.uint32),
                            np.array([r[1] for r in runs], np.uint32),
                            np.array([len(r[2]) for r in runs], np.uint32),
                            np.array([p for r in runs for p in r[2]], np.uint32))


def _written_in_order(runs: list[tuple[int, int, list[int]]]) -> np.ndarray:
    table = np.zeros((4, 8), np.int32)
    for slot, first, pages in runs:
        table[slot, first:first + len(pages)] = pages
    return table


@pytest.mark.parametrize("runs", [
    [(2, 0, [5, 6, 7]), (0, 3, [9]), (3, 6, [10, 11])],
    [(1, 0, [1, 2, 3]), (1, 2, [40, 41]), (1, 1, [50])],  # one slot three times: later runs win
])
def test_page_table_update_writes_host_and_device_alike(runs: list) -> None:
    cache = _cache()
    _update(cache, [(0, 0, [1, 1, 1, 1, 1, 1, 1, 1])])
    _update(cache, runs)
    want = _written_in_order([(0, 0, [1] * 8), *runs])
    np.testing.assert_array_equal(cache.page_table_host, want)
    np.testing.assert_array_equal(cache.page_table.numpy(), want)


@pytest.mark.parametrize(("runs", "message"), [
    ([(4, 0, [1])], "slot 4 out of range"),
    ([(1, 0, [1]), (2, 6, [2, 3, 4])], r"slot 2: page-table entries \[6, 9\) exceed"),
    ([(1, 0, [64])], "page id 64 out of range"),
])
def test_bad_updates_fail_before_writing(runs: list, message: str) -> None:
    cache = _cache()
    with pytest.raises(ValueError, match=message):
        _update(cache, runs)
    assert not cache.page_table_host.any() and not cache.page_table.any()


def test_counts_must_cover_the_pages() -> None:
    with pytest.raises(ValueError, match="counts sum to 2, got 3 pages"):
        _cache().update_page_table(np.array([0]), np.array([0]), np.array([2]), np.array([1, 2, 3]))
