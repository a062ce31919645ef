"""FP8 linear kernels vs bf16 at Llama-3.1-8B shapes (GPU only): decode (M = 1..8) and prefill-sized M.

Implementations (GPU us per call, weights cycled over copies > 5x L2 so they come from DRAM, timed
inside CUDA graphs with bench_kernels.graph_ms, as bench_gemv.py does):
  bf16        F.linear (cuBLAS), the bf16 baseline
  bf16_gemv   skinny_linear (the runtime's bf16 path for M <= 8)
  fp8_gemv    skinny_linear(weight_scale=): fp8 weights, bf16 activations (runtime, M <= 8)
  fp8_gemv_bf16cfg the same with the tile bf16 weights get (what the runtime used before the fp8
              tiles: the comparison in one run)
  scaled_mm   per_token_quant_fp8 + torch._scaled_mm row-wise, fast accumulation (runtime, M > 8)
  mm_only     torch._scaled_mm alone (activations already fp8), cuBLAS's default accumulation
              (promoted to fp32 periodically; the runtime before session 21, TOKENSPEED_FP8_GEMM=cublas_promote)
  mm_fast     the same with use_fast_accum=True (Hopper's fp8 fast accumulation: the runtime's)
  triton_mm   per_token_quant_fp8 + tokenspeed_kernels.fp8_matmul (TOKENSPEED_FP8_GEMM=triton)
"whole step" = 32 x (qkv + o_proj + gate_up + down) + lm_head, each column with its own kernel
(the lm_head too: --quantization fp8 quantises it by default, --lm-head-quantization). Each fp8 result is checked against the fp32 matmul of
the dequantised weights (and, for W8A8, of the exact activations: per-token rounding adds ~1-2%).

Run: cd kernels && PYTHONPATH=.:../python python3 bench/bench_fp8.py [--ms 1,2,4,8,64,512,4096] [--out f.jsonl]
--sweep [--budget-s 240]: instead, time a grid of fp8 GEMV configs (tiles, warps, stages, split-K,
programmatic dependent launch) per (shape, M), the lm_head included, and print the full table (us
and GB/s), the best per shape, the whole-step sums (the runtime's table vs best per class vs best
per shape) and a block of gemv.FP8_TILES rows to paste: the data for gemv._pick_config's fp8 rows.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import traceback
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench_kernels import graph_ms, rel_err

from tokenspeed_kernels import fp8_matmul, gemv, per_token_quant_fp8, skinny_linear

LAYERS = 32
SHAPES = [("qkv", 6144, 4096), ("o_proj", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336),
          ("lm_head", 128256, 4096)]  # fmt: skip
COLD_BYTES = 256 << 20
DEVICE = "cuda"  # the sweep's CPU smoke test (interpreter) sets "cpu"
FP8 = torch.float8_e4m3fn
GEMV_MAX_M = 8
TOL = {"bf16_gemv": 2e-2, "fp8_gemv": 2e-2, "fp8_gemv_bf16cfg": 2e-2, "scaled_mm": 5e-2, "mm_only": 5e-2, "mm_fast": 5e-2, "triton_mm": 5e-2}


def per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    s = w.float().abs().amax(dim=1).clamp_min(1e-12) / 448.0
    return (w.float() / s[:, None]).clamp(-448, 448).to(FP8), s


def scaled_mm(xq: torch.Tensor, xs: torch.Tensor, w: torch.Tensor, ws: torch.Tensor,
              fast_accum: bool = False) -> torch.Tensor:
    return torch._scaled_mm(xq, w.t(), scale_a=xs.view(-1, 1), scale_b=ws.view(1, -1), out_dtype=torch.bfloat16,
                            use_fast_accum=fast_accum)


def impls_for(m: int, n: int, k: int) -> dict[str, Callable[[torch.Tensor, torch.Tensor, Any], torch.Tensor]]:
    """name -> fn(x, w_bf16, (w_fp8, w_scale, x_fp8, x_scale))."""
    out: dict[str, Callable[..., torch.Tensor]] = {"bf16": lambda x, w, q: F.linear(x, w)}
    if m <= 16:
        cfg = gemv._pick_config(m, n, k, torch.bfloat16, torch.cuda.get_device_properties(0).multi_processor_count)
        out["bf16_gemv"] = lambda x, w, q: skinny_linear(x, w)
        out["fp8_gemv"] = lambda x, w, q: skinny_linear(x, q[0], weight_scale=q[1])
        out["fp8_gemv_bf16cfg"] = lambda x, w, q: skinny_linear(x, q[0], weight_scale=q[1], config=cfg)
    out["scaled_mm"] = lambda x, w, q: scaled_mm(*per_token_quant_fp8(x), q[0], q[1], fast_accum=True)
    out["mm_only"] = lambda x, w, q: scaled_mm(q[2], q[3], q[0], q[1])
    out["mm_fast"] = lambda x, w, q: scaled_mm(q[2], q[3], q[0], q[1], fast_accum=True)
    out["triton_mm"] = lambda x, w, q: fp8_matmul(*per_token_quant_fp8(x), q[0], q[1], torch.bfloat16)
    return out


def _fma_fits(bn: int, bm: int, bk: int, warps: int, regs: int = 256) -> bool:
    """The fma product tile BLOCK_N x BLOCK_M x BLOCK_K is at most `regs` fp32 values per thread
    (the compiler never holds it all at once: 256 admits the M=2 tile n4 k1024 w1 that won before)."""
    return bn * bm * bk <= regs * 32 * warps


def sweep_configs(m: int) -> list[gemv.GemvConfig]:
    """The grid for one M: fma tiles (BLOCK_N, BLOCK_K, warps) of a bounded per-thread product (at
    M=1 mostly in gemv's flat 2D form, "fma-2d"), a few with software pipelining (num_stages) or the reduce-once accumulator, split-K
    (2 and 4 K slices, for the shapes with few row blocks), and tensor-core (dot) tiles for M >= 2.
    M=1 (batch-1 decode, S3) gets the richest grid. Programmatic dependent launch twins of the best
    tiles are added by sweep() after the first pass."""
    C = gemv.GemvConfig
    bm = triton.next_power_of_2(m)
    flat: list[tuple[int, int, int]] = []
    if m == 1:  # flat (2D) tiles, and the 3D form of the session-6 winners for comparison
        flat = [(1, 1024, 1), (1, 2048, 1), (1, 4096, 1), (2, 512, 1), (2, 1024, 1), (2, 2048, 1), (2, 2048, 2),
                (2, 4096, 2), (4, 512, 1), (4, 1024, 1), (4, 1024, 2), (4, 2048, 2), (4, 2048, 4), (4, 4096, 4),
                (8, 512, 1), (8, 1024, 2), (8, 1024, 4), (8, 2048, 4), (16, 512, 4), (16, 1024, 4)]
        fma = [(1, 1024, 1), (2, 1024, 1), (4, 1024, 1), (4, 2048, 2)]
        staged = [(2, 1024, 1, 2), (2, 1024, 1, 3), (4, 1024, 2, 2), (4, 2048, 2, 2)]
        once = [(2, 1024, 1), (4, 1024, 2), (4, 2048, 2)]
        split = [(2, 1024, 1, 2), (4, 1024, 2, 2), (4, 2048, 2, 2), (4, 1024, 2, 4), (8, 1024, 4, 4)]
        dots: list[tuple[int, int, int, int, int]] = []
    elif m == 2:
        fma = [(2, 1024, 1), (4, 512, 1), (4, 1024, 1), (4, 1024, 2), (4, 2048, 2), (8, 512, 1), (8, 512, 2),
               (8, 1024, 2), (8, 1024, 4), (16, 512, 4)]
        staged = [(4, 1024, 1, 2)]
        once = [(4, 512, 1), (4, 1024, 2)]
        split = [(4, 1024, 1, 2), (8, 1024, 2, 2)]
        dots = [(32, 256, 4, 3, 1), (64, 256, 4, 4, 1), (128, 128, 8, 4, 1)]
    else:
        fma = [(2, 512, 1), (4, 256, 1), (4, 512, 1), (4, 512, 2), (4, 1024, 2), (8, 256, 2), (8, 512, 4)]
        staged = []
        once = [(4, 256, 1), (4, 512, 2)]
        split = [(4, 512, 2, 2)]
        dots = [(16, 256, 4, 4, 1), (32, 256, 4, 3, 1), (64, 128, 4, 4, 1), (64, 256, 4, 4, 1), (128, 128, 8, 4, 1),
                (64, 256, 4, 4, 2), (32, 256, 4, 3, 2)]
    f = m == 1  # the staged / reduce-once / split variants take the flat form at M=1
    out = [C(block_n=bn, block_k=bk, num_warps=w, flat=True) for bn, bk, w in flat]
    out += [C(block_n=bn, block_k=bk, num_warps=w) for bn, bk, w in fma if _fma_fits(bn, bm, bk, w)]
    out += [C(block_n=bn, block_k=bk, num_warps=w, num_stages=st, flat=f) for bn, bk, w, st in staged
            if _fma_fits(bn, bm, bk, w)]
    out += [C(block_n=bn, block_k=bk, num_warps=w, reduce_once=True, flat=f) for bn, bk, w in once
            if _fma_fits(bn, bm, bk, w, 128)]
    out += [C(block_n=bn, block_k=bk, num_warps=w, split_k=sk, flat=f) for bn, bk, w, sk in split
            if _fma_fits(bn, bm, bk, w)]
    out += [C(block_n=bn, block_k=bk, num_warps=w, num_stages=st, use_dot=True, split_k=sk)
            for bn, bk, w, st, sk in dots]
    return out


def cfg_name(c: gemv.GemvConfig) -> str:
    kind = "dot" if c.use_dot else ("fma1" if c.reduce_once else "fma") + ("-2d" if c.flat else "")
    return (f"{kind} n{c.block_n} k{c.block_k} w{c.num_warps} s{c.num_stages}"
            + (f" split{c.split_k}" if c.split_k > 1 else "") + (" pdl" if c.pdl else ""))


def cfg_src(c: gemv.GemvConfig) -> str:
    """The config as gemv.py's FP8_TILES spells it (_C(...), default fields left out)."""
    default = gemv.GemvConfig()
    args = [f"{f}={getattr(c, f)!r}" for f in ("block_n", "block_k", "num_warps")]
    args += [f"{f}={getattr(c, f)!r}" for f in ("num_stages", "use_dot", "split_k", "reduce_once", "pdl", "flat")
             if getattr(c, f) != getattr(default, f)]
    return "_C(" + ", ".join(args) + ")"


def _time_config(cfg: gemv.GemvConfig, m: int, data: dict[str, Any], xs: dict[str, torch.Tensor],
                 srcs: dict[str, torch.Tensor], refs: dict[str, torch.Tensor],
                 into: dict[gemv.GemvConfig, dict[str, float]], chained: bool) -> int:
    """Check, then time one config on every shape (us into into[cfg][shape]); returns the number of
    wrong results. chained: a producer kernel (torch.mul) writes a copy of x into a buffer of its
    own right before each GEMV reads it (xs stays as the references saw it)."""
    failures = 0
    for name, n, k in SHAPES:
        ws, x = data[name][2], xs[name]
        try:
            if not chained:
                err = rel_err(skinny_linear(x, ws[0][0], weight_scale=ws[0][1], config=cfg), refs[name])
                if err > TOL["fp8_gemv"]:
                    failures += 1
                    print(f"  {name} M={m} {cfg_name(cfg)}: ERR {err:.1e}", flush=True)
                    continue
            calls = max(2 * len(ws), min(256, math.ceil(4.0 / (n * k / 2.5e9))))
            if chained:
                fns = [lambda q=q, s=sc, xc=srcs[name], x=x: (torch.mul(x, 1.0, out=xc),
                                                              skinny_linear(xc, q, weight_scale=s, config=cfg))
                       for q, sc in ws]
            else:
                fns = [lambda q=q, s=sc, x=x: skinny_linear(x, q, weight_scale=s, config=cfg) for q, sc in ws]
            into.setdefault(cfg, {})[name] = graph_ms(fns, calls, 7) * 1e3
        except Exception as e:  # noqa: BLE001 - a config that does not compile or launch: report, go on
            print(f"  {name} M={m} {cfg_name(cfg)}: FAILED {str(e)[:160]}", flush=True)
    return failures


def sweep(ms: list[int], out_path: str | None, budget_s: float) -> int:
    """Time the grid of fp8 GEMV configs per (shape, M), weights from DRAM; print the full table
    (us and GB/s per shape and config), the best per shape, the whole-step sums and an FP8_TILES
    block for gemv.py. Two passes per M: the grid (plus the table's own entries), then PDL twins
    of each shape's two best tiles, also timed as a chain behind a small producer kernel (x
    rewritten before each GEMV, as rmsnorm -> qkv in the model)."""
    import time

    t_start = time.monotonic()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    per_step = {name: (1 if name == "lm_head" else LAYERS) for name, _, _ in SHAPES}
    byte = {name: n * k for name, n, k in SHAPES}
    klass = {name: gemv.fp8_shape_class(n, k) for name, n, k in SHAPES}
    rows: list[dict[str, Any]] = []
    failures = 0
    data = {}
    for name, n, k in SHAPES:
        copies = max(2, math.ceil(COLD_BYTES / (n * k)))
        ws = [per_channel(torch.randn(n, k, device=DEVICE, dtype=torch.bfloat16) * k**-0.5) for _ in range(copies)]
        data[name] = (n, k, ws)
    print(f"device: {torch.cuda.get_device_name()}, {sms} SMs, torch {torch.__version__}, triton {triton.__version__}; "
          f"PDL available: {gemv.HAS_PDL}", flush=True)
    suggestions: dict[tuple[int, str], tuple[gemv.GemvConfig, str]] = {}
    summary: list[str] = []
    # The budget is shared out by grid size (M=1 has the largest grid), so every M gets its turn.
    sizes = [(len(sweep_configs(m)) + 8) * (1.5 if m == 1 else 1.0) for m in ms]  # M=1: S3's batch
    for i, m in enumerate(ms):
        deadline = t_start + budget_s * sum(sizes[: i + 1]) / sum(sizes)
        xs = {name: torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16) for name, _, k in SHAPES}
        srcs = {name: torch.empty_like(x) for name, x in xs.items()}  # the chained GEMVs' x buffers
        refs = {name: xs[name].float() @ (ws[0][0].float() * ws[0][1][:, None]).T
                for name, (_, _, ws) in data.items()}
        table: dict[gemv.GemvConfig, dict[str, float]] = {}
        chain: dict[gemv.GemvConfig, dict[str, float]] = {}
        picked = {name: gemv._pick_config(m, n, k, torch.bfloat16, sms, True) for name, n, k in SHAPES}

        ctx = (m, data, xs, srcs, refs)
        configs = list(dict.fromkeys([*picked.values(), *sweep_configs(m)]))  # the table's entries first
        skipped = 0
        for cfg in configs:
            if time.monotonic() > deadline:
                skipped += 1
                continue
            failures += _time_config(cfg, *ctx, table, False)
        # Pass 2: PDL twins of each shape's two best tiles (and the table's), plain and chained.
        best2 = {c for name, _, _ in SHAPES for _, c in sorted((t[name], c) for c, t in table.items() if name in t)[:2]}
        twins = [replace(c, pdl=True) for c in dict.fromkeys([*picked.values(), *sorted(best2, key=cfg_name)])]
        for cfg in twins:
            if time.monotonic() > deadline + 10:  # the twins may run a little over
                skipped += 1
                continue
            failures += _time_config(cfg, *ctx, table, False)
            failures += _time_config(replace(cfg, pdl=False), *ctx, chain, True)
            failures += _time_config(cfg, *ctx, chain, True)
        if skipped:
            summary.append(f"  (M={m}: its share of the {budget_s:.0f} s budget ran out: {skipped} configs not timed)")

        # Full table, best layer sum first.
        def step_us(t: dict[str, float]) -> float:
            return sum(per_step[nm] * t[nm] for nm, _, _ in SHAPES)

        print(f"\nM={m}: fp8 GEMV, us per call (GB/s), weights from DRAM; * = the runtime's FP8_TILES entry "
              f"for the shape; step = 32 x (qkv + o + gate_up + down) + lm_head")
        print("| config | " + " | ".join(f"{nm} {n}x{k}" for nm, n, k in SHAPES) + " | step ms |")
        print("|---|" + "---|" * (len(SHAPES) + 1))
        full = sorted(table.items(), key=lambda kv: step_us(kv[1]) if len(kv[1]) == len(SHAPES) else 1e12)
        for cfg, t in full:
            cells = [(f"{t[nm]:.1f}{'*' if picked[nm] == cfg else ''} ({byte[nm] / t[nm] / 1e3:.0f})" if nm in t else "-")
                     for nm, _, _ in SHAPES]
            total = f"{step_us(t) / 1e3:.3f}" if len(t) == len(SHAPES) else "-"
            print(f"| {cfg_name(cfg)} | " + " | ".join(cells) + f" | {total} |")
        if chain:
            print(f"\nM={m}, chained behind a producer kernel (us per producer + GEMV pair), PDL off vs on:")
            for cfg in twins:
                off, on = chain.get(replace(cfg, pdl=False), {}), chain.get(cfg, {})
                print(f"| {cfg_name(replace(cfg, pdl=False))} | " + " | ".join(
                    f"{nm} {off.get(nm, float('nan')):.1f} -> {on.get(nm, float('nan')):.1f}" for nm, _, _ in SHAPES) + " |")
        # Best per shape, per class; whole step: the table vs best per class vs best per shape.
        best = {nm: min(((t[nm], c) for c, t in table.items() if nm in t), key=lambda v: v[0], default=None)
                for nm, _, _ in SHAPES}
        summary.append(f"M={m} best per shape, us and GB/s [the runtime's FP8_TILES entry]:")
        for nm, _, _ in SHAPES:
            dflt = table.get(picked[nm], {}).get(nm, float("nan"))
            if best[nm] is not None:
                t, c = best[nm]
                summary.append(f"  {nm:8s} {cfg_name(c):30s} {t:6.1f} us {byte[nm] / t / 1e3:5.0f} GB/s  "
                               f"[{cfg_name(picked[nm])} {dflt:.1f} us {byte[nm] / dflt / 1e3:.0f} GB/s]")
        step_default = sum(per_step[nm] * table.get(picked[nm], {}).get(nm, float("nan")) for nm, _, _ in SHAPES)
        step_best = sum(per_step[nm] * best[nm][0] for nm, _, _ in SHAPES if best[nm] is not None)
        step_class = 0.0
        for cls in dict.fromkeys(klass.values()):
            names = [nm for nm in klass if klass[nm] == cls]
            cands = [(sum(per_step[nm] * t[nm] for nm in names), c) for c, t in table.items()
                     if all(nm in t for nm in names)]
            if not cands:
                continue
            v, c = min(cands, key=lambda vc: vc[0])
            step_class += v
            suggestions[(gemv.fp8_bucket(m), cls)] = (c, ", ".join(f"{nm} {table[c][nm]:.1f}" for nm in names))
        summary.append(f"  step matmuls: table {step_default / 1e3:.3f} ms, best per class {step_class / 1e3:.3f} "
                       f"ms, best per shape {step_best / 1e3:.3f} ms")
        print(f"M={m} done, {time.monotonic() - t_start:.0f} s", flush=True)
        rows.append({"m": m, "default": {nm: cfg_name(c) for nm, c in picked.items()},
                     "table": {cfg_name(c): t for c, t in table.items()},
                     "chain": {cfg_name(c): t for c, t in chain.items()}})
    print("\n" + "\n".join(summary))
    print(f"\nFP8_TILES rows measured here (best per class, weighted by calls per step; paste into "
          f"kernels/tokenspeed_kernels/gemv.py, M={','.join(map(str, ms))}, {torch.cuda.get_device_name()}):")
    for (bucket, cls), (c, note) in sorted(suggestions.items()):
        print(f"    ({bucket}, {cls!r}): {cfg_src(c)},  # {note} us")
    if out_path:
        with open(out_path, "w") as f:
            f.writelines(json.dumps({"device": torch.cuda.get_device_name(), "sweep": True, **r}) + "\n" for r in rows)
    print(f"{failures} failures; {time.monotonic() - t_start:.0f} s")
    return 1 if failures else 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", default="1,2,4,8,64,512,4096")
    ap.add_argument("--out", default=None)
    ap.add_argument("--sweep", action="store_true", help="fp8 GEMV config sweep (M <= 8)")
    ap.add_argument("--budget-s", type=float, default=240.0,
                    help="--sweep: stop timing new configs after this many seconds (the tables still print)")
    args = ap.parse_args()
    ms = [int(v) for v in args.ms.split(",")]
    if args.sweep:
        return sweep([m for m in ms if m <= GEMV_MAX_M], args.out, args.budget_s)
    rows: list[dict[str, Any]] = []
    step: dict[int, dict[str, float]] = {m: {} for m in ms}
    failures = 0
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    for name, n, k in SHAPES:
        copies = max(2, math.ceil(COLD_BYTES / (n * k * 2)))
        ws = [torch.randn(n, k, device=DEVICE, dtype=torch.bfloat16) * k**-0.5 for _ in range(copies)]
        qs = [per_channel(w) for w in ws]
        mult = 1 if name == "lm_head" else LAYERS
        for m in ms:
            xs = [torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16) for _ in ws]
            packs = [(q, s, *per_token_quant_fp8(x)) for (q, s), x in zip(qs, xs)]
            ref = xs[0].float() @ (qs[0][0].float() * qs[0][1][:, None]).T
            ref16 = xs[0].float() @ ws[0].float().T  # bf16_gemv multiplies the bf16 weights
            # The fp8 operands multiplied exactly: what the accumulation alone adds (mm_only vs mm_fast).
            xq, xsc = packs[0][2], packs[0][3]
            refq = (xq.double() * xsc.double()[:, None]) @ (qs[0][0].double() * qs[0][1].double()[:, None]).T
            row: dict[str, Any] = {"shape": name, "n": n, "k": k, "m": m}
            cells = []
            for impl, fn in impls_for(m, n, k).items():
                try:
                    if impl != "bf16":
                        err = rel_err(fn(xs[0], ws[0], packs[0]), ref16 if impl == "bf16_gemv" else ref)
                        row[f"{impl}_err"] = err
                        if impl in ("mm_only", "mm_fast"):
                            row[f"{impl}_accum_err"] = rel_err(fn(xs[0], ws[0], packs[0]), refq)
                        if err > TOL[impl]:
                            failures += 1
                            cells.append(f"{impl} ERR {err:.1e}")
                    calls = max(2 * copies, min(256, math.ceil(4.0 / (n * k * 2 / 2.5e9))))
                    fns = [lambda x=x, w=w, p=p, fn=fn: fn(x, w, p) for x, w, p in zip(xs, ws, packs)]
                    us = graph_ms(fns, calls, 10) * 1e3
                    row[f"{impl}_us"] = us
                    cells.append(f"{impl} {us:.1f}" + (f" (accum err {row[f'{impl}_accum_err']:.1e})"
                                                       if f"{impl}_accum_err" in row else ""))
                    step[m][impl] = step[m].get(impl, 0.0) + mult * us / 1e3
                except Exception as e:  # noqa: BLE001 - report, go on
                    failures += 1
                    row[f"{impl}_error"] = repr(e)
                    cells.append(f"{impl} FAILED {e!r}")
                    traceback.print_exc()
            print(f"| {name} {n}x{k} | M={m} | " + " | ".join(cells) + " |", flush=True)
            rows.append(row)
        del ws, qs
        torch.cuda.empty_cache()
    print("\nwhole step, ms (32 x (qkv + o_proj + gate_up + down) + lm_head):")
    for m in ms:
        print(f"| M={m} | " + " | ".join(f"{k} {v:.3f}" for k, v in step[m].items()) + " |")
        rows.append({"shape": "decode_step", "m": m, **{f"{k}_ms": v for k, v in step[m].items()}})
    print(f"{len(rows)} rows, {failures} failures")
    if args.out:
        with open(args.out, "w") as f:
            f.writelines(json.dumps({"device": torch.cuda.get_device_name(), **r}) + "\n" for r in rows)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
