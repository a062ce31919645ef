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
    python3 benches/profile_decode_kernels.py --device cpu --layers 2 --batch-sizes 2 \\
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
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_bench import MODELS
from tokenspeed.bench.one_batch import decode_plan
from tokenspeed.plan import StepPlan

# name: (label, --quantization, --kv-cache-dtype, S1's running requests on an H100)
CONFIGS: dict[str, tuple[str, str | None, str, int]] = {
    "bf16": ("bf16 weights + bf16 KV", None, "auto", 256),
    "fp8kv": ("bf16 weights + fp8 KV", None, "fp8", 411),
    "fp8both": ("fp8 weights + fp8 KV", "fp8", "fp8", 454),
}
# Kernel classes, in table order.
CLASSES: dict[str, str] = {
    "attention": "decode attention",
    "gemm_bf16": "GEMM/GEMV bf16",
    "gemm_fp8": "GEMM/GEMV fp8",
    "act_quant": "fp8 activation quant",
    "norm_act": "norm / rotary / activation",
    "kv_write": "rotary + KV write",
    "sampling": "sampling (outside graph)",
    "inputs": "step inputs (outside graph)",
    "other": "other",
}
PHASES = ("ts::forward", "ts::sample")  # record_function ranges around the two halves of a step
_FP8_MARKS = ("e4m3", "e5m2", "fp8", "f8f8", "scaled_mm", "w8a8")
_PATTERNS: list[tuple[str, tuple[str, ...]]] = [  # first match wins
    ("attention", ("decode_split", "decode_reduce", "extend_kernel", "attention", "attn", "flash",
                   "sdpa", "scaled_dot_product")),
    ("kv_write", ("rotary_kv", "write_kv", "index_put")),
    ("act_quant", ("per_token_quant",)),
    ("gemm", ("gemm", "gemv", "nvjet", "cutlass", "xmma", "cublas", "splitk", "matmul", "aten::mm",
              "aten::addmm", "aten::linear", "aten::bmm", "scaled_mm", "wgmma", "s16816",
              "h16816")),
    ("norm_act", ("rmsnorm", "norm", "silu", "rotary", "rope", "gelu", "act_and_mul",
                  "aten::rsqrt", "aten::pow", "aten::mean")),
    ("sampling", ("argmax", "softmax", "topk", "sort", "multinomial", "sampl", "exponential")),
]


@dataclass
class Kernel:
    """One GPU kernel / copy (CUDA) or one op's self time (CPU) from the profile."""
    name: str
    dur_us: float
    in_graph: bool = False
    phase: str | None = None  # the ts:: range its launch fell in
    grid: tuple[int, ...] | None = None
    block: tuple[int, ...] | None = None
    regs: int | None = None
    smem: int | None = None


def classify(k: Kernel, *, graphs: bool, fp8_weights: bool) -> str:
    """The class of a kernel. With graphs (CUDA), kernels launched outside the decode graph are
    the sampler's (ts::sample) or the step's input preparation (ts::forward); inside it, and on
    the CPU, the name decides. GEMMs count as fp8 when the name says so or when every matmul
    weight of the model is fp8."""
    if graphs and not k.in_graph and k.phase == "ts::sample":
        return "sampling"
    if graphs and not k.in_graph and k.phase == "ts::forward":
        return "inputs"
    n = k.name.lower()
    for cls, marks in _PATTERNS:
        if any(m in n for m in marks):
            if cls == "gemm":
                return "gemm_fp8" if fp8_weights or any(m in n for m in _FP8_MARKS) else "gemm_bf16"
            return cls
    return "other"


def _triple(v: Any) -> tuple[int, ...] | None:
    return tuple(int(x) for x in v) if isinstance(v, (list, tuple)) else None


def cuda_kernels(trace: dict[str, Any]) -> list[Kernel]:
    """Kernels, copies and memsets of a torch.profiler Chrome trace, each with whether a CUDA
    graph launched it (its launch call is cudaGraphLaunch, or Kineto gave it a graph id) and the
    ts:: range its launch call fell in."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    ranges = sorted((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)), e["name"])
                    for e in events if e.get("cat") == "user_annotation" and e.get("name") in PHASES)
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    out = []
    for e in events:
        if e.get("cat") not in ("kernel", "gpu_memcpy", "gpu_memset"):
            continue
        args = e.get("args", {})
        launch = launches.get(args.get("correlation"))
        in_graph = bool(args.get("graph id")) or (
            launch is not None and "graphlaunch" in launch["name"].lower())
        phase = None
        if launch is not None:
            t = float(launch["ts"])
            phase = next((name for lo, hi, name in ranges if lo <= t <= hi), None)
        out.append(Kernel(e["name"], float(e.get("dur", 0)), in_graph, phase, _triple(args.get("grid")),
                          _triple(args.get("block")), args.get("registers per thread"),
                          args.get("shared memory")))
    return out


def cpu_ops(prof: torch.profiler.profile) -> list[Kernel]:
    """CPU activity: every op's self time (nested ops are not counted twice), with its ts:: range."""
    out = []
    for e in prof.events():
        if e.name in PHASES:
            continue
        phase, p = None, e.cpu_parent
        while p is not None:
            if p.name in PHASES:
                phase = p.name
                break
            p = p.cpu_parent
        if phase is not None:
            out.append(Kernel(e.name, float(e.self_cpu_time_total), phase=phase))
    return out


@dataclass
class Shapes:
    """What the roofline needs: matmul weights (rows N, cols K, fp8?) and the model dims."""
    linears: list[tuple[str, int, int, bool]]
    layers: int
    hidden: int
    intermediate: int
    q_heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    act_bytes: int
    kv_bytes: int


def model_shapes(runner: Any) -> Shapes:
    c = runner.config
    linears = []
    for name, mod in runner.model.named_modules():
        w = getattr(mod, "weight", None)
        if isinstance(w, torch.Tensor) and w.dim() == 2 and "embed" not in name:
            linears.append((name, int(w.shape[0]), int(w.shape[1]),
                            w.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)))
    return Shapes(linears, c.num_hidden_layers, c.hidden_size, c.intermediate_size, runner.num_heads,
                  runner.num_kv_heads, c.head_dim, c.vocab_size, runner.dtype.itemsize,
                  runner.kv_dtype.itemsize)


def roofline(s: Shapes, batch: int, rows: int, context: int, bw: float, bf16_flops: float,
             fp8_flops: float) -> dict[str, Any]:
    """Per-class floors (ms) of one decode step: `batch` requests reading `context` + 1 cached
    tokens each, `rows` rows through the matmuls (the graph's padded batch). bw in bytes/s,
    flops in FLOP/s. Activation traffic counts each kernel's reads and writes once."""
    def ms(x: float) -> float:
        return 1e3 * x

    a, m = s.act_bytes, rows
    floors = dict.fromkeys(CLASSES, 0.0)
    floors["other"] = floors["inputs"] = None  # type: ignore[assignment]
    weight_bytes = flops = 0
    for _, n, k, fp8 in s.linears:
        wb = n * k * (1 if fp8 else a)
        f = 2 * m * n * k
        moved = wb + m * k * (1 if fp8 else a) + m * n * a
        weight_bytes += wb
        flops += f
        floors["gemm_fp8" if fp8 else "gemm_bf16"] += ms(max(moved / bw, f / (fp8_flops if fp8 else bf16_flops)))
        if fp8:  # per-token quantisation of the input (bf16 in, fp8 + a scale out)
            floors["act_quant"] += ms(m * k * (a + 1) / bw)
    tokens = batch * (context + 1)
    kv_bytes = tokens * s.layers * 2 * s.kv_heads * s.head_dim * s.kv_bytes
    attn_flops = 4 * tokens * s.q_heads * s.head_dim * s.layers
    floors["attention"] = ms(max(kv_bytes / bw, attn_flops / bf16_flops))
    qkv = m * (s.q_heads + 2 * s.kv_heads) * s.head_dim
    floors["kv_write"] = ms(s.layers * (qkv * a + m * s.q_heads * s.head_dim * a
                                        + m * 2 * s.kv_heads * s.head_dim * s.kv_bytes) / bw)
    # Two residual-add + RMSNorms (read x, residual; write both) and SiLU-and-mul per layer.
    floors["norm_act"] = ms(s.layers * (2 * 4 * m * s.hidden * a + 3 * m * s.intermediate * a) / bw)
    floors["sampling"] = ms(batch * s.vocab * 4 / bw)  # greedy: one read of the fp32 logits
    return {"floors_ms": floors, "weight_bytes": weight_bytes, "kv_bytes": kv_bytes,
            "matmul_flops": flops, "attention_flops": attn_flops,
            "bytes_floor_ms": ms((weight_bytes + kv_bytes) / bw),
            "flops_floor_ms": ms(sum(2 * m * n * k / (fp8_flops if fp8 else bf16_flops)
                                     for _, n, k, fp8 in s.linears)),
            "floor_ms": sum(v for v in floors.values() if v)}


@dataclass
class Result:
    config: str
    label: str
    batch: int
    graph_batch: int | None
    context: int
    weights: str
    kv_dtype: str
    fill: str
    setup_s: float = 0.0
    replay_ms: float | None = None  # median GPU time of one graph replay (CUDA events)
    replay_ms_min: float | None = None
    replay_ms_max: float | None = None
    step_ms: float | None = None  # median wall time of ModelRunner.step
    classes_ms: dict[str, float] = field(default_factory=dict)
    graph_gaps_ms: float | None = None  # replay time not covered by the graph's own kernels
    graph_kernels: float = 0.0  # kernels a replay runs
    profiled_ms: float = 0.0  # the share's denominator: kernel time (+ gaps) per step
    attention_gbs: float | None = None
    roofline: dict[str, Any] = field(default_factory=dict)
    top: list[dict[str, Any]] = field(default_factory=list)
    attn_sweep: list[dict[str, Any]] = field(default_factory=list)  # --attn-sweep rows
    note: str = ""


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
    from tokenspeed.cuda_graph import capture_sizes

    sizes = capture_sizes(max(max_bs, batch))
    return next(s for s in sizes if s >= batch)


def capture_one(runner: Any, size: int) -> None:
    """The decode graph of `size` rows only, as ModelRunner captures each of its sizes (the
    server captures every size of its grid; the others are never replayed here)."""
    from tokenspeed.cuda_graph import DecodeGraphRunner

    graphs = DecodeGraphRunner(runner.model, runner.kv_cache, runner.backend, size,
                               runner.config.vocab_size, runner.device, runner.last_tokens)
    graphs.sizes = [size]
    graphs.capture()
    runner.graphs = graphs
    runner.cuda_graph_max_bs = size


def _median_wall_ms(fn: Any, reps: int, sync: Any) -> float:
    times = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


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


def summarize(res: Result, kernels: list[Kernel], steps: int, graphs: bool, fp8_weights: bool,
              top_n: int) -> None:
    """Fill res.classes_ms, gaps, shares' denominator, the attention GB/s and the top kernels."""
    per_class = dict.fromkeys(CLASSES, 0.0)
    groups: dict[tuple[str, Any], dict[str, Any]] = {}
    in_graph_us = 0.0
    for k in kernels:
        cls = classify(k, graphs=graphs, fp8_weights=fp8_weights)
        per_class[cls] += k.dur_us / 1e3 / steps
        if k.in_graph:
            in_graph_us += k.dur_us
            res.graph_kernels += 1 / steps
        g = groups.setdefault((k.name, k.grid), {"name": k.name, "class": cls, "calls": 0, "us": 0.0,
                                                 "grid": k.grid, "block": k.block, "regs": k.regs,
                                                 "smem": k.smem})
        g["calls"] += 1
        g["us"] += k.dur_us
    res.classes_ms = per_class
    total = sum(per_class.values())
    if graphs and res.replay_ms is not None and in_graph_us > 0:
        res.graph_gaps_ms = max(0.0, res.replay_ms - in_graph_us / 1e3 / steps)
        total += res.graph_gaps_ms
    res.profiled_ms = total
    kv = res.roofline.get("kv_bytes")
    if kv and per_class["attention"] > 0:
        res.attention_gbs = kv / (per_class["attention"] / 1e3) / 1e9
    top = sorted(groups.values(), key=lambda g: -g["us"])[:top_n]
    res.top = [{**g, "calls_per_step": g["calls"] / steps, "us_per_call": g["us"] / g["calls"],
                "ms_per_step": g["us"] / 1e3 / steps} for g in top]


def parse_grid(spec: str) -> list[tuple[int, int, int]]:
    """"64x4x2,128x4x3" -> [(block_n, num_warps, num_stages), ...]."""
    grid = []
    for item in (x.strip() for x in spec.split(",") if x.strip()):
        parts = item.split("x")
        if len(parts) != 3 or not all(p.isdigit() for p in parts):
            raise SystemExit(f"--attn-sweep: {item!r} is not BLOCKNxWARPSxSTAGES (e.g. 128x4x2)")
        grid.append((int(parts[0]), int(parts[1]), int(parts[2])))
    return grid


def attention_sweep(runner: Any, batch: int, context: int, grid: list[tuple[int, int, int]],
                    deadline: float, reps: int = 10) -> list[dict[str, Any]]:
    """paged_decode_attention alone on layer 0 of this configuration's cache (the requests' real
    page-table rows, `context` + 1 tokens each, the serving split count), at the default launch
    config and each (block_n, num_warps, num_stages) of `grid`: GPU us per call (CUDA events over
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
    for cfg in [(None, 4, 2), *grid]:  # the default first: paged_decode_attention's own config
        if time.perf_counter() > deadline:
            rows.append({"config": cfg, "skipped": "budget"})
            break
        block_n, warps, stages = cfg

        def call(b: int | None = block_n, w: int = warps, st: int = stages) -> None:
            paged_decode_attention(q, kv.k[0], kv.v[0], page_table, seq_lens, d**-0.5, out=out,
                                   num_splits=splits, block_n=b, num_warps=w, num_stages=st,
                                   k_scale=kv.k_scale[0], v_scale=kv.v_scale[0])

        try:
            call()
            if cuda:
                torch.cuda.synchronize(dev)
        except Exception as e:  # noqa: BLE001  (a config that does not compile or fit: next)
            rows.append({"config": cfg, "failed": f"{type(e).__name__}: {str(e)[:120]}"})
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
        rows.append({"config": cfg, "block_n": block_n or "default", "num_warps": warps,
                     "num_stages": stages, "num_splits": splits, "us": us,
                     "gbs": kv_bytes / us / 1e3, "ms_per_step": us * runner.config.num_hidden_layers / 1e3})
    return rows


def run_config(name: str, args: argparse.Namespace, batch: int, model_dir: str, out: Path,
               checkpoint: Callable[[Result], None]) -> Result:
    """Build, fill, time and profile one configuration; `checkpoint(res)` saves the timings
    before the profiler runs (a hang there leaves them on disk)."""
    from tokenspeed.model_runner import ModelRunner

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
    res.step_ms = _median_wall_ms(lambda: runner.step(plan), args.step_reps, sync)
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


def _f(x: float | None, spec: str = ".2f") -> str:
    return "—" if x is None else format(x, spec)


def _class_table(r: Result) -> list[str]:
    rf = r.roofline
    floors = rf.get("floors_ms", {})
    lines = ["| class | ms/step | share | floor ms | x floor |", "|---|---|---|---|---|"]
    for cls, label in CLASSES.items():
        ms = r.classes_ms.get(cls, 0.0)
        fl = floors.get(cls)
        share = ms / r.profiled_ms if r.profiled_ms else 0.0
        lines.append(f"| {label} | {ms:.3f} | {share:.1%} | {_f(fl, '.3f')} | "
                     f"{_f(ms / fl if fl else None, '.1f')} |")
    if r.graph_gaps_ms is not None:
        lines.append(f"| idle inside the graph (replay − its {r.graph_kernels:.0f} kernels) | "
                     f"{r.graph_gaps_ms:.3f} | {r.graph_gaps_ms / r.profiled_ms:.1%} | 0 | — |")
    lines += [(f"| **total** | **{r.profiled_ms:.3f}** | 100% | {_f(rf.get('floor_ms'), '.3f')} | "
               f"{_f(r.profiled_ms / rf['floor_ms'] if rf.get('floor_ms') else None, '.1f')} |"), ""]
    if r.top:
        lines += ["| top kernels | class | calls/step | us/call | ms/step | grid | block | regs | smem |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for t in r.top:
            lines.append(f"| `{t['name'][:90]}` | {t['class']} | {t['calls_per_step']:g} | "
                         f"{t['us_per_call']:.1f} | {t['ms_per_step']:.3f} | {t['grid'] or ''} | "
                         f"{t['block'] or ''} | {t['regs'] or ''} | {t['smem'] or ''} |")
        lines.append("")
    return lines


def _sweep_table(r: Result) -> list[str]:
    if not r.attn_sweep:
        return []
    lines = [(f"decode attention alone, layer 0, {r.batch} requests x {r.context + 1} tokens, by "
              "launch config (block_n x warps x stages):"), "",
             "| config | splits | us / layer | GB/s | x layers, ms/step |", "|---|---|---|---|---|"]
    for a in r.attn_sweep:
        cfg = ("default (the kernel's)" if a["config"][0] is None
               else "x".join(str(c) for c in a["config"]))
        if "us" in a:
            lines.append(f"| {cfg} | {a['num_splits']} | {a['us']:.1f} | {a['gbs']:,.0f} | "
                         f"{a['ms_per_step']:.2f} |")
        else:
            lines.append(f"| {cfg} | | {a.get('failed') or 'skipped: ' + a.get('skipped', '')} | | |")
    return [*lines, ""]


def markdown(results: list[Result], skipped: list[str], meta: dict[str, Any]) -> str:
    lines = ["# Decode step by kernel class (benches/profile_decode_kernels.py)", "",
             (f"{meta['device']}; {meta['model']} ({meta['layers']} layers, dummy weights), "
              f"context {meta['context']} tokens per request, fill `{meta['fill']}`, "
              f"{meta['attention_backend'] or 'default'} attention; roofline at {meta['hbm_tbs']} TB/s, "
              f"{meta['bf16_tflops']} TFLOP/s bf16, {meta['fp8_tflops']} fp8. ms are per step."), ""]
    for r in results:
        rf = r.roofline
        lines += [f"## {r.label}: batch {r.batch}"
                  + (f" (graph of {r.graph_batch})" if r.graph_batch else ""), ""]
        lines.append(f"graph replay {_f(r.replay_ms)} ms (median of replays; min {_f(r.replay_ms_min)}, "
                     f"max {_f(r.replay_ms_max)}); whole step {_f(r.step_ms)} ms "
                     f"= {r.batch / r.step_ms * 1e3:,.0f} tok/s at this batch; set-up {r.setup_s:.1f} s"
                     if r.step_ms else "no timing")
        if rf:
            lines.append(
                f"roofline: weights {rf['weight_bytes'] / 1e9:.3g} GB + KV {rf['kv_bytes'] / 1e9:.3g} GB"
                f" per step = {rf['bytes_floor_ms']:.2f} ms at the bandwidth; matmuls "
                f"{rf['matmul_flops'] / 1e12:.3g} TFLOP = {rf['flops_floor_ms']:.2f} ms at the peak; "
                f"sum of class floors {rf['floor_ms']:.2f} ms")
        if r.attention_gbs is not None:
            lines.append(f"decode attention: {rf['kv_bytes'] / 1e9:.3g} GB of KV in "
                         f"{r.classes_ms['attention']:.2f} ms = **{r.attention_gbs:,.0f} GB/s**")
        if r.note:
            lines.append(f"note:{r.note}")
        lines += [""] + (_class_table(r) if r.classes_ms else
                         ["no kernel profile (--profile none, or the profiler did not finish)", ""])
        lines += _sweep_table(r)
    for s in skipped:
        lines.append(f"- skipped: {s}")
    return "\n".join(lines) + "\n"


def write_outputs(out: Path, results: list[Result], skipped: list[str], meta: dict[str, Any]) -> str:
    md = markdown(results, skipped, meta)
    (out / "profile_decode_kernels.md").write_text(md)
    (out / "profile_decode_kernels.json").write_text(json.dumps(
        {"meta": meta, "classes": CLASSES, "configs": [asdict(r) for r in results], "skipped": skipped},
        indent=1, default=str))
    return md


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
