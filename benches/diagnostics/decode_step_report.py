"""The analysis half of benches/diagnostics/profile_decode_kernels.py: a decode step's kernels from a
torch.profiler trace, grouped into classes, against a roofline per class, and the report
(markdown and json). Pure functions of their inputs: tested on CPU (tests/test_bench_scripts.py)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

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
              "launch config (block_n x warps x stages; h: an fp8 cache's dots in fp16):"), "",
             "| config | splits | us / layer | GB/s | x layers, ms/step |", "|---|---|---|---|---|"]
    for a in r.attn_sweep:
        cfg = ("default (the kernel's)" if a["config"][0] is None
               else "x".join(str(c) for c in a["config"])) + ("h" if a.get("f16_dots") else "")
        if "us" in a:
            lines.append(f"| {cfg} | {a['num_splits']} | {a['us']:.1f} | {a['gbs']:,.0f} | "
                         f"{a['ms_per_step']:.2f} |")
        else:
            lines.append(f"| {cfg} | | {a.get('failed') or 'skipped: ' + a.get('skipped', '')} | | |")
    return [*lines, ""]


def markdown(results: list[Result], skipped: list[str], meta: dict[str, Any]) -> str:
    lines = ["# Decode step by kernel class (benches/diagnostics/profile_decode_kernels.py)", "",
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
