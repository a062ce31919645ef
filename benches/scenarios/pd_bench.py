#!/usr/bin/env python3
"""Prefill/decode disaggregation against data parallelism on two GPUs (issue 37): random ids,
1024 in / 256 out, requests arriving at `--rate` per second (Poisson), on the Llama-3.1-8B
config with dummy bf16 weights. Two setups, one after the other:
- dp2: `tokenspeed serve --dp 2` (two replicas, GPUs 0 and 1, behind the built-in router);
- pd:  a `--disaggregation-mode prefill` server on GPU 0 and a `decode` one on GPU 1 (KV over
  NCCL), behind `tokenspeed router --pd`.
Prints one table: output throughput, median and p99 TTFT, median and p99 ITL, and for pd the
KV transfers as the decode server's /metrics count them over the run (`kv_transfer_seconds`,
`kv_transfer_arrived_bytes_total`): transfers, time per transfer (one per request: mean, and
p50 / p99 interpolated in the histogram's buckets), MB per transfer and GB/s on the wire (the
first TP rank's share). The JSON also keeps the prefill server's last "KV transfer sent" log
line.

Run on a machine with 2 GPUs from the repo root, with `tokenspeed._core` importable:

    python benches/scenarios/pd_bench.py --tokenizer .carry/llama3/tokenizer.json --out "$OUT" --rate 8

`--rate` should sit near dp2's saturation (raise it until dp2's TTFT climbs); several rates:
`--rate 4,8,12`. `--cpu-smoke`: a narrow 2-layer config on CPU (gloo), 16 prompts of 64 / 16
tokens, to check the script without GPUs. Writes OUT/pd_bench.md and OUT/pd_bench.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_bench  # benches/scenarios/ is not a package


def scenario(a: argparse.Namespace, rate: str, tag: str) -> gpu_bench.Scenario:
    inp, out, n = (64, 16, 16) if a.cpu_smoke else (1024, 256, a.num_prompts)
    args = ["--dataset-name", "random-ids", "--random-input-len", str(inp), "--random-output-len",
            str(out), "--num-prompts", str(n), "--request-rate", rate]
    return gpu_bench.Scenario(sid=f"pd_{tag}_r{rate}", label=f"{inp}/{out} at {rate} req/s, {tag}",
                              args=args, metrics=[], timeout_s=max(120.0, 3 * n / float(rate)))


def on_gpu(gpus: str, a: argparse.Namespace) -> dict[str, str]:
    return {} if a.cpu_smoke else {"CUDA_VISIBLE_DEVICES": gpus}


def start(ctx: gpu_bench.Ctx, model: Path, tag: str, extra: list[str], env: dict[str, str]) -> Any:
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # the server inherits it
    try:
        return gpu_bench.start_server(ctx, model, tag, extra, min(600.0, max(60.0, ctx.left() - 30)))
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)


def measure(ctx: gpu_bench.Ctx, url: str, model: Path, sc: gpu_bench.Scenario) -> dict[str, Any]:
    status, rec = gpu_bench.run_scenario(ctx, url, model, sc)
    d = gpu_bench.dig
    return {"status": status, "output_tok_s": d(rec, "metrics.output_throughput"),
            "ttft_median_ms": d(rec, "metrics.ttft_ms.median"), "ttft_p99_ms": d(rec, "metrics.ttft_ms.p99"),
            "itl_median_ms": d(rec, "metrics.itl_ms.median"), "itl_p99_ms": d(rec, "metrics.itl_ms.p99")}


def run_dp2(ctx: gpu_bench.Ctx, model: Path, a: argparse.Namespace, rates: list[str]) -> list[dict]:
    extra = ["--dp", "2", *base_flags(a)]
    started = start(ctx, model, "dp2", extra, on_gpu("0,1", a))
    if started is None:
        return [{"setup": "dp2", "error": "server failed to start (server_dp2.log)"}]
    proc, url = started
    try:
        return [{"setup": "dp2", "rate": r, "command": " ".join(extra),
                 **measure(ctx, url, model, scenario(a, r, "dp2"))} for r in rates]
    finally:
        gpu_bench.stop_server(proc)


def run_pd(ctx: gpu_bench.Ctx, model: Path, a: argparse.Namespace, rates: list[str]) -> list[dict]:
    backend = "gloo" if a.cpu_smoke else "nccl"
    pd = ["--disaggregation-transfer-backend", backend,
          "--disaggregation-bootstrap-port", str(gpu_bench.free_port()), *base_flags(a)]
    prefill = start(ctx, model, "pd_prefill", ["--disaggregation-mode", "prefill", *pd], on_gpu("0", a))
    decode = start(ctx, model, "pd_decode", ["--disaggregation-mode", "decode", *pd], on_gpu("1", a))
    procs = [s[0] for s in (prefill, decode) if s is not None]
    if prefill is None or decode is None:
        for p in procs:
            gpu_bench.stop_server(p)
        return [{"setup": "pd", "error": "a server failed to start (server_pd_*.log)"}]
    port = gpu_bench.free_port()
    cmd = [sys.executable, "-m", "tokenspeed.launch.cli", "router", "--pd", "--prefill", prefill[1],
           "--decode", decode[1], "--port", str(port)]
    log = open(ctx.out / "router_pd.log", "w")  # noqa: SIM115  (the router writes it)
    router = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        while gpu_bench.http_get(f"{url}/health", 2)[0] != 200:
            if router.poll() is not None or ctx.left() < 30:
                return [{"setup": "pd", "error": "the router did not start (router_pd.log)"}]
            time.sleep(0.5)
        rows = []
        for r in rates:
            before = read_metrics(decode[1])
            row = measure(ctx, url, model, scenario(a, r, "pd"))
            time.sleep(1.5)  # the sender logs its totals once its queue has run dry
            rows.append({"setup": "pd", "rate": r, "command": " ".join(pd), **row,
                         "kv_transfer": kv_transfer(before, read_metrics(decode[1])),
                         "kv_transfer_log": last_transfer_line(ctx.out / "server_pd_prefill.log")})
        return rows
    finally:
        gpu_bench.stop_server(router)
        for p in procs:
            gpu_bench.stop_server(p)


def base_flags(a: argparse.Namespace) -> list[str]:
    flags = a.serve_args.split()
    if a.cpu_smoke:
        flags += ["--device", "cpu", "--dtype", "float32", "--max-total-tokens", "4096",
                  "--max-running-requests", "16", "--grammar-backend", "none"]
    return flags


def last_transfer_line(log: Path) -> str:
    """The prefill server's transfer totals so far (cumulative over the rates run)."""
    lines = re.findall(r"KV transfer sent: .*", log.read_text(errors="replace")) if log.exists() else []
    return lines[-1] if lines else "none logged"


KV_SECONDS = "tokenspeed:kv_transfer_seconds"
KV_BYTES = "tokenspeed:kv_transfer_arrived_bytes_total"


def read_metrics(url: str) -> dict[Any, float]:
    """A server's /metrics, summed over label sets: series name -> value, and for a histogram's
    buckets (name, upper bound) -> cumulative count. Empty when it cannot be read."""
    status, text = gpu_bench.http_get(f"{url}/metrics")
    out: dict[Any, float] = {}
    for line in text.splitlines() if status == 200 else []:
        if line.startswith("#") or " " not in line:
            continue
        series, _, value = line.rpartition(" ")
        name = series.split("{", 1)[0]
        key: Any = name
        if name.endswith("_bucket") and 'le="' in series:
            le = series.split('le="', 1)[1].split('"', 1)[0]
            key = (name, math.inf if le == "+Inf" else float(le))
        out[key] = out.get(key, 0.0) + float(value)
    return out


def kv_transfer(before: dict[Any, float], after: dict[Any, float]) -> dict[str, Any]:
    """The KV transfers that arrived between two reads of the decode server's /metrics."""
    if f"{KV_SECONDS}_count" not in after:
        return {"transfers": None}
    d = {k: v - before.get(k, 0.0) for k, v in after.items()}
    n = d[f"{KV_SECONDS}_count"]
    if n <= 0:
        return {"transfers": 0}
    seconds, nbytes = d[f"{KV_SECONDS}_sum"], d.get(KV_BYTES, 0.0)
    buckets = sorted((k[1], c) for k, c in d.items()
                     if isinstance(k, tuple) and k[0] == f"{KV_SECONDS}_bucket")
    return {"transfers": int(n), "mean_ms": 1e3 * seconds / n,
            "p50_ms": 1e3 * quantile(buckets, 0.5), "p99_ms": 1e3 * quantile(buckets, 0.99),
            "mb_per_transfer": nbytes / n / 1e6, "gb_s": nbytes / max(seconds, 1e-9) / 1e9}


def quantile(buckets: list[tuple[float, float]], q: float) -> float:
    """Prometheus's histogram_quantile: linear within the bucket that holds the q-th share of
    the observations (cumulative counts by upper bound); the last finite bound in +Inf's."""
    total = buckets[-1][1] if buckets else 0.0
    lo, below = 0.0, 0.0
    for le, cum in buckets:
        if cum >= q * total and cum > below:
            if math.isinf(le):
                return lo
            return lo + (le - lo) * (q * total - below) / (cum - below)
        lo, below = (lo if math.isinf(le) else le), cum
    return lo


def fmt_kv(kv: Any) -> str:
    if not isinstance(kv, dict):
        return "-"
    if not kv.get("transfers"):
        return f"{kv.get('transfers')} transfers"
    return (f"{kv['transfers']} x {kv['mb_per_transfer']:.2f} MB: {kv['mean_ms']:.2f} / "
            f"{kv['p50_ms']:.2f} / {kv['p99_ms']:.2f} ms, {kv['gb_s']:.2f} GB/s")


def fmt(v: Any) -> str:
    return f"{v:.1f}" if isinstance(v, float) else str(v)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokenizer", default=".carry/llama3/tokenizer.json")
    p.add_argument("--out", default=os.environ.get("OUT") or "pd_out")
    p.add_argument("--rate", default="8", help="request rates (req/s), comma-separated")
    p.add_argument("--num-prompts", type=int, default=400)
    p.add_argument("--budget-s", type=float, default=560.0, help="wall-clock budget of the whole run")
    p.add_argument("--serve-args", default="", help="extra `tokenspeed serve` flags for every server")
    p.add_argument("--cpu-smoke", action="store_true", help="check the script on CPU (gloo)")
    a = p.parse_args()
    t0 = time.monotonic()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    model, layers = gpu_bench.scenario_model(a.tokenizer, a.cpu_smoke, "ts-pd-")
    rates = [r for r in a.rate.split(",") if r]
    half = t0 + a.budget_s / 2
    results = run_dp2(gpu_bench.Ctx(out=out, deadline=half), model, a, rates)
    results += run_pd(gpu_bench.Ctx(out=out, deadline=t0 + a.budget_s), model, a, rates)
    title = (f"PD bench: Llama-3.1-8B config ({layers} layers{', narrow, CPU smoke' if a.cpu_smoke else ''}), "
             f"dummy weights; total {time.monotonic() - t0:.0f} s")
    header = ("| setup | req/s | output tok/s | TTFT median / p99 ms | ITL median / p99 ms | "
              "KV transfer per request: mean / p50 / p99 ms, GB/s |")
    lines = [title, "", header, "|---|---|---|---|---|---|"]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['setup']} | {r['error']} | | | | |")
            continue
        lines.append(f"| {r['setup']} | {r['rate']} | {fmt(r['output_tok_s'])} | "
                     f"{fmt(r['ttft_median_ms'])} / {fmt(r['ttft_p99_ms'])} | "
                     f"{fmt(r['itl_median_ms'])} / {fmt(r['itl_p99_ms'])} | {fmt_kv(r.get('kv_transfer'))} |")
    table = "\n".join(lines)
    (out / "pd_bench.md").write_text(table + "\n")
    (out / "pd_bench.json").write_text(json.dumps(results, default=str, indent=1))
    print("\n" + table, flush=True)
    return 0 if all(r.get("status") == "ok" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
