"""FP8 linear kernels vs bf16 at Llama-3.1-8B shapes (GPU only): decode (M = 1..8) and prefill-sized M.

Implementations (GPU us per call, weights cycled over copies > 5x L2 so they come from DRAM, timed
inside CUDA graphs with bench_kernels.graph_ms, as bench_gemv.py does):
  bf16        F.linear (cuBLAS), the bf16 baseline
  bf16_gemv   skinny_linear (the runtime's bf16 path for M <= 8)
  fp8_gemv    skinny_linear(weight_scale=): fp8 weights, bf16 activations (runtime, M <= 8)
  fp8_gemv_bf16cfg the same with the tile bf16 weights get (what the runtime used before the fp8
              tiles: the comparison in one run)
  scaled_mm   per_token_quant_fp8 + torch._scaled_mm row-wise (runtime, M > 8)
  mm_only     torch._scaled_mm alone (activations already fp8): the cuBLAS kernel's own time
  triton_mm   per_token_quant_fp8 + tokenspeed_kernels.fp8_matmul (TOKENSPEED_FP8_GEMM=triton)
"whole step" = 32 x (qkv + o_proj + gate_up + down) + lm_head (lm_head stays bf16 in the runtime:
its bf16 time is used in every column). Each fp8 result is checked against the fp32 matmul of
the dequantised weights (and, for W8A8, of the exact activations: per-token rounding adds ~1-2%).

Run: cd kernels && PYTHONPATH=.:../python python3 bench/bench_fp8.py [--ms 1,2,4,8,64,512,4096] [--out f.jsonl]
--sweep: instead, time a grid of fp8 GEMV configs per (layer shape, M) and print the best ones, the
per-layer sums (default config vs best per shape vs the best single config) and the GB/s reached:
the data for gemv._pick_config's fp8 rows.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import traceback
from collections.abc import Callable
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
FP8 = torch.float8_e4m3fn
GEMV_MAX_M = 8
TOL = {"bf16_gemv": 2e-2, "fp8_gemv": 2e-2, "fp8_gemv_bf16cfg": 2e-2, "scaled_mm": 5e-2, "mm_only": 5e-2, "triton_mm": 5e-2}


def per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    s = w.float().abs().amax(dim=1).clamp_min(1e-12) / 448.0
    return (w.float() / s[:, None]).clamp(-448, 448).to(FP8), s


def scaled_mm(xq: torch.Tensor, xs: torch.Tensor, w: torch.Tensor, ws: torch.Tensor) -> torch.Tensor:
    return torch._scaled_mm(xq, w.t(), scale_a=xs.view(-1, 1), scale_b=ws.view(1, -1), out_dtype=torch.bfloat16)


def impls_for(m: int, n: int, k: int) -> dict[str, Callable[[torch.Tensor, torch.Tensor, Any], torch.Tensor]]:
    """name -> fn(x, w_bf16, (w_fp8, w_scale, x_fp8, x_scale))."""
    out: dict[str, Callable[..., torch.Tensor]] = {"bf16": lambda x, w, q: F.linear(x, w)}
    if m <= 16:
        cfg = gemv._pick_config(m, n, k, torch.bfloat16, torch.cuda.get_device_properties(0).multi_processor_count)
        out["bf16_gemv"] = lambda x, w, q: skinny_linear(x, w)
        out["fp8_gemv"] = lambda x, w, q: skinny_linear(x, q[0], weight_scale=q[1])
        out["fp8_gemv_bf16cfg"] = lambda x, w, q: skinny_linear(x, q[0], weight_scale=q[1], config=cfg)
    out["scaled_mm"] = lambda x, w, q: scaled_mm(*per_token_quant_fp8(x), q[0], q[1])
    out["mm_only"] = lambda x, w, q: scaled_mm(q[2], q[3], q[0], q[1])
    out["triton_mm"] = lambda x, w, q: fp8_matmul(*per_token_quant_fp8(x), q[0], q[1], torch.bfloat16)
    return out


def sweep_configs(m: int) -> list[gemv.GemvConfig]:
    """fma tiles (BLOCK_N, BLOCK_K, warps) whose per-thread product BLOCK_N x BLOCK_M x BLOCK_K /
    threads fits in 128 registers, some with the reduce-once accumulator, and a few tensor-core
    (dot) tiles for M >= 2."""
    block_m = triton.next_power_of_2(m)
    if m <= 2:
        fma = [(1, 1024, 1), (1, 2048, 1), (2, 1024, 1), (2, 2048, 1), (4, 512, 1), (4, 1024, 1), (4, 1024, 2),
               (4, 2048, 2), (8, 512, 1), (8, 512, 2), (8, 1024, 2), (8, 1024, 4), (16, 512, 4), (16, 1024, 4)]
        once = [(2, 1024, 1), (4, 512, 1), (4, 1024, 2), (8, 512, 2)]
    else:
        fma = [(2, 512, 1), (4, 256, 1), (4, 512, 1), (4, 512, 2), (8, 256, 2), (8, 512, 4)]
        once = [(4, 256, 1), (4, 512, 2)]
    ok = [t for t in fma if t[0] * block_m * t[1] <= 128 * 32 * t[2]]
    out = [gemv.GemvConfig(block_n=bn, block_k=bk, num_warps=w) for bn, bk, w in ok]
    out += [gemv.GemvConfig(block_n=bn, block_k=bk, num_warps=w, reduce_once=True) for bn, bk, w in once
            if bn * block_m * bk <= 64 * 32 * w]
    if m >= 2:
        for bn, bk, warps, stages in ((32, 256, 4, 3), (64, 256, 4, 4), (128, 128, 8, 4)):
            out.append(gemv.GemvConfig(block_n=bn, block_k=bk, num_warps=warps, num_stages=stages, use_dot=True))
    return out


def cfg_name(c: gemv.GemvConfig) -> str:
    kind = "dot" if c.use_dot else ("fma1" if c.reduce_once else "fma")
    return f"{kind} n{c.block_n} k{c.block_k} w{c.num_warps} s{c.num_stages}" + (f" split{c.split_k}" if c.split_k > 1 else "")


def sweep(ms: list[int], out_path: str | None) -> int:
    """Time every sweep config of the fp8 GEMV per layer shape and M (weights from DRAM)."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    shapes = [s for s in SHAPES if s[0] != "lm_head"]
    rows: list[dict[str, Any]] = []
    failures = 0
    data = {}
    for name, n, k in shapes:
        copies = max(2, math.ceil(COLD_BYTES / (n * k)))
        ws = [per_channel(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5) for _ in range(copies)]
        data[name] = (n, k, ws)
    for m in ms:
        xs = [torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for _, _, k in shapes]
        table: dict[str, dict[str, float]] = {}
        picked = {name: gemv._pick_config(m, n, k, torch.bfloat16, sms, True) for name, n, k in shapes}
        default = {name: cfg_name(c) for name, c in picked.items()}
        refs = {name: x.float() @ (data[name][2][0][0].float() * data[name][2][0][1][:, None]).T
                for (name, _, _), x in zip(shapes, xs)}
        configs = sweep_configs(m)
        configs += [c for c in dict.fromkeys(picked.values()) if c not in configs]  # the defaults too
        for cfg in configs:
            cname = cfg_name(cfg)
            for (name, n, k), x in zip(shapes, xs):
                ws = data[name][2]
                try:
                    err = rel_err(skinny_linear(x, ws[0][0], weight_scale=ws[0][1], config=cfg), refs[name])
                    if err > TOL["fp8_gemv"]:
                        failures += 1
                        print(f"  {name} M={m} {cname}: ERR {err:.1e}")
                        continue
                    fns = [lambda q=q, s=sc, cfg=cfg, x=x: skinny_linear(x, q, weight_scale=s, config=cfg)
                           for q, sc in ws]
                    calls = max(2 * len(ws), min(256, math.ceil(4.0 / (n * k / 2.5e9))))
                    table.setdefault(cname, {})[name] = graph_ms(fns, calls, 7) * 1e3
                except Exception as e:  # noqa: BLE001 - a config that does not compile: report, go on
                    print(f"  {name} M={m} {cname}: FAILED {str(e)[:120]}")
        byte = {name: n * k for name, n, k in shapes}
        layer_bytes = sum(byte.values())
        print(f"\nM={m}: fp8 GEMV sweep, us per call (weights from DRAM); the runtime default marked *")
        for name, _, _ in shapes:
            best = sorted((t[name], c) for c, t in table.items() if name in t)[:4]
            dflt = table.get(default[name], {}).get(name, float("nan"))
            print(f"| {name} | default* {default[name]} {dflt:.1f} us ({byte[name] / dflt / 1e3:.0f} GB/s) | best: "
                  + " | ".join(f"{c} {t:.1f} ({byte[name] / t / 1e3:.0f} GB/s)" for t, c in best) + " |")
        full = {c: sum(t.values()) for c, t in table.items() if len(t) == len(shapes)}
        best_one = sorted((v, c) for c, v in full.items())[:3]
        per_shape = sum(min(t[name] for t in table.values() if name in t) for name, _, _ in shapes)
        dflt_sum = sum(table.get(default[name], {}).get(name, float("nan")) for name, _, _ in shapes)
        print(f"per layer (qkv + o + gate_up + down, {layer_bytes / 1e6:.0f} MB): default {dflt_sum:.1f} us "
              f"({layer_bytes / dflt_sum / 1e3:.0f} GB/s); best per shape {per_shape:.1f} us "
              f"({layer_bytes / per_shape / 1e3:.0f} GB/s); best single configs: "
              + ", ".join(f"{c} {v:.1f}" for v, c in best_one)
              + f"; x32 layers: default {32 * dflt_sum / 1e3:.3f} ms, best per shape {32 * per_shape / 1e3:.3f} ms")
        rows.append({"m": m, "default": default, "table": table})
    if out_path:
        with open(out_path, "w") as f:
            f.writelines(json.dumps({"device": torch.cuda.get_device_name(), "sweep": True, **r}) + "\n" for r in rows)
    print(f"{failures} failures")
    return 1 if failures else 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", default="1,2,4,8,64,512,4096")
    ap.add_argument("--out", default=None)
    ap.add_argument("--sweep", action="store_true", help="fp8 GEMV config sweep (M <= 8)")
    args = ap.parse_args()
    ms = [int(v) for v in args.ms.split(",")]
    if args.sweep:
        return sweep([m for m in ms if m <= GEMV_MAX_M], args.out)
    rows: list[dict[str, Any]] = []
    step: dict[int, dict[str, float]] = {m: {} for m in ms}
    failures = 0
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    for name, n, k in SHAPES:
        copies = max(2, math.ceil(COLD_BYTES / (n * k * 2)))
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5 for _ in range(copies)]
        qs = [per_channel(w) for w in ws]
        mult = 1 if name == "lm_head" else LAYERS
        for m in ms:
            xs = [torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for _ in ws]
            packs = [(q, s, *per_token_quant_fp8(x)) for (q, s), x in zip(qs, xs)]
            ref = xs[0].float() @ (qs[0][0].float() * qs[0][1][:, None]).T
            ref16 = xs[0].float() @ ws[0].float().T  # bf16_gemv multiplies the bf16 weights
            row: dict[str, Any] = {"shape": name, "n": n, "k": k, "m": m}
            cells = []
            for impl, fn in impls_for(m, n, k).items():
                try:
                    if impl != "bf16":
                        err = rel_err(fn(xs[0], ws[0], packs[0]), ref16 if impl == "bf16_gemv" else ref)
                        row[f"{impl}_err"] = err
                        if err > TOL[impl]:
                            failures += 1
                            cells.append(f"{impl} ERR {err:.1e}")
                    calls = max(2 * copies, min(256, math.ceil(4.0 / (n * k * 2 / 2.5e9))))
                    fns = [lambda x=x, w=w, p=p, fn=fn: fn(x, w, p) for x, w, p in zip(xs, ws, packs)]
                    us = graph_ms(fns, calls, 10) * 1e3
                    row[f"{impl}_us"] = us
                    cells.append(f"{impl} {us:.1f}")
                    key = "bf16" if name == "lm_head" else impl  # lm_head stays bf16
                    step[m][impl] = step[m].get(impl, 0.0) + mult * row.get(f"{key}_us", us) / 1e3
                except Exception as e:  # noqa: BLE001 - report, go on
                    failures += 1
                    row[f"{impl}_error"] = repr(e)
                    cells.append(f"{impl} FAILED {e!r}")
                    traceback.print_exc()
            print(f"| {name} {n}x{k} | M={m} | " + " | ".join(cells) + " |", flush=True)
            rows.append(row)
        del ws, qs
        torch.cuda.empty_cache()
    print("\nwhole step, ms (32 x (qkv + o_proj + gate_up + down) + lm_head in bf16):")
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
