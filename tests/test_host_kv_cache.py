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
    groups = [(k, src[a:b].tolist(), dst[a:b].tolist()) for k, a, b in _groups(src, dst, kinds)]
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


@pytest.mark.parametrize("device", DEVICES)
def test_pages_stored_and_fetched_back_through_local_files_keep_their_kv(tmp_path, device: str) -> None:
    # Device pages 0-1 written back to host slots 0-1, stored under two keys, the slots then
    # overwritten; fetched into slots 4-5 and loaded to device pages 6-7: the same KV.
    from tokenspeed.layers.host_kv_cache import DROP, FETCH, STORE
    from tokenspeed.layers.kv_storage import LocalFileStorage

    cache, _ = _pools(device=device)
    page_bytes = sum(t[0].numel() * t.element_size() for t in cache.k + cache.v)
    store = LocalFileStorage(tmp_path / "pages", page_bytes)
    pool = HostKVPool(cache, 6, storage=store)
    keys = [2**63 + 5, 7]  # keys are hash bits: the top one set reads negative as an i64
    wire = [k - 2**64 if k >= 2**63 else k for k in keys]
    before = [(cache.k[layer][:2].clone(), cache.v[layer][:2].clone()) for layer in range(2)]
    ops = [(0, 0, WRITEBACK), (1, 1, WRITEBACK), (0, 0, STORE), (1, 0, STORE), (2, 0, WRITEBACK),
           (3, 1, WRITEBACK), (0, 4, FETCH), (0, 5, FETCH), (4, 6, LOAD), (5, 7, LOAD)]
    key = [0, 0, wire[0], wire[1], 0, 0, wire[0], wire[1], 0, 0]
    src, dst, kinds = (np.asarray([op[i] for op in ops]) for i in range(3))
    pool.run(src, dst, kinds, np.asarray(key))
    for layer, (k, v) in enumerate(before):
        assert torch.equal(cache.k[layer][6:8], k) and torch.equal(cache.v[layer][6:8], v)
    store.flush()  # stores and drops are written by the backend's thread
    assert sorted(p.name for p in (tmp_path / "pages").iterdir()) == [
        f"{keys[1]:016x}.kv", f"{keys[0]:016x}.kv"]
    pool.run(np.asarray([0]), np.asarray([0]), np.asarray([DROP]), np.asarray([wire[1]]))
    store.flush()
    assert [p.name for p in (tmp_path / "pages").iterdir()] == [f"{keys[0]:016x}.kv"]
    with pytest.raises(RuntimeError, match="missing"):
        pool.run(np.asarray([0]), np.asarray([3]), np.asarray([FETCH]), np.asarray([wire[1]]))


def test_storage_copies_without_a_storage_tier_are_refused() -> None:
    from tokenspeed.layers.host_kv_cache import STORE

    _, pool = _pools()
    with pytest.raises(ValueError, match="storage"):
        pool.run(np.asarray([0]), np.asarray([0]), np.asarray([STORE]), np.asarray([1]))


def test_the_storage_settings_are_checked() -> None:
    from tokenspeed.layers.kv_storage import StorageSettings

    s = StorageSettings.parse("file", '{"path": "/x", "capacity_gb": 2}')
    assert (s.path, s.capacity_gb, s.pages(1000)) == ("/x", 2.0, 2_000_000)
    assert StorageSettings.parse("file", None).capacity_gb == 16.0
    for bad, what in (("[1]", "object"), ('{"size": 1}', "unknown keys"),
                      ('{"capacity_gb": 0}', "positive"), ("{", "not JSON")):
        with pytest.raises(ValueError, match=what):
            StorageSettings.parse("file", bad)
