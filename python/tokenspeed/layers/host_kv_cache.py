"""The hierarchical cache's host tier: KV pages in host memory, and the plan's page copies.

The scheduler's radix cache demotes evicted prefixes to host slots and loads them back on a
hit (rust/engine/src/radix_host.rs); each step's plan lists the copies in the order they were
decided (`copy_kind`: device → device, device → host writeback, host → device load), and the
worker runs them before the step's forward. Order matters: a device page written back may be
the target of a later load in the same list, and a host slot read by a load may be written
by a later writeback.

On CUDA the host pool is pinned and the copies run on a side stream that first waits for the
work already queued (earlier steps write the KV being written back) and that the forward then
waits for: correct first; the copies do not overlap the step that needs them yet.

With a storage tier (--hicache-storage-backend, kv_storage.py) the list also holds its stores
(host slot -> storage, by key), fetches (storage -> host slot) and drops. They are host I/O,
run in order after the side stream has finished what came before (a stored slot must hold its
writeback; a fetched slot must no longer be read by an earlier load). A store hands the slot's
bytes to the backend, which copies them and writes them off the step's path; a plan's fetches
read their files straight into the slots, several at a time.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from tokenspeed.layers.kv_cache import PagedKVCache
from tokenspeed.layers.kv_storage import KVStorage, StorageSettings

# CopyOp::kind (rust/engine/src/plan.rs, `copy_kind`).
DEVICE, WRITEBACK, LOAD, STORE, FETCH, DROP = 0, 1, 2, 3, 4, 5
STORAGE_KINDS = (STORE, FETCH, DROP)


@dataclass(frozen=True)
class HostTierSize:
    """--hicache-ratio and --hicache-size: how large the host tier is; and the storage tier
    below it, if any."""

    ratio: float
    size_gb: int
    storage: StorageSettings | None = None


def host_pages(*, ratio: float, size_gb: int, device_pages: int, bytes_per_page: int) -> int:
    """Host slots of the host tier: `size_gb` GB when set, else `ratio` x the device pool."""
    if size_gb > 0:
        return int(size_gb * 1e9) // bytes_per_page
    return int(ratio * device_pages)


class HostKVPool:
    """K/V of layer l in `k[l]`, `v[l]`: [num_pages, page_size, num_kv_heads, head_dim], the
    device pool's per-layer layout, in host memory (pinned when the device is a GPU)."""

    def __init__(self, device_cache: PagedKVCache, num_pages: int,
                 storage: KVStorage | None = None) -> None:
        if device_cache.v_from_k:  # its V is a view of K: the copies below would double it
            raise ValueError("--enable-hierarchical-cache is not supported yet for multi-head latent "
                             "attention models (DeepSeek-V2/V3)")
        _check_fits(num_pages, device_cache)
        page = device_cache.k[0].shape[1:]
        dev = device_cache.k[0].device
        pin = dev.type == "cuda"
        shape = (num_pages, *page)
        dtype = device_cache.k[0].dtype
        layers = len(device_cache.k)
        self.k = [torch.zeros(shape, dtype=dtype, pin_memory=pin) for _ in range(layers)]
        self.v = [torch.zeros(shape, dtype=dtype, pin_memory=pin) for _ in range(layers)]
        self.num_pages = num_pages
        self.device_cache = device_cache
        self.stream = torch.cuda.Stream(dev) if pin else None
        self.storage = storage
        # Byte views of each layer's K and V pools, a row per slot (numpy indexing is cheap
        # where a torch view costs microseconds): what the storage tier reads and writes.
        row = int(np.prod(page)) * self.k[0].element_size()
        self._bytes = [t.view(torch.uint8).numpy().reshape(num_pages, row)
                       for pair in zip(self.k, self.v) for t in pair]

    def run(self, src: np.ndarray, dst: np.ndarray, kind: np.ndarray,
            key: np.ndarray | None = None) -> None:
        """Runs a plan's copies in order (validated first: nothing runs on a bad id)."""
        src, dst, kind = (np.asarray(a, np.int64) for a in (src, dst, kind))
        key = np.zeros_like(src) if key is None else np.asarray(key, np.int64)
        self._check(src, dst, kind)
        if self.stream is None:
            for k, a, b in _groups(src, dst, kind):
                self._run_group(k, src[a:b], dst[a:b], key[a:b])
            return
        main = torch.cuda.current_stream(self.stream.device)
        self.stream.wait_stream(main)  # the KV written back is written by queued steps
        with torch.cuda.stream(self.stream):
            for k, a, b in _groups(src, dst, kind):
                if k in STORAGE_KINDS:
                    self.stream.synchronize()  # host I/O: what the side stream queued is done
                self._run_group(k, src[a:b], dst[a:b], key[a:b])
        main.wait_stream(self.stream)  # the forward reads what the loads bring

    def _run_group(self, kind: int, src: np.ndarray, dst: np.ndarray, key: np.ndarray) -> None:
        if kind not in STORAGE_KINDS:
            self._copy(kind, src, dst)
            return
        assert self.storage is not None  # _check refused storage copies without a tier
        if kind == STORE:  # the backend copies the slot before it returns (then writes it)
            for s, k in zip(src.tolist(), key.tolist()):
                self.storage.put(k, self._slot_bytes(s))
        elif kind == FETCH:
            self._fetch(key.tolist(), dst.tolist())
        else:
            for k in key.tolist():
                self.storage.delete(k)

    def _slot_bytes(self, slot: int) -> list[np.ndarray]:
        """Every layer's K and V of host slot `slot`: the page's bytes, in order, as views."""
        return [t[slot] for t in self._bytes]

    def _fetch(self, keys: list[int], slots: list[int]) -> None:
        """Reads pages `keys` into host slots `slots`, in order (at once where no slot is
        written twice)."""
        assert self.storage is not None
        batches = [list(range(len(keys)))] if len(set(slots)) == len(slots) else \
            [[i] for i in range(len(keys))]
        for batch in batches:
            found = self.storage.get([keys[i] for i in batch],
                                     [self._slot_bytes(slots[i]) for i in batch])
            if not all(found):
                k = keys[batch[found.index(False)]]
                raise RuntimeError(f"storage page {k & (2**64 - 1):#018x} is missing: the storage "
                                   "tier's files were removed while the server ran")

    def _check(self, src: np.ndarray, dst: np.ndarray, kind: np.ndarray) -> None:
        if not len(src) == len(dst) == len(kind):
            raise ValueError(f"page copies: {len(src)} sources, {len(dst)} destinations, "
                             f"{len(kind)} kinds")
        n_dev, n_host = self.device_cache.num_pages, self.num_pages
        if self.storage is None and np.isin(kind, STORAGE_KINDS).any():
            raise ValueError("storage-tier copies without --hicache-storage-backend")
        # A store reads a host slot, a fetch writes one; a drop touches neither (ids 0).
        src_max = np.where(np.isin(kind, (LOAD, STORE)), n_host, n_dev)
        dst_max = np.where(np.isin(kind, (WRITEBACK, FETCH)), n_host, n_dev)
        bad = (src < 0) | (src >= src_max) | (dst < 0) | (dst >= dst_max) | (kind > DROP)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise ValueError(f"page copy {i}: kind {kind[i]} {src[i]} -> {dst[i]} out of range "
                             f"({n_dev} device pages, {n_host} host slots)")

    def _copy(self, kind: int, src: np.ndarray, dst: np.ndarray) -> None:
        dev = self.device_cache
        if kind == DEVICE:
            dev.copy_pages(src, dst)
            return
        on_gpu = self.stream is not None
        for layer in range(len(dev.k)):
            for d_pool, h_pool in ((dev.k[layer], self.k[layer]), (dev.v[layer], self.v[layer])):
                if not on_gpu:
                    if kind == WRITEBACK:
                        h_pool[torch.from_numpy(dst)] = d_pool[torch.from_numpy(src)]
                    else:
                        d_pool[torch.from_numpy(dst)] = h_pool[torch.from_numpy(src)]
                elif kind == WRITEBACK:
                    _gpu_writeback(d_pool, h_pool, src, dst)
                else:
                    _gpu_load(h_pool, d_pool, src, dst)


def _check_fits(num_pages: int, device_cache: PagedKVCache) -> None:
    """Refuses a host tier larger than 90% of the host memory available now (pinned memory cannot be
    swapped: overcommitting it takes the machine down, not just this server)."""
    per_page = sum(t[0].numel() * t.element_size() for t in device_cache.k + device_cache.v)
    want = num_pages * per_page
    free = _available_host_bytes()
    if want > 0.9 * free:
        raise ValueError(f"the hierarchical cache's host pool ({num_pages} pages, {want / 1e9:.1f} GB) "
                         f"does not fit in the {free / 1e9:.1f} GB of available host memory: lower "
                         "--hicache-ratio or set --hicache-size (GB)")


def _available_host_bytes() -> int:
    """MemAvailable (free plus reclaimable page cache), else the free pages."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _gpu_writeback(d_pool: torch.Tensor, h_pool: torch.Tensor, src: np.ndarray,
                   dst: np.ndarray) -> None:
    """Device pages `src` → host slots `dst`: gathered on the GPU, then one async copy per run
    of consecutive host slots (the host allocator hands slots out in runs). The staging tensor
    is allocated on the side stream, so the allocator reuses it only behind these copies."""
    idx = torch.from_numpy(src).to(d_pool.device, non_blocking=True)
    stage = d_pool.index_select(0, idx)
    for at, start, n in _runs(dst):
        h_pool[start:start + n].copy_(stage[at:at + n], non_blocking=True)


def _gpu_load(h_pool: torch.Tensor, d_pool: torch.Tensor, src: np.ndarray,
              dst: np.ndarray) -> None:
    """Host slots `src` → device pages `dst`: async copies per run into a device staging
    tensor, then one scatter on the GPU."""
    stage = torch.empty((len(src), *h_pool.shape[1:]), dtype=h_pool.dtype, device=d_pool.device)
    for at, start, n in _runs(src):
        stage[at:at + n].copy_(h_pool[start:start + n], non_blocking=True)
    idx = torch.from_numpy(dst).to(d_pool.device, non_blocking=True)
    d_pool.index_copy_(0, idx, stage)


def _runs(ids: np.ndarray) -> Iterator[tuple[int, int, int]]:
    """(offset in `ids`, first id, length) of each run of consecutive ids."""
    if not len(ids):
        return
    breaks = np.flatnonzero(np.diff(ids) != 1) + 1
    starts = np.concatenate([[0], breaks])
    ends = np.concatenate([breaks, [len(ids)]])
    for a, b in zip(starts.tolist(), ends.tolist()):
        yield a, int(ids[a]), b - a


def _groups(src: np.ndarray, dst: np.ndarray,
            kind: np.ndarray) -> Iterator[tuple[int, int, int]]:
    """Splits the ordered copies into batches (kind, start, end) that may run as one indexed
    copy each: same kind, and no page or slot written twice or read after being written within
    a batch (a batch runs all its reads and writes at once). Storage ops run one by one, in
    order: only a change of kind splits them."""
    start, written, read = 0, set(), set()
    for i in range(len(src)):
        s, d, k = int(src[i]), int(dst[i]), int(kind[i])
        # Device pages and host slots share numbers: key them by pool.
        s_key = (k == LOAD, s)
        d_key = (k == WRITEBACK, d)
        conflict = k not in STORAGE_KINDS and (d_key in written or s_key in written
                                               or d_key in read)
        if i > start and (k != kind[start] or conflict):
            yield int(kind[start]), start, i
            start, written, read = i, set(), set()
        written.add(d_key)
        read.add(s_key)
    if len(src) > start:
        yield int(kind[start]), start, len(src)
