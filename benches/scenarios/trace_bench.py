#!/usr/bin/env python3
"""What tracing costs: S3 (batch 1) and S2 (online, 8 req/s) from gpu_bench.py against
`tokenspeed serve` without and with `--enable-trace`, the spans exported to an OTLP/HTTP sink
in this script (it answers every POST to /v1/traces and counts requests and bytes), on the
Llama-3.1-8B config with dummy bf16 weights, one server after the other. Prints one table:
each metric off / on and the change (tracing should cost nothing measurable: its per-request
work is a few spans, per step one look at the plan's traced requests).

Run on a GPU machine from the repo root, with `tokenspeed._core` importable:

    python benches/scenarios/trace_bench.py --tokenizer .carry/llama3/tokenizer.json --out "$OUT"

`--cpu-smoke`: a narrow 2-layer config on CPU with gpu_bench's quick workloads, to check the
script without a GPU. Writes OUT/trace_bench.md and OUT/trace_bench.json (plus gpu_bench's raw
records and the server logs).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_bench  # benches/scenarios/ is not a package

SCENARIOS = ("S3", "S2r8")


class Sink:
    """An OTLP/HTTP traces endpoint that keeps nothing: counts exports and their bytes."""

    def __init__(self) -> None:
        self.exports = 0
        self.bytes = 0
        sink = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                sink.exports += 1
                sink.bytes += len(body)
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"127.0.0.1:{self.http.server_address[1]}"
        threading.Thread(target=self.http.serve_forever, daemon=True).start()


def run(out: Path, model: Path, traced: bool, sink: Sink, a: argparse.Namespace,
        deadline: float) -> dict[str, Any]:
    ctx = gpu_bench.Ctx(out=out, deadline=deadline)
    extra = a.serve_args.split()
    if traced:
        extra += ["--enable-trace", "--otlp-traces-endpoint", sink.endpoint]
    if a.cpu_smoke:
        extra += ["--device", "cpu", "--dtype", "float32", "--max-total-tokens", "4096",
                  "--max-running-requests", "16", "--grammar-backend", "none"]
    tag = "trace_on" if traced else "trace_off"
    started = gpu_bench.start_server(ctx, model, tag, extra, min(600.0, max(60.0, ctx.left() - 30)))
    if started is None:
        return {"tracing": traced, "error": f"server failed to start (see server_{tag}.log)"}
    proc, url = started
    exports_before = sink.exports
    try:
        table = gpu_bench.scenarios(quick=a.cpu_smoke)
        metrics: dict[str, Any] = {}
        for sid in SCENARIOS:
            sc = table[sid]
            sc.sid = f"{sid}_{tag}"
            gpu_bench.run_scenario(ctx, url, model, sc)
            rec = ctx.records.get(sc.sid, {})
            for name, path, _ in sc.metrics:
                metrics[f"{sid} {name}"] = gpu_bench.dig(rec, path)
        time.sleep(1.0)  # the exporter sends every 200 ms
        return {"tracing": traced, "command": " ".join(extra), "metrics": metrics,
                "exports": sink.exports - exports_before, "rows": ctx.rows}
    finally:
        gpu_bench.stop_server(proc)


def fmt(v: Any) -> str:
    return f"{v:.2f}" if isinstance(v, float) else str(v)


def report(results: list[dict[str, Any]], title: str) -> str:
    lines = [title, ""]
    if any("error" in r for r in results):
        return "\n".join(lines + [r.get("error", "ok") for r in results])
    off, on = results
    lines += ["| metric | tracing off | tracing on | change |", "|---|---|---|---|"]
    for name, before in off["metrics"].items():
        after = on["metrics"].get(name)
        change = "-"
        if isinstance(before, (int, float)) and isinstance(after, (int, float)) and before:
            change = f"{(after - before) / before * 100:+.1f}%"
        lines.append(f"| {name} | {fmt(before)} | {fmt(after)} | {change} |")
    lines += ["", (f"exports received: off {off['exports']}, on {on['exports']} "
                   f"(the sink answered every one); on: `{on['command']}`")]
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokenizer", default=".carry/llama3/tokenizer.json")
    p.add_argument("--out", default=os.environ.get("OUT") or "trace_out")
    p.add_argument("--budget-s", type=float, default=560.0, help="wall-clock budget of the whole run")
    p.add_argument("--serve-args", default="", help="extra `tokenspeed serve` flags, one string")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="check the script on CPU: a narrow 2-layer config, tiny workloads")
    a = p.parse_args()
    t0 = time.monotonic()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    model, layers = gpu_bench.scenario_model(a.tokenizer, a.cpu_smoke, "ts-trace-")
    sink = Sink()
    results = []
    for i, traced in enumerate((False, True)):
        deadline = time.monotonic() + (t0 + a.budget_s - time.monotonic()) / (2 - i)
        results.append(run(out, model, traced, sink, a, deadline))
        print(json.dumps({k: v for k, v in results[-1].items() if k != "rows"}, default=str), flush=True)
    title = (f"Tracing cost: Llama-3.1-8B config ({layers} layers"
             f"{', narrow, CPU smoke' if a.cpu_smoke else ''}), dummy weights; S3 and S2 (REDUCED), "
             f"--enable-trace off then on; total {time.monotonic() - t0:.0f} s")
    table = report(results, title)
    (out / "trace_bench.md").write_text(table + "\n")
    (out / "trace_bench.json").write_text(json.dumps(results, default=str, indent=1))
    print("\n" + table, flush=True)
    ok = all("error" not in r for r in results) and results[1].get("exports", 0) > 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
