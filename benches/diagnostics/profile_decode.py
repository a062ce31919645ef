"""Where a decode step's time goes, on the GPU: the whole worker step vs its parts.

For Llama-3.1-8B (dummy bf16 weights) at batch 1, 64 and 256 after a 128-token prefill:
  step    = ModelRunner.step wall time (plan → state → graph replay → sampler → numpy out)
  forward = ModelRunner.forward wall time (state + inputs + graph replay, synced)
  replay  = GPU time of the CUDA graph replay alone (events)
  sample  = ModelRunner.sample wall time (synced)
  ahead   = time per step when each step is launched before the previous one's tokens are
            read back (input LAST_SAMPLED, as the worker runs under one-step-ahead scheduling)
The server adds the engine thread, shm round trip and HTTP on top of `step`; compare with S3.
Usage (GPU machine): python3 benches/diagnostics/profile_decode.py --tokenizer .carry/llama3/tokenizer.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scenarios"))  # gpu_bench (not a package)
from gpu_bench import write_model_dir
from tokenspeed.bench.one_batch import decode_plan, prefill_plan
from tokenspeed.worker.model_runner import ModelRunner
from tokenspeed.worker.plan import LAST_SAMPLED


def wall_ms(fn, reps: int) -> tuple[float, object]:
    out, times = None, []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokenizer", type=Path, required=True)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64, 256])
    args = p.parse_args()
    model_dir = write_model_dir(Path(tempfile.mkdtemp()), args.tokenizer, args.layers, {})
    pages_per_slot = 1024 // 16  # 128-token prompts + a few decodes fit; keeps KV at ~17 GB
    max_bs = max(args.batch_sizes)
    runner = ModelRunner(str(model_dir), dtype="bfloat16", device="cuda", load_format="dummy", page_size=16,
                         num_pages=max_bs * pages_per_slot, max_slots=max_bs, max_context_len=1024,
                         cuda_graph_max_bs=max_bs)
    rows = []
    step_id, live = 0, []
    for bs in args.batch_sizes:
        prompts = [list(range(1000 + i, 1128 + i)) for i in range(bs)]
        out = runner.step(prefill_plan(step_id, prompts, pages_per_slot, live))
        live = list(range(bs))
        step_id += 1
        tokens, pos = out.tokens, 128

        for _ in range(5):  # warm-up
            out = runner.step(decode_plan(step_id, tokens, pos))
            tokens, pos, step_id = out.tokens, pos + 1, step_id + 1
        # Re-running one decode plan rewrites the same KV position: fine for timing.
        plan = decode_plan(step_id, tokens, pos)
        step_ms, _ = wall_ms(lambda plan=plan: runner.step(plan), 30)
        fwd_ms, logits = wall_ms(lambda plan=plan: runner.forward(plan), 30)
        smp_ms, _ = wall_ms(lambda plan=plan, logits=logits: runner.sample(plan, logits), 30)
        graph = runner.graphs.graphs[runner.graphs.sizes[np.searchsorted(runner.graphs.sizes, bs)]]
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(30):
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        ahead = decode_plan(step_id, np.full(bs, LAST_SAMPLED, np.uint32), pos)
        reps = 50
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        pending = runner.launch(ahead)
        for _ in range(reps - 1):
            queued = runner.launch(ahead)
            pending.wait()
            pending = queued
        pending.wait()
        ahead_ms = (time.perf_counter() - t0) * 1e3 / reps
        rows.append((bs, step_ms, fwd_ms, statistics.median(times), smp_ms, ahead_ms))
    print("| batch | step ms | forward ms | graph replay GPU ms | sample ms | "
          "step − replay (host overhead) ms | launched ahead: ms/step |")
    print("|---|---|---|---|---|---|---|")
    for bs, step_ms, fwd_ms, rep, smp, ahead_ms in rows:
        print(f"| {bs} | {step_ms:.2f} | {fwd_ms:.2f} | {rep:.2f} | {smp:.2f} | "
              f"{step_ms - rep:.2f} | {ahead_ms:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
