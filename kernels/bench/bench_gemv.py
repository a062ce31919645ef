"""skinny_linear (Triton GEMV) vs F.linear (cuBLAS) at Llama-3.1-8B decode shapes, batch 1..8 (GPU only).

Design (python/tokenspeed_kernels/gemv.py): one program owns BLOCK_N rows of W for all M rows of x and
streams K in BLOCK_K steps with unmasked 16-byte loads (tails are clamped, not masked; a masked K-tail
step runs only when K % BLOCK_K != 0). The inner product is either an in-register broadcast-multiply
+ reduce ("fma") or tl.dot with M padded to 16 ("dot": tensor cores, free here since the kernel is
memory bound, and the shared-memory staging lets Triton pipeline the loads num_stages deep). Split-K
(fp32 partials + a fixed-order reduction kernel: deterministic) is available for shapes whose row
blocks cannot fill the GPU. The per-shape-class config table in gemv._pick_config came from
`--sweep` on an H100.

What to expect (H100 80GB HBM3, torch 2.11, Triton 3.6; run 2026-11-22, cold Triton cache, 17 s wall):
every weight byte is read once, so time ~= weight bytes / DRAM bandwidth. F.linear (cuBLAS) streams
2.0-2.9 TB/s at these shapes; skinny_linear 2.5-3.1 TB/s (M=1: qkv 19.6 vs 20.7 us, o_proj 13.4 vs
16.6, gate_up 77.1 vs 81.5, down 40.9 vs 44.2, lm_head 335 vs 370). Whole step at M=1: 5.59 -> 5.17 ms
(-0.42 ms); M=2/4/8: ~-0.22 ms (1.04x). The "% copy" column divides by the device-to-device copy rate
(~3.0 TB/s, read+write counted), which a read-only stream can exceed, hence > 100% on big shapes. The
small shapes (o_proj, 32 MB in ~13 us) stay near 2.5 TB/s: launch ramp-up and the tail wave dominate.
On an H200, M=1 gains are similar in us and M>=2 is within ~2% of cuBLAS (cuBLAS is stronger there).

Timing: GPU time per call inside a CUDA graph of many back-to-back calls that cycle over several
distinct weight copies (>= 256 MB per shape, > 5x the 50 MB L2), so weights always come from DRAM.
"whole decode step" = 32 x (qkv + o_proj + gate_up + down) + lm_head, per batch size.

Run: cd kernels && PYTHONPATH=. python3 bench/bench_gemv.py [--out rows.jsonl] [--sweep]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench_kernels import eager_ms, graph_ms, rel_err

from tokenspeed_kernels import gemv
from tokenspeed_kernels.gemv import GemvConfig, skinny_linear

LAYERS = 32
# (name, N, K): Llama-3.1-8B per-layer weights, then the LM head (once per step).
SHAPES = [("qkv", 6144, 4096), ("o_proj", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336),
          ("lm_head", 128256, 4096)]  # fmt: skip
COLD_BYTES = 256 << 20  # weight copies per shape add up to at least this (> 5x the 50 MB L2)
TOL = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}


def copy_tbps() -> float:
    """Device-to-device copy bandwidth in TB/s (bytes read + written), the practical DRAM ceiling,
    measured like bench_kernels (~3.0 TB/s on an H100). 0 if the measurement fails."""
    try:
        src = torch.randn(1 << 28, device="cuda")
        dst = torch.empty_like(src)
        return 2 * src.numel() * 4 / eager_ms(lambda: dst.copy_(src)) / 1e9
    except Exception:  # noqa: BLE001 - the ceiling is informational only
        traceback.print_exc()
        return 0.0


class ShapeSet:
    """Several distinct weight copies of one (N, K) plus x / out buffers per M."""

    def __init__(self, n: int, k: int, dtype: torch.dtype, copies: int | None = None) -> None:
        self.n, self.k, self.dtype = n, k, dtype
        self.wbytes = n * k * torch.tensor([], dtype=dtype).element_size()
        copies = copies or max(2, math.ceil(COLD_BYTES / self.wbytes))
        # Scaled so outputs are O(1) (no bf16 overflow/underflow surprises).
        self.ws = [torch.randn(n, k, device="cuda", dtype=dtype) * k**-0.5 for _ in range(copies)]

    def calls(self) -> int:
        """Calls per graph: ~>= 4 ms of work so the replay's launch overhead is amortized."""
        est_ms = self.wbytes / 2.5e9
        return max(2 * len(self.ws), min(256, math.ceil(4.0 / est_ms)))


def time_impls(
    s: ShapeSet, m: int, impls: dict[str, Callable[..., torch.Tensor]], replays: int = 10
) -> dict[str, float]:
    """GPU us per call for each impl(x, w, out) on M rows, cycling over the weight copies."""
    xs = [torch.randn(m, s.k, device="cuda", dtype=s.dtype) for _ in s.ws]
    outs = [torch.empty(m, s.n, device="cuda", dtype=s.dtype) for _ in s.ws]
    res = {}
    for name, fn in impls.items():
        fns = [lambda x=x, w=w, o=o, fn=fn: fn(x, w, o) for x, w, o in zip(xs, s.ws, outs)]
        res[name] = graph_ms(fns, s.calls(), replays) * 1e3
    return res


def torch_linear(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    return F.linear(x, w)  # what the runtime uses today (allocates its output, as in the model)


def check(s: ShapeSet, m: int, cfg: Any | None = None) -> float:
    """rel err of skinny_linear (with and without bias) vs the fp32 reference, NaN-poisoned output."""
    x = torch.randn(m, s.k, device="cuda", dtype=s.dtype)
    w = s.ws[0]
    b = torch.randn(s.n, device="cuda", dtype=s.dtype)
    ref = x.float() @ w.float().T
    out = torch.full((m, s.n), float("nan"), device="cuda", dtype=s.dtype)
    skinny_linear(x, w, out=out, config=cfg)
    err = rel_err(out, ref)
    out.fill_(float("nan"))
    skinny_linear(x, w, b, out=out, config=cfg)
    return max(err, rel_err(out, ref + b.float()))


def run_main(args: argparse.Namespace, dtype: torch.dtype, ceil_tbps: float) -> int:
    ms_list = [int(v) for v in args.ms.split(",")]
    rows: list[dict[str, Any]] = []
    step: dict[int, dict[str, float]] = {m: {"torch": 0.0, "skinny": 0.0} for m in ms_list}
    failures = 0
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(
        "| shape | N x K | M | config | rel err | F.linear us | GB/s | skinny us | GB/s | % copy | speed-up |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name, n, k in SHAPES:
        try:
            s = ShapeSet(n, k, dtype)
        except Exception as e:  # noqa: BLE001 - report and go on (e.g. out of memory)
            print(f"| {name} | {n}x{k} | - | ALLOC FAILED: {e!r} |")
            failures += 1
            continue
        mult = 1 if name == "lm_head" else LAYERS
        for m in ms_list:
            row: dict[str, Any] = {"shape": name, "n": n, "k": k, "m": m, "weight_bytes": s.wbytes}
            try:
                cfg = gemv._pick_config(m, n, k, dtype, sms)
                row["config"] = dataclasses.asdict(cfg)
                err = check(s, m)
                row["rel_err"], row["ok"] = err, err < TOL[dtype]
                t = time_impls(s, m, {"torch": torch_linear,
                                      "skinny": lambda x, w, o: skinny_linear(x, w, out=o)})  # fmt: skip
                row["torch_us"], row["skinny_us"] = t["torch"], t["skinny"]
                row["torch_gbps"] = s.wbytes / t["torch"] / 1e3
                row["skinny_gbps"] = s.wbytes / t["skinny"] / 1e3
                row["speedup"] = t["torch"] / t["skinny"]
                step[m]["torch"] += mult * t["torch"] / 1e3
                step[m]["skinny"] += mult * t["skinny"] / 1e3
                c = cfg
                cdesc = f"{'dot' if c.use_dot else 'fma'} {c.block_n}x{c.block_k} w{c.num_warps} s{c.num_stages}" + (
                    f" sk{c.split_k}" if c.split_k > 1 else "")  # fmt: skip
                print(f"| {name} | {n}x{k} | {m} | {cdesc} | {err:.1e}{'' if row['ok'] else ' FAIL'} | "
                      f"{t['torch']:.1f} | {row['torch_gbps']:.0f} | {t['skinny']:.1f} | {row['skinny_gbps']:.0f} | "
                      f"{100 * row['skinny_gbps'] / max(ceil_tbps * 1e3, 1e-9):.0f}% | {row['speedup']:.2f}x |", flush=True)  # fmt: skip
                failures += not row["ok"]
            except Exception as e:  # noqa: BLE001 - one failing config must not end the run
                row["ok"], row["error"] = False, repr(e)
                failures += 1
                print(f"| {name} | {n}x{k} | {m} | FAILED: {e!r} |", flush=True)
                traceback.print_exc()
                step[m]["skinny"] = float("nan")
            rows.append(row)
        del s
        torch.cuda.empty_cache()
    print()
    print(f"whole decode step (weight matmuls: {LAYERS} x (qkv + o_proj + gate_up + down) + lm_head):")
    print("| M | F.linear ms | skinny ms | saved ms | speed-up |")
    print("|---|---|---|---|---|")
    for m in ms_list:
        t, sk = step[m]["torch"], step[m]["skinny"]
        print(f"| {m} | {t:.3f} | {sk:.3f} | {t - sk:.3f} | {t / sk:.3f}x |")
        rows.append({"shape": "decode_step", "m": m, "torch_ms": t, "skinny_ms": sk, "saved_ms": t - sk})
    print(f"{len(rows)} rows, {failures} failures")
    if args.out:
        meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                "dtype": args.dtype, "copy_tbps": ceil_tbps}  # fmt: skip
        with open(args.out, "w") as f:
            f.writelines(json.dumps({**meta, **r}) + "\n" for r in rows)
    return 1 if failures else 0


def sweep_configs(m: int) -> list[Any]:
    """Candidate configs for --sweep (split-K variants are tried on the best ones afterwards).
    fma candidates use one warp per program (no cross-warp reduction); dot pads M to 16."""
    c = []
    if m <= 4:
        for bn, bk, w in [(1, 1024, 1), (2, 512, 1), (2, 1024, 1), (4, 256, 1), (4, 512, 1), (8, 256, 1),
                          (1, 2048, 1), (4, 1024, 1), (4, 512, 2), (8, 1024, 4)]:  # fmt: skip
            c.append(GemvConfig(block_n=bn, block_k=bk, num_warps=w))
    if m >= 2:
        for bn, bk, w, st in [(64, 128, 4, 4), (64, 256, 4, 3), (64, 128, 4, 6), (64, 64, 4, 8), (128, 128, 4, 4),
                              (128, 128, 8, 4), (128, 64, 4, 6), (64, 128, 8, 4), (64, 256, 4, 4)]:  # fmt: skip
            c.append(GemvConfig(block_n=bn, block_k=bk, num_warps=w, num_stages=st, use_dot=True))
    return c


def try_config(s: ShapeSet, name: str, m: int, cfg: Any, torch_us: float, dtype: torch.dtype) -> float | None:
    """Check then time one config (--sweep); None when it fails to compile, run or match."""
    t0 = time.time()
    try:
        err = check(s, m, cfg)
        if not err < TOL[dtype]:
            raise RuntimeError(f"rel err {err:.2e}")
        run = {"c": lambda x, w, o: skinny_linear(x, w, out=o, config=cfg)}
        us = time_impls(s, m, run, replays=5)["c"]
    except Exception as e:  # noqa: BLE001 - a config that fails is reported, not fatal
        print(f"  {name} M={m} {cfg}: FAILED {str(e).splitlines()[0][:200]}", flush=True)
        return None
    gbps = s.wbytes / us / 1e3
    print(f"  {name} M={m} {us:8.1f} us {gbps:6.0f} GB/s  {cfg}  ({time.time() - t0:.1f}s)", flush=True)
    return us


def run_sweep(args: argparse.Namespace, dtype: torch.dtype, ceil_tbps: float) -> None:
    """Time every candidate config per (shape, M); then split-K on each one's top 4; print the best."""
    ms_list = [int(v) for v in args.ms.split(",")]
    names = args.shapes.split(",") if args.shapes else [s[0] for s in SHAPES]
    recs: list[dict[str, Any]] = []
    best_lines = []
    for name, n, k in SHAPES:
        if name not in names:
            continue
        s = ShapeSet(n, k, dtype)
        for m in ms_list:
            base = time_impls(s, m, {"torch": torch_linear}, replays=5)["torch"]
            results: list[tuple[float, Any]] = []
            cands = sweep_configs(m)
            while cands:
                cfg = cands.pop(0)
                us = try_config(s, name, m, cfg, base, dtype)
                if us is None:
                    continue
                results.append((us, cfg))
                recs.append({"shape": name, "m": m, "us": us, "gbps": s.wbytes / us / 1e3, "torch_us": base,
                             **dataclasses.asdict(cfg)})  # fmt: skip
                if not cands and n <= 8192 and cfg.split_k == 1:
                    # Split-K variants of the 4 best unsplit configs.
                    top = sorted(results, key=lambda r: r[0])[:4]
                    cands = [dataclasses.replace(c, split_k=sk) for _, c in top for sk in (2, 4)]
            results.sort(key=lambda r: r[0])
            for us, cfg in results[:3]:
                best_lines.append(f"{name:8s} M={m}: {us:7.1f} us {s.wbytes / us / 1e3:5.0f} GB/s "
                                  f"(F.linear {base:7.1f} us {s.wbytes / base / 1e3:5.0f} GB/s)  {cfg}")  # fmt: skip
        del s
        torch.cuda.empty_cache()
    print(f"\nbest configs (copy ceiling {ceil_tbps:.2f} TB/s):")
    print("\n".join(best_lines))
    if args.out:
        with open(args.out, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in recs)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="JSON lines output path")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    ap.add_argument("--ms", default="1,2,4,8", help="comma list of batch sizes M")
    ap.add_argument("--sweep", action="store_true", help="time candidate configs instead (slow: minutes)")
    ap.add_argument("--shapes", default="", help="with --sweep: comma list of shape names")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_gemv needs a CUDA GPU")
        return 2
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    t0 = time.time()
    ceil_tbps = copy_tbps()
    print(f"# {torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__} {args.dtype}; "
          f"copy {ceil_tbps:.2f} TB/s (read+write); times = GPU us per call in a CUDA graph, weights L2-cold")  # fmt: skip
    if args.sweep:
        run_sweep(args, dtype, ceil_tbps)
        rc = 0
    else:
        rc = run_main(args, dtype, ceil_tbps)
    print(f"# {time.time() - t0:.1f} s")
    return rc


if __name__ == "__main__":
    sys.exit(main())
