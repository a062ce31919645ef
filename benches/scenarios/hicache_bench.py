#!/usr/bin/env python3
"""Hierarchical KV cache (issue 37): a multi-turn workload whose prefixes exceed the device KV
pool, with the host tier (--enable-hierarchical-cache) and without it. One GPU, Llama-3.1-8B
config with dummy weights.

Run on the GPU machine from the repo root, with `tokenspeed._core` importable:

    python benches/scenarios/hicache_bench.py --tokenizer .carry/llama3/tokenizer.json --out "$OUT"

Workload: `--conversations` chats (64), each opening with its own random history of
`--history` tokens (2048); every turn appends `--turn-tokens` new user tokens (128) to the
history plus the previous answer, and asks for `--output` tokens (64, ignore_eos). Turns go
round-robin over the conversations, `--concurrency` (8) requests in flight, so by the time a
chat comes back its prefix has been pushed out of a device pool of `--max-total-tokens`
(65,536: about a third of the working set). Every server gets the same pool; the HiCache one
adds `--enable-hierarchical-cache --hicache-ratio 4`, the storage one a host tier as large as
the device pool (`--hicache-ratio 1`) and a local-file storage tier below it
(`--hicache-storage-backend file`, in a temporary directory), so its hits come from files.

Metrics per side: the prefix-cache hit rate of turns after the first (hits / prompt tokens,
from /metrics), host-tier hit tokens and load / writeback pages (/get_server_info), and the
TTFT (mean, p50, p99) of turns after the first; the storage side's storage-tier counters.
Writes summary.md and hicache_bench.jsonl under --out. --sides picks the servers (default
off,hicache,storage). --quick: 2 layers, 8 chats, shorter histories.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
import gpu_bench  # the scenario runner's server helpers, beside this file


async def run_workload(url: str, args: argparse.Namespace) -> list[float]:
    """Runs every turn of every conversation; returns the TTFTs (s) of turns after the first."""
    import httpx

    rng = random.Random(0)
    histories = [[rng.randrange(1000, 100_000) for _ in range(args.history)]
                 for _ in range(args.conversations)]
    sem = asyncio.Semaphore(args.concurrency)
    ttfts: list[float] = []

    async def turn(client: httpx.AsyncClient, model: str, conv: int, t: int) -> None:
        prompt = histories[conv] + [rng.randrange(1000, 100_000) for _ in range(args.turn_tokens)]
        body = {"model": model, "prompt": prompt, "max_tokens": args.output, "temperature": 0,
                "ignore_eos": True, "stream": True}
        async with sem:
            t0, first = time.monotonic(), None
            async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        first = first or time.monotonic()
        if t > 0 and first is not None:
            ttfts.append(first - t0)
        # The next turn extends this one's prompt (the cached prefix) with a stand-in answer
        # (dummy weights: the real one is noise either way).
        histories[conv] = prompt + [rng.randrange(1000, 100_000) for _ in range(args.output)]

    async with httpx.AsyncClient(timeout=1800) as client:
        model = (await client.get(f"{url}/v1/models")).json()["data"][0]["id"]
        for t in range(args.turns):  # round-robin: every chat's turn t, then turn t + 1
            await asyncio.gather(*(turn(client, model, c, t) for c in range(args.conversations)))
    return ttfts


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def run_side(ctx: gpu_bench.Ctx, model_dir: Path, tag: str, extra: list[str],
             args: argparse.Namespace) -> dict[str, Any]:
    pool = ["--max-total-tokens", str(args.max_total_tokens)]  # gpu_bench: context 8192
    started = gpu_bench.start_server(ctx, model_dir, tag, pool + extra, 900)
    if started is None:
        return {"error": f"server {tag} did not start"}
    proc, url = started
    try:
        warm = argparse.Namespace(**{**vars(args), "conversations": 2, "turns": 1})
        asyncio.run(run_workload(url, warm))  # compiles, graphs
        before = gpu_bench.cache_counters(url) or (0.0, 0.0)
        t0 = time.monotonic()
        ttfts = asyncio.run(run_workload(url, args))
        wall = time.monotonic() - t0
        after = gpu_bench.cache_counters(url) or (0.0, 0.0)
        info = json.loads(gpu_bench.http_get(f"{url}/get_server_info")[1])
    finally:
        gpu_bench.stop_server(proc)
    queries, hits = after[0] - before[0], after[1] - before[1]
    return {
        "hit_rate": hits / queries if queries else None,
        "ttft_mean_ms": 1e3 * statistics.mean(ttfts) if ttfts else None,
        "ttft_p50_ms": 1e3 * (pct(ttfts, 0.5) or 0),
        "ttft_p99_ms": 1e3 * (pct(ttfts, 0.99) or 0),
        "wall_s": wall,
        "host": info.get("host_kv_pages"),
        "storage": info.get("storage_kv_pages"),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokenizer", required=True, type=Path, help="Llama-3 tokenizer.json (or its dir)")
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--budget-s", type=float, default=1500)
    p.add_argument("--conversations", type=int, default=64)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--history", type=int, default=2048)
    p.add_argument("--turn-tokens", type=int, default=128)
    p.add_argument("--output", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-total-tokens", type=int, default=65536)
    p.add_argument("--hicache-ratio", type=float, default=4.0)
    p.add_argument("--sides", default="off,hicache,storage",
                   help="servers to run, in order: off, hicache, storage")
    args = p.parse_args()
    if args.quick:
        args.conversations, args.history, args.max_total_tokens = 8, 512, 2048
    args.out.mkdir(parents=True, exist_ok=True)
    ctx = gpu_bench.Ctx(args.out, time.monotonic() + args.budget_s)
    layers = 2 if args.quick else gpu_bench.LLAMA31_8B["num_hidden_layers"]
    model_dir = gpu_bench.write_model_dir(Path(tempfile.mkdtemp(prefix="hicache-bench-")),
                                          args.tokenizer, layers, {})
    store_dir = tempfile.mkdtemp(prefix="hicache-storage-")
    flags = {
        "off": [],
        "hicache": ["--enable-hierarchical-cache", "--hicache-ratio", str(args.hicache_ratio)],
        "storage": ["--enable-hierarchical-cache", "--hicache-ratio", "1",
                    "--hicache-storage-backend", "file", "--hicache-storage-backend-extra-config",
                    json.dumps({"path": store_dir, "capacity_gb": 100})],
    }
    sides = [x for x in args.sides.split(",") if x]
    results = {side: run_side(ctx, model_dir, f"hicache-{side}", flags[side], args)
               for side in sides}
    lines = [f"| metric (turns after the first) | {' | '.join(sides)} |",
             "|---|" + "---|" * len(sides)]
    for key in ("hit_rate", "ttft_mean_ms", "ttft_p50_ms", "ttft_p99_ms", "wall_s"):
        values = {side: results[side].get(key) for side in sides}
        lines.append(f"| {key} | " + " | ".join(
            str(v if v is None else round(v, 3)) for v in values.values()) + " |")
        ctx.row("HiCache", key, values, "hit rate up, TTFT down")
    for side in sides:
        lines.append(f"\n{side}: host tier {results[side].get('host')}; "
                     f"storage tier {results[side].get('storage')}")
    summary = "\n".join(lines)
    (args.out / "summary.md").write_text(summary + "\n")
    (args.out / "hicache_bench.jsonl").write_text(json.dumps(results) + "\n")
    print(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
