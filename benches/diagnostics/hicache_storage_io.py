"""The HiCache storage tier's page I/O on the CPU (issue 37): N pages stored from host slots and
fetched back through `HostKVPool.run`, the call the worker makes for a plan's STORE and FETCH
copies, with the `file` backend as `open_storage` builds it. Prints ms per page and MB/s.

    python3 benches/diagnostics/hicache_storage_io.py [--pages 128] [--batch 128] [--path DIR]
        [--small] [--cold] [--reps 3] [--step-ms 0]

Layout: Llama-3.1-8B (32 layers x 8 KV heads x 128 dims x 16 tokens, bf16 K and V: 2 MiB a
page); --small: 2 layers (128 KiB). `--batch` pages ride in one plan (128 = a 2k-token prefix).
"store" is the time the plans' stores hold the worker (--step-ms: a pause after each plan,
as a forward would give a background writer); "flush" the time until they are all on
disk after that (the backend's `flush`, where stores run in the background); "fetch" reads them
back (from the page cache unless --cold, which syncs and drops the files' cached pages first).
Every fetched page is checked bit-exact against what was stored.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "python"))
from tokenspeed.layers.host_kv_cache import FETCH, STORE, HostKVPool
from tokenspeed.layers.kv_cache import PagedKVCache
from tokenspeed.layers.kv_storage import StorageSettings, open_storage


def _drop_cached(directory: Path) -> None:
    """Writes the pages out and evicts them from the page cache (a cold read)."""
    os.sync()
    for p in directory.rglob("*.kv"):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _run(pool: HostKVPool, kind: int, slots: np.ndarray, keys: np.ndarray, batch: int,
         step_s: float) -> float:
    """Seconds the plans' copies hold the caller (not counting `step_s` between plans)."""
    held = 0.0
    for a in range(0, len(slots), batch):
        s, k = slots[a:a + batch], keys[a:a + batch]
        t0 = time.perf_counter()
        if kind == STORE:
            pool.run(s, np.zeros_like(s), np.full_like(s, STORE), k)
        else:
            pool.run(np.zeros_like(s), s, np.full_like(s, FETCH), k)
        held += time.perf_counter() - t0
        time.sleep(step_s)  # the step's forward, while a background writer writes
    return held


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pages", type=int, default=128)
    ap.add_argument("--batch", type=int, default=128, help="pages per plan")
    ap.add_argument("--path", default=None, help="storage directory (default: a temp dir)")
    ap.add_argument("--small", action="store_true", help="2 layers instead of 32")
    ap.add_argument("--cold", action="store_true", help="fetch from disk, not the page cache")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--step-ms", type=float, default=0.0, help="pause between plans (a forward)")
    args = ap.parse_args()
    layers = 2 if args.small else 32
    cache = PagedKVCache(num_layers=layers, num_pages=1, page_size=16, num_kv_heads=8, head_dim=128,
                         dtype=torch.bfloat16, device="cpu", max_slots=1, max_context_len=16)
    page_bytes = sum(t[0].numel() * t.element_size() for t in cache.k + cache.v)
    root = Path(args.path or tempfile.mkdtemp(prefix="hicache-io-"))
    storage = open_storage(StorageSettings("file", str(root)), {"bench": layers}, page_bytes)
    pool = HostKVPool(cache, args.pages, storage=storage)
    gen = torch.Generator().manual_seed(0)
    for t in pool.k + pool.v:
        t.view(torch.int16).copy_(torch.randint(-2**15, 2**15, t.shape, dtype=torch.int16,
                                                generator=gen))
    want = [t.view(torch.int16).clone() for t in pool.k + pool.v]  # bits (NaNs among them)
    slots = np.arange(args.pages, dtype=np.int64)
    flush = getattr(storage, "flush", lambda: None)
    rows: dict[str, list[float]] = {"store": [], "flush": [], "store+flush": [], "fetch": []}
    for rep in range(args.reps):
        keys = slots + 1 + rep * args.pages  # fresh files each rep
        st = _run(pool, STORE, slots, keys, args.batch, args.step_ms / 1e3)
        t0 = time.perf_counter()
        flush()
        fl = time.perf_counter() - t0
        for t in pool.k + pool.v:
            t.zero_()
        if args.cold:
            _drop_cached(root)
        fe = _run(pool, FETCH, slots, keys, args.batch, 0.0)
        assert all(torch.equal(a.view(torch.int16), b) for a, b in zip(pool.k + pool.v, want)), "fetched != stored"
        rows["store"].append(st)
        rows["flush"].append(fl)
        rows["store+flush"].append(st + fl)
        rows["fetch"].append(fe)
    mb = args.pages * page_bytes / 1e6
    print(f"{args.pages} pages of {page_bytes / 2**20:.3f} MiB, {args.batch} a plan, {root} "
          f"({'cold' if args.cold else 'page cache'}), median of {args.reps}")
    print("| op | ms per page | MB/s |\n|---|---|---|")
    for name, ts in rows.items():
        t = statistics.median(ts)
        print(f"| {name} | {1e3 * t / args.pages:.3f} | {mb / t if t else float('inf'):,.0f} |")


if __name__ == "__main__":
    main()
