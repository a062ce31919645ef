"""Wall time of one step, alone on an idle GPU, for a prompt beside running decodes (S2's mixed
steps: a 1024-token prompt beside ~20 decodes took ~30 ms where the prompt alone takes ~22):
the prompt alone, the decodes alone, both together, and both with the prompt cut so that the
step fills an extend-graph size exactly (no padded tokens). Llama-3.1-8B config, dummy weights,
bf16 (or the served fp8 weights / KV cache), extend graphs as `tokenspeed serve` captures them.

    python3 benches/diagnostics/mixed_step_gpu.py [--decodes 20] [--prompt 1024] [--context 1024]
        [--reps 5] [--profile 12] [--quantization fp8] [--kv-cache-dtype fp8] [--eager]

--profile N: after the timings, one more step of each case under torch.profiler, and its N
costliest GPU kernels (ms, launches) with the sum of all kernel time and the GPU's idle gaps
(tokenspeed.diagnostics.step_profile.summarize: the summary a served step gets under TOKENSPEED_STEP_PROFILE).
A prompt past the largest extend graph (2048) runs eager; --decodes 0 times the prompt alone.
"""

from __future__ import annotations

import argparse
import bisect
import json
import tempfile
import time

import numpy as np
import torch

from runner_steps import PlanBuilder, llama31_8b_dir
from tokenspeed.diagnostics.step_profile import summarize

PAGE = 16


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--decodes", type=int, default=20)
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--context", type=int, default=1024, help="tokens each decoding request holds")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of the script, no graphs")
    ap.add_argument("--profile", type=int, default=0, metavar="N", help="top N kernels per case")
    ap.add_argument("--quantization", default=None, help="fp8: the served fp8 weights' path")
    ap.add_argument("--kv-cache-dtype", default="auto", help="fp8: the fp8 KV cache")
    ap.add_argument("--cuda-graph-max-bs", type=int, default=256,
                    help="decode graphs up to this batch (the server's default: up to 1024)")
    ap.add_argument("--eager", action="store_true", help="no extend graphs: every step with more "
                    "requests than the decode graphs hold runs eagerly (graph-or-eager A/B)")
    args = ap.parse_args()
    cuda = args.device == "cuda"

    from tokenspeed.worker.cuda_graph import extend_capture_sizes
    from tokenspeed.worker.model_runner import ModelRunner

    path = llama31_8b_dir(args.layers)
    sizes = extend_capture_sizes(2048)
    slots = args.decodes + 4 * (args.reps + 2) + 1

    def graph_size(tokens: int) -> int | None:
        i = bisect.bisect_left(sizes, tokens)
        return sizes[i] if i < len(sizes) else None

    reps = args.reps + 1 + (1 if args.profile else 0)
    ctx = -(-max(args.context + 4 * reps + 8, graph_size(args.prompt) or args.prompt) // PAGE) * PAGE
    runner = ModelRunner(path, dtype="bfloat16" if cuda else "float32", device=args.device,
                         load_format="dummy", page_size=PAGE, num_pages=slots * ctx // PAGE + 8,
                         max_slots=slots, max_context_len=ctx,
                         extend_graph_sizes=sizes if cuda and not args.eager else None,
                         cuda_graph_max_bs=args.cuda_graph_max_bs if cuda else None,
                         quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype)
    rng = np.random.default_rng(0)
    plan = PlanBuilder(ctx, PAGE).plan
    free_slots = list(range(args.decodes, slots))
    def ids(n: int) -> list[int]:
        return rng.integers(10, 30000, n).tolist()

    decoding = list(range(args.decodes))
    for s in decoding:  # their contexts, one prompt each
        runner.step(plan([(s, ids(args.context))]))

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def timed(reqs: list[tuple[int, list[int]]]) -> float:
        sync()
        t0 = time.perf_counter()
        runner.step(plan(reqs))
        sync()
        return 1e3 * (time.perf_counter() - t0)

    def profiled(reqs: list[tuple[int, list[int]]]) -> list[str]:
        sync()
        acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA]
                                                         if cuda else [])
        with torch.profiler.profile(activities=acts) as prof:
            runner.step(plan(reqs))
            sync()
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            prof.export_chrome_trace(f.name)
            with open(f.name) as trace:
                events = json.load(trace)
        return summarize(events, args.profile)

    cases = {}
    if args.decodes:
        cases[f"decodes alone ({args.decodes})"] = lambda: [(s, ids(1)) for s in decoding]
    cases[f"prompt alone ({args.prompt})"] = lambda: [(free_slots.pop(), ids(args.prompt))]
    mixed_graph = graph_size(args.decodes + args.prompt)
    if args.decodes:
        cases[f"decodes + prompt {args.prompt} ({args.decodes + args.prompt} tokens, graph "
              f"{mixed_graph})"] = (
            lambda: [(s, ids(1)) for s in decoding] + [(free_slots.pop(), ids(args.prompt))])
        prompt_graph = graph_size(args.prompt)
        if prompt_graph is not None:
            fill = prompt_graph - args.decodes  # a prompt that fills a graph with the decodes
            cases[f"decodes + prompt {fill} (fills the {prompt_graph} graph)"] = (
                lambda: [(s, ids(1)) for s in decoding] + [(free_slots.pop(), ids(fill))])
    print(f"| step (Llama-3.1-8B, {runner.config.num_hidden_layers} layers, idle GPU) | ms (median of "
          f"{args.reps}) |\n|---|---|")
    profiles = {}
    for name, make in cases.items():
        times = [timed(make()) for _ in range(args.reps + 1)][1:]
        print(f"| {name} | {np.median(times):.2f} (min {min(times):.2f}) |", flush=True)
        if args.profile:
            profiles[name] = profiled(make())
    for name, lines in profiles.items():
        print(f"{name}:\n" + "\n".join(lines))
    print(f"extend-graph replays {runner.extend_graphs.replays if runner.extend_graphs else 0}")


if __name__ == "__main__":
    main()
