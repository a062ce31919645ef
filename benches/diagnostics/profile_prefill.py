"""One prefill step through ModelRunner, profiled: wall time per step, host time, torch ops /
kernel launches per step and the top host-time items (torch profiler), and a cProfile of the
Python side. Runs on CPU (any small config) and on CUDA (the Llama-3.1-8B dummy config).

    python3 benches/diagnostics/profile_prefill.py MODEL [--device cuda] [--tokens 16] [--dtype bfloat16]

MODEL: a directory with config.json (+ weights unless --load-format dummy, the default), or
`llama31-8b` for the Llama-3.1-8B config (dummy weights; --layers cuts it).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time

import numpy as np
import torch


def make_plan(step_id: int, slot: int, tokens: int, page_size: int, first_page: int, vocab: int):
    from tokenspeed.worker.plan import StepPlan

    pages = list(range(first_page, first_page + -(-tokens // page_size)))
    ids = np.random.default_rng(step_id).integers(10, min(vocab, 30000), tokens).tolist()
    return StepPlan.build(step_id, finished=[slot] if step_id else [],
                          new=[{"slot": slot, "temperature": 0.0}], page_tables=[(slot, 0, pages)],
                          scheduled=[(slot, 0, ids, True)])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--load-format", default="dummy")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--attention-backend", default=None)
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--layers", type=int, default=None, help="with llama31-8b: layers kept")
    args = ap.parse_args()
    if args.model == "llama31-8b":
        import json
        import tempfile

        from tokenspeed.bench.model_configs import LLAMA31_8B

        cfg = dict(LLAMA31_8B)
        if args.layers:
            cfg["num_hidden_layers"] = args.layers
        args.model = tempfile.mkdtemp(prefix="llama31-8b-")
        with open(f"{args.model}/config.json", "w") as f:
            json.dump(cfg, f)

    from tokenspeed.worker.model_runner import ModelRunner

    page_size = 16
    runner = ModelRunner(args.model, dtype=args.dtype, device=args.device,
                         load_format=args.load_format, page_size=page_size,
                         num_pages=max(64, 2 * args.tokens // page_size + 8), max_slots=4,
                         max_context_len=max(256, args.tokens + 16),
                         attention_backend=args.attention_backend, disable_cuda_graph=True)
    vocab = runner.config.vocab_size
    cuda = runner.device.type == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(runner.device)

    def one(step: int) -> tuple[float, float]:
        plan = make_plan(step, 0, args.tokens, page_size, 0, vocab)
        sync()
        t0 = time.perf_counter()
        pending = runner.launch(plan)
        t1 = time.perf_counter()
        pending.wait()
        t2 = time.perf_counter()
        return (t1 - t0) * 1e3, (t2 - t0) * 1e3

    for i in range(3):  # warm-up: Triton compiles, cuBLAS heuristics, pinned-memory pools
        one(i + 1)
    times = [one(100 + i) for i in range(args.steps)]
    host = statistics.median(t[0] for t in times)
    total = statistics.median(t[1] for t in times)
    print(f"prefill of {args.tokens} tokens on {runner.device}: step {total:.2f} ms (median of "
          f"{args.steps}), host launch {host:.2f} ms")

    acts = [torch.profiler.ProfilerActivity.CPU]
    if cuda:
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=acts) as prof:
        one(1000)
    events = prof.key_averages()
    launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel",
                                                        "cudaLaunchKernelExC", "cuLaunchKernelEx"))
    aten = sum(e.count for e in events if e.key.startswith("aten::"))
    syncs = {e.key: e.count for e in events
             if e.key in ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize",
                          "cudaMemcpy", "aten::item", "aten::_local_scalar_dense")}
    kernels = sum(e.count for e in events
                  if str(getattr(e, "device_type", "")).endswith("CUDA") and not e.key.startswith("cuda"))
    print(f"one step: {aten} aten ops, {launches} kernel launch calls (runtime + driver API), "
          f"{kernels} GPU kernels/copies; host syncs/reads: {syncs}")
    print(events.table(sort_by="self_cpu_time_total", row_limit=args.top))

    prof2 = cProfile.Profile()
    prof2.enable()
    one(2000)
    prof2.disable()
    out = io.StringIO()
    pstats.Stats(prof2, stream=out).sort_stats("tottime").print_stats(args.top)
    print(out.getvalue())


if __name__ == "__main__":
    main()
