"""GPU benchmark: MLA prefill, the tiled mla_extend_attention against the one-row-per-token
mla_decode_attention path the triton backend used before (each token re-reads its prefix).

DeepSeek-V3 shapes on one rank: 128 query heads, latent 512 + rope 64, bf16, page size 64,
shuffled pages. For each prompt length T (a fresh prompt, or a chunk after --prefix cached
tokens) it times one layer's launch (CUDA events, median of --reps after a warm-up), prints us
per call and TFLOP/s of the causal attention (2 * (576 + 512) flops per head and visible key),
and the two paths' relative difference. --sweep times every tile config of SWEEP for the
extend kernel (BLOCK_M tokens, BLOCK_H heads, BLOCK_N keys, warps, stages).

Run (GPU): cd kernels && PYTHONPATH=.:../python python3 bench/bench_mla_extend.py
           cd kernels && PYTHONPATH=.:../python python3 bench/bench_mla_extend.py --lengths 4096 --sweep
CPU (Triton interpreter, a smoke run of the script only):
    TRITON_INTERPRET=1 python3 bench/bench_mla_extend.py --lengths 24 --heads 16 --reps 1
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from triton.runtime.errors import OutOfResources

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_mla_decode import LATENT, PAGE, ROPE, _time

from tokenspeed_kernels import mla_decode_attention, mla_extend_attention, mla_num_splits

SWEEP = [(4, 16, 32, 8, 2), (4, 16, 16, 8, 2), (4, 16, 64, 8, 2), (2, 16, 64, 4, 2), (8, 16, 32, 8, 2),
         (4, 16, 32, 8, 1), (4, 16, 32, 4, 2), (8, 16, 16, 8, 2), (2, 32, 32, 8, 2)]


def setup(tokens: int, prefix: int, heads: int, dev: str, dtype: torch.dtype) -> dict:
    """One request: `prefix` cached tokens then `tokens` new ones, and both paths' inputs."""
    seq = prefix + tokens
    pages = -(-seq // PAGE)
    cache = torch.randn(pages + 1, PAGE, 1, LATENT + ROPE, device=dev).to(dtype)
    page_table = torch.randperm(pages, device=dev).view(1, pages).to(torch.int32)
    return {
        "q": torch.randn(tokens, heads, LATENT + ROPE, device=dev).to(dtype),
        "cache": cache, "page_table": page_table,
        "starts": torch.tensor([0, tokens], dtype=torch.int32, device=dev),
        "prefix": torch.tensor([prefix], dtype=torch.int32, device=dev),
        "rows": torch.zeros(tokens, dtype=torch.int32, device=dev),
        "kv_lens": torch.arange(prefix + 1, seq + 1, dtype=torch.int32, device=dev),
        "splits": mla_num_splits(tokens, -(-heads // 16), seq),
    }


def run(tokens: int, args: argparse.Namespace) -> None:
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    x = setup(tokens, args.prefix, args.heads, dev, dtype)
    out_new = torch.empty(tokens, args.heads, LATENT, device=dev, dtype=dtype)
    out_old = torch.empty_like(out_new)

    def extend(config: tuple[int, ...] | None = None) -> None:
        mla_extend_attention(x["q"], x["cache"], x["page_table"], x["starts"], x["prefix"], 0.1,
                             LATENT, out=out_new, config=config)

    def per_token() -> None:
        mla_decode_attention(x["q"], x["cache"], x["page_table"], x["kv_lens"], 0.1, LATENT,
                             out=out_old, rows=x["rows"], num_splits=x["splits"])

    keys = tokens * args.prefix + tokens * (tokens + 1) // 2  # visible (query, key) pairs
    flops = 2 * (2 * LATENT + ROPE) * args.heads * keys
    cuda = dev == "cuda"
    old = _time(per_token, args.reps, cuda)
    new = _time(extend, args.reps, cuda)
    diff = ((out_new.float() - out_old.float()).norm() / out_old.float().norm()).item()
    print(f"T {tokens:6d} prefix {args.prefix:6d}: extend {new * 1e6:10.1f} us "
          f"{flops / new / 1e12:6.1f} TFLOP/s | per-token rows {old * 1e6:10.1f} us "
          f"{flops / old / 1e12:6.1f} TFLOP/s | speed-up {old / new:5.1f}x | rel diff {diff:.1e}")
    if args.sweep:
        for cfg in SWEEP:
            try:
                sec = _time(lambda cfg=cfg: extend(cfg), args.reps, cuda)
            except (OutOfResources, RuntimeError) as exc:  # past the shared memory or registers
                print(f"  config {cfg}: failed ({type(exc).__name__})")
                continue
            print(f"  config {cfg}: {sec * 1e6:10.1f} us {flops / sec / 1e12:6.1f} TFLOP/s")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096])
    p.add_argument("--prefix", type=int, default=0, help="cached tokens before the new ones")
    p.add_argument("--heads", type=int, default=128)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--sweep", action="store_true", help="time every config of SWEEP too")
    args = p.parse_args()
    print(f"MLA prefill, {args.heads} heads, latent {LATENT} + rope {ROPE}, page {PAGE}")
    for t in args.lengths:
        run(t, args)


if __name__ == "__main__":
    main()
