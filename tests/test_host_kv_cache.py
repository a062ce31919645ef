"""The host KV tier's copies (layers/host_kv_cache.py): a plan's ordered list of device → host
writebacks, host → device loads and device → device copies gives what running them one at a
time gives, whatever batches the pool groups them into; bad ids are refused before anything
runs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tokenspeed.layers.host_kv_cache import DEVICE, LOAD, WRITEBACK, HostKVPool, _groups, host_pages
from tokenspeed.layers.kv_cache import PagedKVCache

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _pools(device_pages: int = 8, host: int = 6,
           device: str = "cpu") -> tuple[PagedKVCache, HostKVPool]:
    cache = PagedKVCache(num_layers=2, num_pages=device_pages, page_size=2, num_kv_heads=1,
                         head_dim=3, dtype=torch.float32, device=device, max_slots=2,
                         max_context_len=16)
    gen = torch.Generator().manual_seed(0)
    for t in cache.k + cache.v:
        t.copy_(torch.randn(t.shape, generator=gen).to(device))
    return cache, HostKVPool(cache, host)


def _one_at_a_time(cache: PagedKVCache, pool: HostKVPool, ops: list[tuple[int, int, int]]) -> None:
    for s, d, k in ops:
        for layer in range(len(cache.k)):
            for dev, host in ((cache.k[layer], pool.k[layer]), (cache.v[layer], pool.v[layer])):
                if k == WRITEBACK:
                    host[d] = dev[s]
                elif k == LOAD:
                    dev[d] = host[s]
                else:
                    dev[d] = dev[s].clone()


@pytest.mark.parametrize("device", DEVICES)
def test_copies_run_in_order_like_one_at_a_time(device: str) -> None:
    rng = np.random.default_rng(1)
    for trial in range(30):
        ops = []
        for _ in range(int(rng.integers(1, 25))):
            k = int(rng.choice([DEVICE, WRITEBACK, WRITEBACK, LOAD, LOAD]))
            s = int(rng.integers(0, 6 if k == LOAD else 8))
            d = int(rng.integers(0, 6 if k == WRITEBACK else 8))
            ops.append((s, d, k))
        a_cache, a_pool = _pools(device=device)
        b_cache, b_pool = _pools()  # the reference runs on the CPU
        src, dst, kind = (np.array(x, dtype=np.uint32 if i < 2 else np.uint8)
                          for i, x in enumerate(zip(*ops)))
        a_pool.run(src, dst, kind)
        _one_at_a_time(b_cache, b_pool, ops)
        if device == "cuda":
            torch.cuda.synchronize()
            assert a_pool.k[0].is_pinned()
        for x, y in zip(a_cache.k + a_cache.v + a_pool.k + a_pool.v,
                        b_cache.k + b_cache.v + b_pool.k + b_pool.v):
            assert torch.equal(x.cpu(), y), (trial, ops)


def test_a_batch_never_writes_a_page_twice_nor_reads_what_it_wrote() -> None:
    src = np.array([0, 1, 2, 3])
    dst = np.array([5, 5, 0, 4])
    kinds = np.array([WRITEBACK, WRITEBACK, DEVICE, DEVICE])
    groups = [(k, s.tolist(), d.tolist()) for k, s, d in _groups(src, dst, kinds)]
    assert groups == [(WRITEBACK, [0], [5]), (WRITEBACK, [1], [5]), (DEVICE, [2, 3], [0, 4])]


def test_out_of_range_ids_are_refused_before_any_copy() -> None:
    cache, pool = _pools()
    before = [t.clone() for t in cache.k]
    with pytest.raises(ValueError, match="out of range"):
        pool.run(np.array([0, 7]), np.array([1, 6]), np.array([LOAD, WRITEBACK]))
    assert all(torch.equal(a, b) for a, b in zip(before, cache.k))


def test_host_pool_size_from_ratio_or_gigabytes() -> None:
    assert host_pages(ratio=2.0, size_gb=0, device_pages=100, bytes_per_page=10) == 200
    assert host_pages(ratio=2.0, size_gb=1, device_pages=100, bytes_per_page=1000) == 10**6


def test_a_host_pool_larger_than_host_memory_is_refused() -> None:
    cache, _ = _pools()
    with pytest.raises(ValueError, match="lower --hicache-ratio or set --hicache-size"):
        HostKVPool(cache, 10**15)
