"""GPU benchmark: mla_decode_attention (absorbed MLA over a paged latent cache) against the
memory-bandwidth floor of its cache.

DeepSeek-V3 shapes on one rank: 128 query heads, latent 512 + rope 64 (bf16, 1,152 bytes per
token and layer), page size 64, shuffled pages. For each (batch, context) it times one layer's
launch (CUDA events, median of --reps after warm-up) and prints us per call, the latent bytes
read (each request's context once: what the kernel must read at least), GB/s, and that as a
fraction of --peak-gbs (default 3,350: the H100 SXM's HBM3; 4,800 for an H200). The issue's bar:
within 80% of the floor, i.e. fraction >= 0.8. --block-h / --block-n / --warps / --stages tune.

Run (GPU): cd kernels && PYTHONPATH=.:../python python3 bench/bench_mla_decode.py
CPU (Triton interpreter, a smoke run of the script only):
    TRITON_INTERPRET=1 python3 bench/bench_mla_decode.py --batches 2 --contexts 40 --heads 16 --reps 1
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from tokenspeed_kernels import mla_decode_attention

LATENT, ROPE, PAGE = 512, 64, 64


def _time(fn, reps: int, cuda: bool) -> float:
    """Median seconds per call after a warm-up call."""
    fn()
    times = []
    for _ in range(reps):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def run(batch: int, context: int, args: argparse.Namespace) -> None:
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    pages_per = -(-context // PAGE)
    cache = torch.randn(batch * pages_per + 1, PAGE, 1, LATENT + ROPE, device=dev).to(dtype)
    page_table = torch.randperm(batch * pages_per, device=dev).view(batch, pages_per).to(torch.int32)
    lens = torch.full((batch,), context, dtype=torch.int32, device=dev)
    q = torch.randn(batch, args.heads, LATENT + ROPE, device=dev).to(dtype)
    out = torch.empty(batch, args.heads, LATENT, device=dev, dtype=dtype)
    kw = {"block_h": args.block_h, "block_n": args.block_n, "num_warps": args.warps,
          "num_stages": args.stages}

    def call() -> None:
        mla_decode_attention(q, cache, page_table, lens, 0.1, LATENT, out=out, **kw)

    sec = _time(call, args.reps, dev == "cuda")
    nbytes = batch * context * (LATENT + ROPE) * cache.element_size()
    gbs = nbytes / sec / 1e9
    print(f"batch {batch:4d} context {context:6d}: {sec * 1e6:9.1f} us  {nbytes / 1e6:9.1f} MB  "
          f"{gbs:8.0f} GB/s  {gbs / args.peak_gbs:5.2f} of peak")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 128])
    p.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 16384])
    p.add_argument("--heads", type=int, default=128)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--peak-gbs", type=float, default=3350.0)
    p.add_argument("--block-h", type=int, default=16)
    p.add_argument("--block-n", type=int, default=None)
    p.add_argument("--warps", type=int, default=4)
    p.add_argument("--stages", type=int, default=2)
    args = p.parse_args()
    print(f"mla_decode_attention, {args.heads} heads, latent {LATENT} + rope {ROPE}, page {PAGE}, "
          f"block_h {args.block_h} block_n {args.block_n} warps {args.warps} stages {args.stages}")
    for b in args.batches:
        for c in args.contexts:
            run(b, c, args)


if __name__ == "__main__":
    main()
