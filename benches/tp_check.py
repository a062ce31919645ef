#!/usr/bin/env python3
"""Tensor parallelism on 2 GPUs: TP=2 gives TP=1's greedy tokens, and S3 (batch-1 decode
ms/token) with TP=1 and TP=2. Llama-3.1-8B config, dummy weights (the same model at any TP:
weights.py draws every full tensor from a per-name seed and each rank keeps its shard).

Run on a 2-GPU machine from the repo root, with `tokenspeed._core` importable:

    python benches/tp_check.py --tokenizer .carry/llama3/tokenizer.json --out "$OUT"

Phase 1 (ModelRunner, no server; ranks are spawned processes joined through NCCL, CUDA graphs
on, so the all-reduces and the LM head's all-gather replay inside the graphs):
  a. fp32, 4 layers: TP=2 greedy tokens must equal TP=1's exactly (fp32 rounding of a split
     sum stays far below the logit gaps).
  b. bf16, 32 layers (the real 8B): greedy continuations agree until a near-tie; at each
     first divergence TP=1's own top-1/top-2 logit gap is printed (dummy N(0, 0.02) weights
     give nearly flat logits, so bf16's different summation order may flip near-ties there,
     as tests/test_gpu.py explains for triton vs HF).
  c. TP=2 with CUDA graphs vs eager: the same tokens (collectives inside graphs are correct).
  d. the all-reduce cost: 64 all-reduces of [1, 4096] bf16 (one decode step of the 8B: two per
     layer) captured in one CUDA graph, replayed; ms per step.
Phase 2: `tokenspeed serve --tp 1` and `--tp 2` (dummy bf16), S3 through `tokenspeed bench
serve` (benches/gpu_bench.py's scenario), one table.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_bench  # benches/ is not a package

PROMPT_LEN, NEW_TOKENS, NUM_PROMPTS = 64, 32, 4


def _rank(rank: int, world: int, init: str, model_dir: str, dtype: str, graphs: bool,
          prompts: list[list[int]], allreduce_bench: bool, cpu: bool, out: Any) -> None:
    try:
        import torch

        from tokenspeed.distributed import ParallelSizes, destroy_distributed, init_distributed
        from tokenspeed.model_runner import ModelRunner
        from tokenspeed.models.offline import OfflineScheduler

        t0 = time.monotonic()
        device = torch.device("cpu") if cpu else torch.device("cuda", rank)
        if not cpu:
            torch.cuda.set_device(device)
        if world > 1:
            init_distributed(rank, ParallelSizes(world, world, world, world), init, device, 300)
        print(f"  rank {rank}/{world}: group up after {time.monotonic() - t0:.1f} s", flush=True)
        runner = ModelRunner(model_dir, dtype=dtype, device=str(device), load_format="dummy",
                             page_size=16, num_pages=512, max_slots=8, max_context_len=512,
                             seed=0, disable_cuda_graph=not graphs, cuda_graph_max_bs=8)
        print(f"  rank {rank}/{world}: runner ready after {time.monotonic() - t0:.1f} s", flush=True)
        res = OfflineScheduler(runner).generate(prompts, NEW_TOKENS, chunk_size=256,
                                                keep_logits=True)
        ar_ms = None
        if allreduce_bench and world > 1 and not cpu:
            from tokenspeed.distributed import tp_all_reduce

            x = torch.zeros(1, 4096, dtype=torch.bfloat16, device=device)
            s = torch.cuda.Stream(device)
            s.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(s):
                for _ in range(3):
                    tp_all_reduce(x)
            torch.cuda.synchronize(device)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, stream=s):
                for _ in range(64):
                    tp_all_reduce(x)
            for _ in range(5):
                g.replay()
            torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            for _ in range(50):
                g.replay()
            torch.cuda.synchronize(device)
            ar_ms = (time.perf_counter() - t0) / 50 * 1e3
        replays = runner.graphs.replays if runner.graphs is not None else 0
        logits = [[x.numpy() for x in req] for req in res.logits] if rank == 0 else None
        destroy_distributed()
        out.put((rank, True, (res.tokens, logits, replays, ar_ms)))
    except BaseException:  # noqa: BLE001  (reported by the parent)
        out.put((rank, False, traceback.format_exc()))


CPU = False  # --cpu-smoke: gloo ranks on the CPU, to check this script without GPUs


def generate(world: int, model_dir: Path, dtype: str, graphs: bool, prompts: list[list[int]],
             allreduce_bench: bool = False, timeout_s: float = 600) -> tuple:
    from tokenspeed.distributed import free_tcp_port

    print(f"generate: TP={world} {dtype} graphs={graphs} {model_dir.name}", flush=True)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    init = f"tcp://127.0.0.1:{free_tcp_port()}"
    procs = [ctx.Process(target=_rank, args=(r, world, init, str(model_dir), dtype, graphs,
                                             prompts, allreduce_bench, CPU, out))
             for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    try:
        for _ in range(world):
            rank, ok, value = out.get(timeout=timeout_s)
            if not ok:
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            results[rank] = value
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()
    return results[0]


def compare(name: str, ref: tuple, got: tuple) -> dict[str, Any]:
    """Per prompt: leading tokens that agree, and TP=1's top-1/top-2 logit gap where they part."""
    agree, gaps = [], []
    for r_tok, g_tok, r_log in zip(ref[0], got[0], ref[1]):
        n = next((i for i, (a, b) in enumerate(zip(r_tok, g_tok)) if a != b), len(r_tok))
        agree.append(n)
        if n < len(r_tok):
            top2 = np.sort(r_log[n])[-2:]
            gaps.append(round(float(top2[1] - top2[0]), 4))
    same = all(n == NEW_TOKENS for n in agree)
    print(f"[{name}] identical: {same}; agreeing prefix per prompt {agree} of {NEW_TOKENS}; "
          f"TP=1 top-1/top-2 gap at each divergence {gaps}; graph replays {got[2]}", flush=True)
    return {"check": name, "identical": same, "agreeing_prefix": agree, "gaps_at_divergence": gaps}


def token_checks(a: argparse.Namespace, tmp: Path, shrink: dict[str, Any],
                 prompts: list[list[int]], model: Path) -> list[dict[str, Any]]:
    """Phase 1 (see the module docstring): one row per check."""
    rows = []
    small_layers = 2 if CPU else 4
    small = gpu_bench.write_model_dir(tmp / "small", Path(a.tokenizer), small_layers, shrink)
    ref = generate(1, small, "float32", True, prompts)
    rows.append(compare(f"fp32 {small_layers} layers, TP=2 vs TP=1 (must be identical)", ref,
                        generate(2, small, "float32", True, prompts)))
    ref = generate(1, model, "bfloat16", True, prompts)
    tp2 = generate(2, model, "bfloat16", True, prompts, allreduce_bench=True)
    rows.append(compare(f"bf16 {a.layers} layers, TP=2 vs TP=1", ref, tp2))
    rows.append(compare(f"bf16 {a.layers} layers TP=2, graphs vs eager", tp2,
                        generate(2, model, "bfloat16", False, prompts)))
    if tp2[3] is not None:
        print(f"[all-reduce] 64 x [1, 4096] bf16 in one CUDA graph: {tp2[3]:.3f} ms per decode "
              "step", flush=True)
        rows.append({"check": "all-reduce ms per 8B decode step (64 x 8 KiB, graph)",
                     "value": round(tp2[3], 4)})
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokenizer", default=".carry/llama3/tokenizer.json")
    p.add_argument("--out", default=os.environ.get("OUT") or "tp_out")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--skip-serve", action="store_true", help="phase 1 only")
    p.add_argument("--skip-tokens", action="store_true", help="phase 2 only (S3)")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="check the script on CPU: a narrow 2-layer model, phase 1 only")
    a = p.parse_args()
    global CPU
    CPU = a.cpu_smoke
    shrink = ({"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4,
               "num_key_value_heads": 2} if CPU else {})
    if CPU:
        a.layers, a.skip_serve = 2, True
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="ts-tp-"))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(100, 120000, PROMPT_LEN).tolist() for _ in range(NUM_PROMPTS)]
    rows: list[dict[str, Any]] = []

    model = gpu_bench.write_model_dir(tmp / "full", Path(a.tokenizer), a.layers, shrink)
    if not a.skip_tokens:
        rows = token_checks(a, tmp, shrink, prompts, model)

    s3: dict[int, Any] = {}
    if not a.skip_serve:
        sc = gpu_bench.scenarios(quick=False)["S3"]
        for tp in (1, 2):
            ctx = gpu_bench.Ctx(out=out, deadline=time.monotonic() + 500)
            started = gpu_bench.start_server(ctx, model, f"tp{tp}", ["--tp", str(tp)], 300)
            if started is None:
                s3[tp] = "server failed"
                continue
            proc, url = started
            try:
                gpu_bench.run_scenario(ctx, url, model, sc)
            finally:
                gpu_bench.stop_server(proc)
            s3[tp] = gpu_bench.dig(ctx.records.get("S3", {}), "metrics.tpot_ms.median")
    lines = ["| check | result |", "|---|---|"]
    for r in rows:
        lines.append(f"| {r['check']} | " + (f"{r['value']}" if "value" in r else
                     f"identical={r['identical']} prefix={r['agreeing_prefix']} "
                     f"gaps={r['gaps_at_divergence']}") + " |")
    for tp, v in s3.items():
        lines.append(f"| S3 median TPOT ms/token, --tp {tp} | {v} |")
    if isinstance(s3.get(1), float) and isinstance(s3.get(2), float):
        lines.append(f"| S3 TP=2 speed-up | {s3[1] / s3[2]:.2f}x |")
    table = "\n".join(lines)
    (out / "tp_check.md").write_text(table + "\n")
    (out / "tp_check.json").write_text(json.dumps({"rows": rows, "s3": s3}, default=str))
    print("\n" + table, flush=True)
    if a.skip_tokens:
        return 0
    return 0 if rows[0]["identical"] and rows[2]["identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
