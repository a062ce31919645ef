"""The storage tier's `file` backend (layers/kv_storage.py): pages come back bit-exact, stores
are written by background threads (a fetch of a page still waiting is served from its copy, a
drop of one wins, a full queue slows the caller down), what fails in the background fails the
caller, and closing writes or discards what waits."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from tokenspeed.layers.kv_storage import LocalFileStorage

PARTS, PART = 4, 96  # a page: 4 parts of 96 bytes (a layer's K or V each, in the worker)
PAGE = PARTS * PART


def _page(seed: int) -> list[np.ndarray]:
    return list(np.random.default_rng(seed).integers(0, 256, (PARTS, PART), np.uint8))


def _empty() -> list[np.ndarray]:
    return list(np.zeros((PARTS, PART), np.uint8))


def _held(store: LocalFileStorage) -> threading.Event:
    """Holds the writer threads before each write until the returned event is set."""
    go = threading.Event()
    apply = store._writer._apply

    def held(*a: object) -> None:
        go.wait(10)
        apply(*a)

    store._writer._apply = held  # type: ignore[method-assign]
    return go


def _files(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir())


def test_pages_come_back_bit_exact_from_raw_files(tmp_path: Path) -> None:
    store = LocalFileStorage(tmp_path, PAGE, threads=2)
    keys = [3, 2**63 + 1, -5, 40]  # i64 keys from the plan: negative ones are hashes too
    for i, k in enumerate(keys):
        store.put(k, _page(i))
    store.flush()
    assert _files(tmp_path) == sorted(f"{k & (2**64 - 1):016x}.kv" for k in keys)
    raw = (tmp_path / f"{3:016x}.kv").read_bytes()  # the format: the page's bytes, in order
    assert raw == np.concatenate(_page(0)).tobytes()
    outs = [_empty() for _ in keys] + [_empty()]
    assert store.get([*keys, 99], outs) == [True] * len(keys) + [False]
    for i in range(len(keys)):
        assert all(np.array_equal(a, b) for a, b in zip(outs[i], _page(i)))
    (tmp_path / f"{40:016x}.kv").write_bytes(b"short")
    with pytest.raises(OSError, match="5 of 384 bytes"):
        store.get([40], [_empty()])


def test_a_page_still_being_written_is_fetched_from_its_copy(tmp_path: Path) -> None:
    store = LocalFileStorage(tmp_path, PAGE, threads=1)
    go = _held(store)
    src = _page(1)
    store.put(7, src)
    for p in src:  # the caller reuses its slot at once: the backend copied the page
        p[:] = 0
    out = _empty()
    assert store.get([7], [out]) == [True] and not _files(tmp_path)
    assert all(np.array_equal(a, b) for a, b in zip(out, _page(1)))
    go.set()
    store.flush()
    assert _files(tmp_path) == [f"{7:016x}.kv"]
    out = _empty()
    assert store.get([7], [out]) == [True]  # now from the file
    assert all(np.array_equal(a, b) for a, b in zip(out, _page(1)))


def test_a_drop_after_a_store_in_flight_leaves_no_page(tmp_path: Path) -> None:
    store = LocalFileStorage(tmp_path, PAGE, threads=2)
    go = _held(store)
    store.put(5, _page(0))
    store.put(6, _page(1))
    store.delete(5)  # the capacity's eviction, before the page reached the disk
    assert store.get([5, 6], [_empty(), _empty()]) == [False, True]
    go.set()
    store.flush()
    assert _files(tmp_path) == [f"{6:016x}.kv"]


def test_a_full_queue_makes_the_next_store_wait_for_the_disk(tmp_path: Path) -> None:
    store = LocalFileStorage(tmp_path, PAGE, queue_pages=2, threads=1)
    go = _held(store)
    store.put(1, _page(1))
    store.put(2, _page(2))
    third = threading.Thread(target=store.put, args=(3, _page(3)))
    third.start()
    third.join(0.3)
    assert third.is_alive()  # both staging buffers wait to be written
    go.set()
    third.join(10)
    assert not third.is_alive()
    store.flush()
    outs = [_empty() for _ in range(3)]
    assert store.get([1, 2, 3], outs) == [True] * 3
    assert all(np.array_equal(a, b) for i in range(3) for a, b in zip(outs[i], _page(i + 1)))


def test_a_failed_write_fails_the_next_call(tmp_path: Path) -> None:
    store = LocalFileStorage(tmp_path, PAGE, threads=1)

    def full(*a: object) -> None:
        raise OSError(28, "No space left on device")

    store._writer._apply = full  # type: ignore[method-assign]
    store.put(1, _page(1))
    with pytest.raises(RuntimeError, match="No space left"):
        store.flush()
    with pytest.raises(RuntimeError, match="writer failed"):
        store.put(2, _page(2))


def test_closing_writes_what_waits_or_discards_it_with_the_directory(tmp_path: Path) -> None:
    kept = LocalFileStorage(tmp_path / "kept", PAGE, threads=2)
    go = _held(kept)
    for k in range(4):
        kept.put(k, _page(k))
    go.set()
    kept.close()
    assert len(_files(tmp_path / "kept")) == 4
    assert not any(t.is_alive() for t in kept._writer.threads)
    gone = LocalFileStorage(tmp_path / "gone", PAGE, remove_at_exit=True, threads=2)
    gone.put(1, _page(1))
    threads = gone._writer.threads
    del gone  # the finalizer: stops the threads, removes the run's directory
    assert not (tmp_path / "gone").exists() and not any(t.is_alive() for t in threads)


def test_host_pool_stores_and_fetches_many_pages_in_one_plan(tmp_path: Path) -> None:
    # 6 host slots stored under 6 keys, the slots cleared, fetched back into other slots in
    # one plan (the reads run at once), and a plan fetching twice into one slot keeps the last.
    from tokenspeed.layers.host_kv_cache import FETCH, STORE, HostKVPool
    from tokenspeed.layers.kv_cache import PagedKVCache

    cache = PagedKVCache(num_layers=3, num_pages=2, page_size=2, num_kv_heads=2, head_dim=4,
                         dtype=torch.bfloat16, device="cpu", max_slots=1, max_context_len=4)
    page_bytes = sum(t[0].numel() * t.element_size() for t in cache.k + cache.v)
    store = LocalFileStorage(tmp_path, page_bytes, threads=3)
    pool = HostKVPool(cache, 12, storage=store)
    gen = torch.Generator().manual_seed(0)
    for t in pool.k + pool.v:  # every bit pattern, NaNs among them
        t.view(torch.int16).copy_(torch.randint(-2**15, 2**15, t.shape, dtype=torch.int16,
                                                generator=gen))
    want = [t[:6].view(torch.int16).clone() for t in pool.k + pool.v]
    n = np.arange(6)
    pool.run(n, n * 0, np.full(6, STORE), n + 100)
    for t in pool.k + pool.v:
        t.zero_()
    pool.run(n * 0, n + 6, np.full(6, FETCH), n + 100)  # some may still be in flight
    for t, w in zip(pool.k + pool.v, want):
        assert torch.equal(t[6:].view(torch.int16), w)
    pool.run(np.zeros(2, np.int64), np.asarray([0, 0]), np.full(2, FETCH), np.asarray([101, 104]))
    for t, w in zip(pool.k + pool.v, want):
        assert torch.equal(t[0].view(torch.int16), w[4])
