"""Host time of launching a mixed step (running decodes + one new prompt) while the previous
step still runs on the GPU, split by ModelRunner phase, plus the CUDA runtime calls that block
(torch profiler). Under load (S2: 1024/256 at 8 req/s) such steps showed ~30 ms of launch time
where an idle server's prefill launch takes ~1.5 ms: this finds where it goes.

    python3 benches/diagnostics/profile_mixed_launch.py [--decodes 20] [--prompt 1024] [--reps 5]
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import numpy as np
import torch

from runner_steps import PlanBuilder, llama31_8b_dir

PAGE = 16


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--decodes", type=int, default=20)
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--layers", type=int, default=None)
    args = ap.parse_args()

    from tokenspeed.worker.cuda_graph import extend_capture_sizes
    from tokenspeed.worker.model_runner import ModelRunner

    path = llama31_8b_dir(args.layers)
    slots = args.decodes + args.reps + 1
    ctx = 4096
    runner = ModelRunner(path, dtype="bfloat16", device="cuda", load_format="dummy",
                         page_size=PAGE, num_pages=slots * ctx // PAGE + 8, max_slots=slots,
                         max_context_len=ctx, extend_graph_sizes=extend_capture_sizes(2048))
    rng = np.random.default_rng(0)
    plan = PlanBuilder(ctx, PAGE).plan

    def ids(n: int) -> list[int]:
        return rng.integers(10, 30000, n).tolist()

    decoding = list(range(args.decodes))
    runner.step(plan([(s, ids(64)) for s in decoding]))
    phases = ("_apply_state", "_token_indices", "_replay", "_build_batch", "_sample")
    spent: dict[str, list[float]] = defaultdict(list)
    for name in phases:
        fn = getattr(runner, name)

        def timed(*a, _fn=fn, _name=name, **kw):
            t0 = time.perf_counter()
            try:
                return _fn(*a, **kw)
            finally:
                spent[_name].append(1e3 * (time.perf_counter() - t0))

        setattr(runner, name, timed)
    launches = []
    for rep in range(args.reps + 1):
        torch.cuda.synchronize()
        ahead = runner.launch(plan([(s, ids(1)) for s in decoding]))  # in flight on the GPU
        for v in spent.values():
            v.clear()
        new_slot = args.decodes + rep
        mixed = plan([(s, ids(1)) for s in decoding] + [(new_slot, ids(args.prompt))])
        prof = None
        if rep == args.reps:
            prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            prof.__enter__()
        t0 = time.perf_counter()
        out = runner.launch(mixed)
        launches.append(1e3 * (time.perf_counter() - t0))
        if prof is not None:
            prof.__exit__(None, None, None)
        ahead.wait()
        out.wait()
        decoding.append(new_slot)
        if rep:
            print(f"rep {rep}: launch {launches[-1]:.2f} ms | " + " ".join(
                f"{k.strip('_')} {sum(v):.2f}" for k, v in spent.items() if v))
    replays = runner.extend_graphs.replays if runner.extend_graphs else 0
    print(f"median launch of a mixed step ({args.decodes}+ decodes + {args.prompt}-token prompt, "
          f"previous step in flight): {np.median(launches[1:]):.2f} ms; extend-graph replays "
          f"{replays}")
    if prof is not None:
        rows = [e for e in prof.key_averages() if e.key.startswith("cuda")]
        rows.sort(key=lambda e: -e.cpu_time_total)
        print("CUDA runtime calls in the last mixed launch (host ms, count):")
        for e in rows[:12]:
            print(f"  {e.key:<40} {e.cpu_time_total / 1e3:8.2f} {e.count:6d}")
        top = sorted(prof.key_averages(), key=lambda e: -e.cpu_time_total)[:12]
        print("top host items:")
        for e in top:
            print(f"  {e.key[:60]:<60} {e.cpu_time_total / 1e3:8.2f} {e.count:6d}")


if __name__ == "__main__":
    main()
