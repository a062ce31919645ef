#!/usr/bin/env python3
"""Data parallelism throughput: S1 (gpu_bench.py's offline scenario: random ids, 1024 in / 1024
out, all prompts at once) against `tokenspeed serve --dp 1` and `--dp 2` on the Llama-3.1-8B
config with dummy bf16 weights, one server after the other; prints one table with both output
throughputs, how the router split the requests, and the ratio (target >= 1.9x: two replicas
on two GPUs share nothing but the HTTP front end and the router).

Run on a machine with 2 GPUs from the repo root, with `tokenspeed._core` importable:

    python benches/scenarios/dp_bench.py --tokenizer .carry/llama3/tokenizer.json --out "$OUT"

S1 is REDUCED to 400 of BENCHMARKS.md's 2000 prompts unless --full (as in gpu_bench.py).
`--method` picks --load-balance-method (default: the flag table's, round_robin).
`--cpu-smoke`: a narrow 2-layer config on CPU with gpu_bench's quick S1 (64 in / 64 out, 32
prompts), to check the script without GPUs:
`python benches/scenarios/dp_bench.py --cpu-smoke --tokenizer <a tokenizer.json>`.
Writes OUT/dp_bench.md and OUT/dp_bench.json (plus gpu_bench's raw records and server logs).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_bench  # benches/scenarios/ is not a package

TARGET = 1.9


def replicas_routed(url: str) -> list[int] | str:
    code, body = gpu_bench.http_get(f"{url}/get_server_info", 10)
    if code != 200:
        return "?"
    return [r.get("routed", 0) for r in json.loads(body).get("replicas", [])]


def run_dp(out: Path, model: Path, dp: int, a: argparse.Namespace, deadline: float) -> dict[str, Any]:
    ctx = gpu_bench.Ctx(out=out, deadline=deadline)
    extra = ["--dp", str(dp), *a.serve_args.split()]
    if a.method:
        extra += ["--load-balance-method", a.method]
    if a.cpu_smoke:
        # The 8B config's eos id lies outside the smoke tokenizer's vocabulary, which the
        # grammar backend refuses; structured output plays no part in S1.
        extra += ["--device", "cpu", "--dtype", "float32", "--max-total-tokens", "4096",
                  "--max-running-requests", "16", "--grammar-backend", "none"]
    tag = f"dp{dp}"
    started = gpu_bench.start_server(ctx, model, tag, extra, min(600.0, max(60.0, ctx.left() - 30)))
    if started is None:
        return {"dp": dp, "error": f"server failed to start (see server_{tag}.log)"}
    proc, url = started
    try:
        base = gpu_bench.scenarios(quick=a.cpu_smoke, full=a.full)["S1r"]
        sc = dataclasses.replace(base, sid=f"S1r_dp{dp}", label=f"{base.label}, --dp {dp}")
        before = replicas_routed(url)
        gpu_bench.run_scenario(ctx, url, model, sc)
        after = replicas_routed(url)
        rec = ctx.records.get(sc.sid, {})
        split = ([x - y for x, y in zip(after, before)]
                 if isinstance(after, list) and isinstance(before, list) else "?")
        return {"dp": dp, "command": " ".join(extra), "label": sc.label,
                "output_tok_s": gpu_bench.dig(rec, "metrics.output_throughput"),
                "total_tok_s": gpu_bench.dig(rec, "metrics.total_throughput"),
                "median_ttft_ms": gpu_bench.dig(rec, "metrics.ttft_ms.median"),
                "median_tpot_ms": gpu_bench.dig(rec, "metrics.tpot_ms.median"),
                "requests_per_replica": split, "rows": ctx.rows}
    finally:
        gpu_bench.stop_server(proc)


def fmt(v: Any) -> str:
    return f"{v:.1f}" if isinstance(v, float) else str(v)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokenizer", default=".carry/llama3/tokenizer.json")
    p.add_argument("--out", default=os.environ.get("OUT") or "dp_out")
    p.add_argument("--dp-sizes", default="1,2", help="comma-separated --dp values, the first the baseline")
    p.add_argument("--method", default=None, help="--load-balance-method (default: the flag table's)")
    p.add_argument("--full", action="store_true", help="BENCHMARKS.md's 2000 prompts")
    p.add_argument("--budget-s", type=float, default=560.0, help="wall-clock budget of the whole run")
    p.add_argument("--serve-args", default="", help="extra `tokenspeed serve` flags, one string")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="check the script on CPU: a narrow 2-layer config, a tiny S1")
    a = p.parse_args()
    t0 = time.monotonic()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    model, layers = gpu_bench.scenario_model(a.tokenizer, a.cpu_smoke, "ts-dp-")
    sizes = [int(x) for x in a.dp_sizes.split(",") if x]
    results = []
    for i, dp in enumerate(sizes):
        # A run's share of what is left is proportional to 1/dp: DP=1 does the same work on
        # one GPU, so it needs about twice DP=2's time (an equal split cut the full DP=1 run).
        weight = (1 / dp) / sum(1 / d for d in sizes[i:])
        deadline = time.monotonic() + (t0 + a.budget_s - time.monotonic()) * weight
        results.append(run_dp(out, model, dp, a, deadline))
        print(json.dumps({k: v for k, v in results[-1].items() if k != "rows"}), flush=True)
    title = (f"DP bench: Llama-3.1-8B config ({layers} layers{', narrow, CPU smoke' if a.cpu_smoke else ''}), "
             f"dummy weights; S1 {'full' if a.full else 'REDUCED'}; total {time.monotonic() - t0:.0f} s")
    header = ("| --dp | output tok/s | total tok/s | median TTFT ms | median TPOT ms | "
              "requests per replica | serve flags |")
    lines = [title, "", header, "|---|---|---|---|---|---|---|"]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['dp']} | {r['error']} | | | | | |")
            continue
        lines.append(f"| {r['dp']} | {fmt(r['output_tok_s'])} | {fmt(r['total_tok_s'])} | "
                     f"{fmt(r['median_ttft_ms'])} | {fmt(r['median_tpot_ms'])} | "
                     f"{r['requests_per_replica']} | `{r['command']}` |")
    base = results[0].get("output_tok_s") if results else None
    ok = True
    for r in results[1:]:
        tput = r.get("output_tok_s")
        if isinstance(base, (int, float)) and base > 0 and isinstance(tput, (int, float)):
            ratio = tput / base
            lines.append(f"| ratio --dp {r['dp']} / --dp {results[0]['dp']} | {ratio:.2f}x | | | | | "
                         f"target >= {TARGET}x for 2 |")
            ok &= a.cpu_smoke or r["dp"] != 2 or ratio >= TARGET
        else:
            ok = False
    table = "\n".join(lines)
    (out / "dp_bench.md").write_text(table + "\n")
    (out / "dp_bench.json").write_text(json.dumps(results, default=str, indent=1))
    print("\n" + table, flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
