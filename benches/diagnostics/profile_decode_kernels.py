"""Where an S1-sized decode step's GPU time goes, by kernel class, bf16 vs FP8 (issue 15).

For each configuration (default: bf16 weights + bf16 KV at batch 256; bf16 weights + fp8 KV at
411; fp8 weights + fp8 KV at 454: the running counts of S1 on an H100), with every request holding
--context tokens (default 1536, S1's mean mid-run):
  1. build a ModelRunner as the server does (Llama-3.1-8B config, dummy weights, triton
     attention, --context-length 8192) with the KV pool sized to batch x context, and capture
     the one decode CUDA graph the server would replay at that batch (its capture grid: 1, 2, 4,
     8, then multiples of 8, so 411 runs the 416 graph);
  2. fill the KV cache (--fill random, default: every page gets random values and the requests
     are registered at position --context, so the attention kernel reads --context cached
     tokens per request; the bytes read and the kernels run are those of a prefilled cache, only
     the values differ. --fill prefill: real prefills in chunks of --chunk-tokens, slow at S1
     sizes);
  3. time the graph replay with CUDA events (median of --reps back-to-back replays) and the
     whole step (ModelRunner.step: inputs, replay, sampler, tokens back) on the host clock;
  4. profile --profile-steps whole steps with torch.profiler (CUDA activity), group the kernels
     into classes (decode attention, GEMM bf16 / fp8, fp8 activation quantisation,
     norm/rotary/activation, rotary + KV write, sampling, step inputs, other) and print ms per
     step, share, and a roofline floor per class (bytes / --hbm-tbs, FLOPs / --bf16-tflops or
     --fp8-tflops), the attention kernel's achieved GB/s and the top kernels with their launch
     grids;
  5. with --attn-sweep 128x4x2,...: time the decode attention kernel alone on the same cache at
     its default launch config and each BLOCK_N x WARPS x STAGES given (opt-in: each compiles).
Results: --out/profile_decode_kernels.{md,json} (rewritten after each configuration) and one
gzipped Chrome trace per configuration.

GPU (the lead's device call): bash benches/device_check.sh fp8prof:150
CPU smoke (seconds; no graphs or CUDA events: host clock and CPU-activity profile):
    python3 benches/diagnostics/profile_decode_kernels.py --device cpu --layers 2 --batch-sizes 2 \\
        --context 64 --config-overrides '{"vocab_size": 512, "hidden_size": 128, ...}'
"""

from __future__ import annotations

import argparse
import gc
import gzip
import json
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # decode_step_report
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scenarios"))  # gpu_bench (not a package)
from decode_step_report import (
    Kernel,
    Result,
    classify,
    cpu_ops,
    cuda_kernels,
    model_shapes,
    roofline,
    summarize,
    write_outputs,
)
from gpu_bench import MODELS
from tokenspeed.bench.one_batch import decode_plan, median_wall_ms
from tokenspeed.worker.plan import StepPlan

# name: (label, --quantization, --kv-cache-dtype, S1's running requests on an H100)
CONFIGS: dict[str, tuple[str, str | None, str, int]] = {
    "bf16": ("bf16 weights + bf16 KV", None, "auto", 256),
    "fp8kv": ("bf16 weights + fp8 KV", None, "fp8", 411),
    "fp8both": ("fp8 weights + fp8 KV", "fp8", "fp8", 454),
}


def _page_tables(slots: range, pages_per_slot: int) -> list[tuple[int, int, range]]:
    return [(s, 0, range(s * pages_per_slot, (s + 1) * pages_per_slot)) for s in slots]


def fill_random(runner: Any, batch: int, pages_per_slot: int, context: int, seed: int) -> StepPlan:
    """Random values in every KV page, then the plan that registers the requests and runs their
    first decode at position `context` (pure decode: it replays the graph)."""
    kv = runner.kv_cache
    tmp_dtype = runner.dtype if kv.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else kv.dtype
    gen = torch.Generator(device=runner.device).manual_seed(seed)
    tmp = torch.empty(kv.k[0].shape, dtype=tmp_dtype, device=runner.device).normal_(0.0, 0.5, generator=gen)
    for t in kv.k + kv.v:  # one random tensor for all: timing does not depend on the values
        t.copy_(tmp)
    del tmp
    slots = range(batch)
    tokens = np.random.default_rng(seed).integers(10, min(runner.config.vocab_size, 30000), batch)
    return StepPlan.build(0, new=[{"slot": s, "temperature": 0.0} for s in slots],
                          page_tables=_page_tables(slots, pages_per_slot),
                          scheduled=[(s, context, [int(tokens[s])], True) for s in slots])


def fill_prefill(runner: Any, batch: int, pages_per_slot: int, context: int, seed: int,
                 chunk_tokens: int) -> np.ndarray:
    """Prefill every request's `context` prompt tokens, whole prompts, several requests a step
    (at most chunk_tokens tokens); returns the sampled tokens."""
    rng = np.random.default_rng(seed)
    vocab = min(runner.config.vocab_size, 30000)
    per_step = max(1, chunk_tokens // context)
    tokens = np.zeros(batch, np.int64)
    for step, lo in enumerate(range(0, batch, per_step)):
        slots = range(lo, min(batch, lo + per_step))
        plan = StepPlan.build(step, new=[{"slot": s, "temperature": 0.0} for s in slots],
                              page_tables=_page_tables(slots, pages_per_slot),
                              scheduled=[(s, 0, rng.integers(10, vocab, context).tolist(), True)
                                         for s in slots])
        tokens[lo:lo + len(slots)] = runner.step(plan).tokens
    return tokens


def graph_size(batch: int, max_bs: int) -> int:
    """The captured size the server replays for `batch` requests (cuda_graph.capture_sizes)."""
    from tokenspeed.worker.cuda_graph import capture_sizes

    sizes = capture_sizes(max(max_bs, batch))
    return next(s for s in sizes if s >= batch)


def capture_one(runner: Any, size: int) -> None:
    """The decode graph of `size` rows only, as ModelRunner captures each of its sizes (the
    server captures every size of its grid; the others are never replayed here)."""
    from tokenspeed.worker.cuda_graph import DecodeGraphRunner

    graphs = DecodeGraphRunner(runner.model, runner.kv_cache, runner.backend, size,
                               runner.config.vocab_size, runner.device, runner.last_tokens)
    graphs.sizes = [size]
    graphs.capture()
    runner.graphs = graphs
    runner.cuda_graph_max_bs = size


def profile_steps(runner: Any, plan: StepPlan, steps: int, cuda: bool,
                  trace_path: Path | None) -> list[Kernel]:
    acts = [torch.profiler.ProfilerActivity.CPU]
    if cuda:
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(steps):
            with torch.profiler.record_function("ts::forward"):
                fwd = runner.launch_forward(plan)
            with torch.profiler.record_function("ts::sample"):
                pending = runner.launch_sample(plan, fwd)
            pending.wait()
        if cuda:
            torch.cuda.synchronize(runner.device)
    if not cuda:
        return cpu_ops(prof)
    with tempfile.TemporaryDirectory() as d:
        raw = Path(d) / "trace.json"
        prof.export_chrome_trace(str(raw))
        text = raw.read_text()
    if trace_path is not None:
        with gzip.open(trace_path, "wt") as f:
            f.write(text)
    return cuda_kernels(json.loads(text))


def parse_grid(spec: str) -> list[tuple[int, int, int, bool]]:
    """"64x4x2,128x4x3h" -> [(block_n, num_warps, num_stages, f16_dots), ...]; a trailing "h"
    runs an fp8 cache's dots in fp16 (paged_decode_attention's fp8_f16_dots), none in bf16."""
    grid = []
    for item in (x.strip() for x in spec.split(",") if x.strip()):
        f16 = item.endswith("h")
        parts = item.removesuffix("h").split("x")
        if len(parts) != 3 or not all(p.isdigit() for p in parts):
            raise SystemExit(f"--attn-sweep: {item!r} is not BLOCKNxWARPSxSTAGES[h] (e.g. 128x4x2)")
        grid.append((int(parts[0]), int(parts[1]), int(parts[2]), f16))
    return grid


def attention_sweep(runner: Any, batch: int, context: int, grid: list[tuple[int, int, int, bool]],
                    deadline: float, reps: int = 10) -> list[dict[str, Any]]:
    """paged_decode_attention alone on layer 0 of this configuration's cache (the requests' real
    page-table rows, `context` + 1 tokens each, the serving split count), at the default launch
    config and each (block_n, num_warps, num_stages, f16_dots) of `grid`: GPU us per call (CUDA events over
    `reps` back-to-back calls, after one call that compiles) and the KV GB/s. Stops at `deadline`."""
    from tokenspeed_kernels import default_num_splits, paged_decode_attention

    kv, dev = runner.kv_cache, runner.device
    d = runner.config.head_dim
    page_table = kv.page_table[torch.arange(batch, device=dev)]
    seq_lens = torch.full((batch,), context + 1, dtype=torch.int32, device=dev)
    q = torch.randn(batch, runner.num_heads, d, dtype=runner.dtype, device=dev)
    out = torch.empty_like(q)
    splits = default_num_splits(batch, runner.num_kv_heads, runner.max_context_len)  # the backend's
    cuda = dev.type == "cuda"
    kv_bytes = batch * (context + 1) * 2 * runner.num_kv_heads * d * kv.k[0].element_size()
    rows = []
    # the kernel's own defaults first (None: paged_decode_attention picks)
    for block_n, warps, stages, f16 in [(None, 4, None, None), *grid]:
        cfg = (block_n, warps, stages)
        if time.perf_counter() > deadline:
            rows.append({"config": cfg, "f16_dots": f16, "skipped": "budget"})
            break

        def call(b: int | None = block_n, w: int = warps, st: int | None = stages,
                 h: bool | None = f16) -> None:
            knobs = {} if h is None else {"fp8_f16_dots": h}
            paged_decode_attention(q, kv.k[0], kv.v[0], page_table, seq_lens, d**-0.5, out=out,
                                   num_splits=splits, block_n=b, num_warps=w, num_stages=st,
                                   k_scale=kv.k_scale[0], v_scale=kv.v_scale[0], **knobs)

        try:
            call()
            if cuda:
                torch.cuda.synchronize(dev)
        except Exception as e:  # noqa: BLE001  (a config that does not compile or fit: next)
            rows.append({"config": cfg, "f16_dots": f16, "failed": f"{type(e).__name__}: {str(e)[:120]}"})
            continue
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(reps):
                call()
            end.record()
            end.synchronize()
            us = start.elapsed_time(end) * 1e3 / reps
        else:  # the smoke path (Triton's interpreter): host clock
            t0 = time.perf_counter()
            for _ in range(reps):
                call()
            us = (time.perf_counter() - t0) * 1e6 / reps
        rows.append({"config": cfg, "f16_dots": f16, "block_n": block_n or "default", "num_warps": warps,
                     "num_stages": stages or "default", "num_splits": splits, "us": us,
                     "gbs": kv_bytes / us / 1e3, "ms_per_step": us * runner.config.num_hidden_layers / 1e3})
    return rows


def run_config(name: str, args: argparse.Namespace, batch: int, model_dir: str, out: Path,
               checkpoint: Callable[[Result], None]) -> Result:
    """Build, fill, time and profile one configuration; `checkpoint(res)` saves the timings
    before the profiler runs (a hang there leaves them on disk)."""
    from tokenspeed.worker.model_runner import ModelRunner

    label, quant, kv_dtype, _ = CONFIGS[name]
    cuda = args.device.startswith("cuda")
    graphs = cuda and not args.no_graph
    gbatch = graph_size(batch, args.graph_max_bs) if graphs else None
    rows = gbatch or batch
    res = Result(name, label, batch, gbatch, args.context, "fp8" if quant else args.dtype,
                 kv_dtype, args.fill)
    t0 = time.perf_counter()
    pages_per_slot = -(-(args.context + 1) // args.page_size)
    runner = ModelRunner(model_dir, dtype=args.dtype, device=args.device, load_format="dummy",
                         page_size=args.page_size, num_pages=rows * pages_per_slot, max_slots=rows,
                         max_context_len=max(args.max_context_len, args.context + 1),
                         attention_backend=args.attention_backend, disable_cuda_graph=True,
                         kv_cache_dtype=kv_dtype, quantization=quant, seed=args.seed)
    sync = (lambda: torch.cuda.synchronize(runner.device)) if cuda else (lambda: None)
    if graphs:
        capture_one(runner, gbatch)
    if args.fill == "random":
        first = fill_random(runner, batch, pages_per_slot, args.context, args.seed)
        tokens = runner.step(first).tokens
    else:
        tokens = fill_prefill(runner, batch, pages_per_slot, args.context, args.seed,
                              args.chunk_tokens)
    # Every timed step decodes position `context` again (same KV writes): fine for timing.
    plan = decode_plan(1, np.asarray(tokens), args.context)
    for _ in range(args.warmup):
        runner.step(plan)
    sync()
    res.setup_s = time.perf_counter() - t0
    shapes = model_shapes(runner)
    fp8_weights = any(fp8 for *_, fp8 in shapes.linears) and all(fp8 for *_, fp8 in shapes.linears)
    res.roofline = roofline(shapes, batch, rows, args.context, args.hbm_tbs * 1e12,
                            args.bf16_tflops * 1e12, args.fp8_tflops * 1e12)
    replays = runner.graphs.replays if graphs else 0
    res.step_ms = median_wall_ms(lambda: runner.step(plan), args.step_reps, sync)
    if graphs and runner.graphs.replays == replays:
        raise RuntimeError(f"the decode steps of {batch} requests did not replay the graph")
    if graphs:
        graph = runner.graphs.graphs[gbatch]
        ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(args.reps)]
        for start, end in ev:  # back to back, as a busy server replays them
            start.record()
            graph.replay()
            end.record()
        sync()
        times = [s.elapsed_time(e) for s, e in ev]
        res.replay_ms = statistics.median(times)
        res.replay_ms_min, res.replay_ms_max = min(times), max(times)
    checkpoint(res)  # the timings are on disk before the profiler attaches
    try:
        if args.profile != "none":
            profile_into(res, runner, plan, args, cuda, graphs and args.profile == "graph",
                         fp8_weights, out)
    except Exception as e:  # noqa: BLE001  (a profiler failure leaves the timings)
        res.note += f" The profile failed: {type(e).__name__}: {e}"
        traceback.print_exc()
    if not cuda:
        res.note += " CPU: op self times (host clock), no graph; the split is a smoke test."
    if args.attn_sweep:
        checkpoint(res)
        res.attn_sweep = attention_sweep(runner, batch, args.context, parse_grid(args.attn_sweep),
                                         args.deadline, reps=10 if cuda else 1)
    return res


def profile_into(res: Result, runner: Any, plan: StepPlan, args: argparse.Namespace, cuda: bool,
                 graphs: bool, fp8_weights: bool, out: Path) -> None:
    """Profile whole steps (graph replays, or eager steps when `graphs` is off) into res."""
    trace = out / f"trace_{res.config}.json.gz" if cuda and args.keep_traces else None
    saved = runner.graphs
    if not graphs:
        runner.graphs = None  # eager steps: the same kernels, launched one by one
    try:
        kernels = profile_steps(runner, plan, args.profile_steps, cuda, trace)
    finally:
        runner.graphs = saved
    if graphs and not any(classify(k, graphs=True, fp8_weights=fp8_weights) == "attention"
                          for k in kernels):
        # The trace holds no kernel of the graph: profile the same step eagerly (same kernels,
        # num_splits and shapes; the host launches them one by one, so no idle row).
        res.note += (" The profile showed no attention kernel from the graph: the classes come"
                     " from an eager step (same kernels), the replay time from the graph.")
        runner.graphs = None
        try:
            kernels = profile_steps(runner, plan, args.profile_steps, cuda,
                                    out / f"trace_{res.config}_eager.json.gz" if trace else None)
        finally:
            runner.graphs = saved
        graphs = False
    elif cuda and not graphs:
        res.note += " Classes from eager steps (--profile eager): no idle row."
    summarize(res, kernels, args.profile_steps, graphs, fp8_weights, args.top)


def free_memory(cuda: bool) -> None:
    """After a configuration (its frame gone): the graph pool and the KV pool back to the GPU."""
    gc.collect()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("profile_out"))
    p.add_argument("--device", default="cuda")
    p.add_argument("--model", choices=sorted(MODELS), default="llama31-8b",
                   help="dummy-weight config (the roofline counts 2-D weights: dense models only)")
    p.add_argument("--layers", type=int, default=None, help="num_hidden_layers (default: the model's)")
    p.add_argument("--config-overrides", default="{}", help="JSON merged into config.json")
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, of {sorted(CONFIGS)}")
    p.add_argument("--batch-sizes", default=None,
                   help="comma-separated, one per configuration or one for all (default: S1's "
                        + ", ".join(f"{k} {v[3]}" for k, v in CONFIGS.items()) + ")")
    p.add_argument("--context", type=int, default=1536, help="cached tokens per request (S1 mid-run)")
    p.add_argument("--dtype", default="bfloat16", help="activation / unquantised weight dtype")
    p.add_argument("--fill", choices=("random", "prefill"), default="random")
    p.add_argument("--chunk-tokens", type=int, default=8192, help="--fill prefill: tokens a step")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--max-context-len", type=int, default=8192, help="as S1's --context-length")
    p.add_argument("--graph-max-bs", type=int, default=512,
                   help="the server's --cuda-graph-max-bs (sets the capture grid)")
    p.add_argument("--no-graph", action="store_true", help="eager decode steps on CUDA")
    p.add_argument("--attention-backend", default=None)
    p.add_argument("--reps", type=int, default=20, help="graph replays timed")
    p.add_argument("--step-reps", type=int, default=5, help="whole steps timed")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--profile-steps", type=int, default=2)
    p.add_argument("--profile", choices=("graph", "eager", "none"), default="graph",
                   help="profile graph replays (default), eager steps (the same kernels: if the "
                        "profiler misbehaves with graphs) or nothing (timings only)")
    p.add_argument("--top", type=int, default=10, help="kernels listed per configuration")
    p.add_argument("--attn-sweep", default="",
                   help="also time paged_decode_attention alone on each configuration's "
                        "cache at the default launch config and these BLOCKNxWARPSxSTAGES, e.g. "
                        "128x4x2,128x4x3,128x8x2 (each compiles once, ~1-3 s; stops at the budget)")
    p.add_argument("--keep-traces", action=argparse.BooleanOptionalAction, default=True,
                   help="write --out/trace_<config>.json.gz (CUDA)")
    p.add_argument("--budget-s", type=float, default=0.0,
                   help="skip the remaining configurations once another would not fit (0: none)")
    p.add_argument("--hbm-tbs", type=float, default=3.0, help="DRAM bandwidth for the floors, TB/s")
    p.add_argument("--bf16-tflops", type=float, default=800.0)
    p.add_argument("--fp8-tflops", type=float, default=1600.0)
    p.add_argument("--seed", type=int, default=0)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    t_start = time.perf_counter()
    names = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in names if c not in CONFIGS]
    if unknown:
        raise SystemExit(f"--configs: unknown {unknown}; known {sorted(CONFIGS)}")
    if args.batch_sizes:
        sizes = [int(b) for b in args.batch_sizes.split(",")]
        if len(sizes) == 1:
            sizes *= len(names)
        if len(sizes) != len(names):
            raise SystemExit(f"--batch-sizes: {len(sizes)} values for {len(names)} configurations")
    else:
        sizes = [CONFIGS[c][3] for c in names]
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no GPU here (use --device cpu for the smoke path)")
    parse_grid(args.attn_sweep)  # a malformed grid fails before any model is built
    args.deadline = t_start + args.budget_s - 10 if args.budget_s else float("inf")
    args.out.mkdir(parents=True, exist_ok=True)
    base, model_name = MODELS[args.model]
    cfg = {**base, **json.loads(args.config_overrides)}
    if args.layers:
        cfg["num_hidden_layers"] = args.layers
    model_dir = tempfile.mkdtemp(prefix=f"{args.model}-")
    (Path(model_dir) / "config.json").write_text(json.dumps(cfg))
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else "CPU"
    meta = {"device": device, "torch": torch.__version__, "model": model_name,
            "layers": cfg["num_hidden_layers"], "context": args.context, "fill": args.fill,
            "attention_backend": args.attention_backend, "hbm_tbs": args.hbm_tbs,
            "bf16_tflops": args.bf16_tflops, "fp8_tflops": args.fp8_tflops, "argv": sys.argv[1:]}
    results: list[Result] = []
    skipped: list[str] = []
    longest = 0.0
    for name, batch in zip(names, sizes):
        elapsed = time.perf_counter() - t_start
        if args.budget_s and elapsed + longest > args.budget_s:
            skipped.append(f"{name} at batch {batch}: {elapsed:.0f} s spent, the longest "
                           f"configuration took {longest:.0f} s, budget {args.budget_s:.0f} s")
            print(f"skipping {name}: budget", flush=True)
            continue
        t0 = time.perf_counter()
        print(f"=== {name} ({CONFIGS[name][0]}), batch {batch}, context {args.context}", flush=True)
        try:
            results.append(run_config(
                name, args, batch, model_dir, args.out,
                lambda r: write_outputs(args.out, [*results, r], skipped, meta)))
        except Exception as e:  # noqa: BLE001  (one failing configuration, e.g. out of memory, leaves the others)
            skipped.append(f"{name} at batch {batch}: failed: {type(e).__name__}: {e}")
            print(f"{name} failed: {type(e).__name__}: {e}", flush=True)
            traceback.print_exc()
        free_memory(args.device.startswith("cuda"))
        longest = max(longest, time.perf_counter() - t0)
        write_outputs(args.out, results, skipped, meta)  # after each: a timeout keeps the rest
    md = write_outputs(args.out, results, skipped, meta)
    print(md)
    print(f"total {time.perf_counter() - t_start:.1f} s; wrote {args.out}/profile_decode_kernels.md/.json")
    return 0 if results else 1


if __name__ == "__main__":
    sys.exit(main())
