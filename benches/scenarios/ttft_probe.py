#!/usr/bin/env python3
"""S7 first token: TTFT at concurrency 1 for prompts of 16 / 128 / 1024 / 4096 tokens against
`tokenspeed serve` (Llama-3.1-8B config, dummy bf16 weights, as benches/scenarios/gpu_bench.py serves it),
split into where the time goes.

Run on the GPU machine from the repo root, with `tokenspeed._core` importable:

    python3 benches/scenarios/ttft_probe.py --tokenizer .carry/llama3/tokenizer.json --out "$OUT"

Per request (streamed /v1/completions, token-id prompt, distinct random ids so the radix cache
never hits, `ignore_eos`, one connection kept alive like a benchmark client) it records:
- client: send → response headers, → first SSE event, → first event with text (TTFT as
  sglang.bench_serving / `tokenspeed bench serve` define it), and the gaps between later events;
- bare socket: the same kind of request (fresh ids) over a plain socket, to its first `data:`
  bytes: TTFT without the Python HTTP client's own time;
- engine: submit → first token routed (the server's `tokenspeed:time_to_first_token_seconds`
  histogram, read before and after each request: its sum grows by exactly this request's TTFT);
- worker: the prefill step's own timings (TOKENSPEED_STEP_TRACE, python/tokenspeed/diagnostics/step_trace.py):
  plan received → kernels queued (`launch`, host time), → outputs on the host (`gpu_wait`),
  → result sent.
So: client − engine = HTTP, JSON, SSE and TCP; engine − worker total = engine thread, scheduler
and the shm round trip; worker launch + gpu_wait = the step; GPU estimate = 2 × 8e9 × tokens at
the 795 TFLOP/s measured on the H100 (BENCHMARKS.md).

Prints a markdown table and writes ttft_probe.jsonl (one line per length) and the server log
under --out. `--serve-args` adds server flags (e.g. "--disable-overlap-schedule").
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_bench import Ctx, start_server, stop_server, write_model_dir

TRACE = re.compile(r"step (\d+): batch (\d+) tokens (\d+) new (\d+) \| idle ([\d.]+) launch ([\d.]+) "
                   r"gpu_wait ([\d.]+) send ([\d.]+) total ([\d.]+) ms")
# vLLM-style name under the tokenspeed: prefix (older builds: tokenspeed_...).
TTFT_METRIC = "tokenspeed[:_]time_to_first_token_seconds"
FLOP_PER_TOKEN = 2 * 8.0e9
H100_FLOPS = 795e12


def engine_ttft_sum(client: httpx.Client, url: str) -> tuple[float, float] | None:
    r = client.get(f"{url}/metrics")
    if r.status_code != 200:
        return None
    vals = {}
    for suffix in ("sum", "count"):
        m = re.search(rf"^{TTFT_METRIC}_{suffix}(?:{{[^}}]*}})?\s+([0-9.eE+-]+)", r.text, re.MULTILINE)
        if not m:
            return None
        vals[suffix] = float(m.group(1))
    return vals["sum"], vals["count"]


def raw_first_event(url: str, ids: list[int], max_tokens: int) -> float:
    """Seconds from sending the same streamed request over a bare socket (HTTP/1.1, no client
    library; connected before the clock starts) to the first `data:` bytes: the server's TTFT
    without the Python client's own overhead (~1.5 ms of httpx on a slow CPU)."""
    host, port = url.split("//", 1)[1].rsplit(":", 1)
    body = json.dumps({"prompt": ids, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                       "ignore_eos": True}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
    with socket.create_connection((host, int(port))) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        t0 = time.perf_counter()
        sock.sendall(head + body)
        buf = b""
        while b"data:" not in buf:
            chunk = sock.recv(65536)
            if not chunk:
                raise RuntimeError(f"stream ended before any event: {buf[:300]!r}")
            buf += chunk
        first = time.perf_counter() - t0
        while sock.recv(65536):  # drain to the end (Connection: close)
            pass
    return first


def one_request(client: httpx.Client, url: str, ids: list[int], max_tokens: int) -> dict[str, Any]:
    body = {"prompt": ids, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    before = engine_ttft_sum(client, url)
    t0 = time.perf_counter()
    headers = first_event = first_text = None
    events: list[float] = []
    with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
        headers = time.perf_counter() - t0
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {resp.read()[:300]!r}")
        for line in resp.iter_lines():
            if not line.startswith("data:"):
                continue
            now = time.perf_counter() - t0
            payload = line[5:].strip()
            if payload == "[DONE]":
                break
            data = json.loads(payload)
            first_event = first_event if first_event is not None else now
            choices = data.get("choices") or []
            if choices and choices[0].get("text"):
                first_text = first_text if first_text is not None else now
                events.append(now)
    after = engine_ttft_sum(client, url)
    engine = None
    if before and after and after[1] == before[1] + 1:
        engine = after[0] - before[0]
    gaps = [b - a for a, b in itertools.pairwise(events)]
    return {"headers": headers, "first_event": first_event, "ttft": first_text, "engine_ttft": engine,
            "max_gap": max(gaps) if gaps else None, "median_gap": statistics.median(gaps) if gaps else None}


def worker_steps(log: Path) -> list[dict[str, float]]:
    """The worker's trace lines of steps that carried a new request, in order."""
    out = []
    for line in log.read_text(errors="replace").splitlines():
        m = TRACE.search(line)
        if m and int(m.group(4)) > 0:
            keys = ("step", "batch", "tokens", "new", "idle", "launch", "gpu_wait", "send", "total")
            out.append(dict(zip(keys, map(float, m.groups()))))
    return out


ANSI = re.compile(r"\x1b\[[0-9;]*m")


def engine_steps(log: Path) -> list[dict[str, float]]:
    """The engine's debug lines for plans that carried new requests (RUST_LOG, see main)."""
    out = []
    for line in log.read_text(errors="replace").splitlines():
        line = ANSI.sub("", line)
        if "prefill step" in line:
            out.append({k: float(v) for k, v in re.findall(r"(\w+)=(\d+)", line)})
    return out


def med(values: list[float | None], scale: float = 1e3) -> float | None:
    vals = [v * scale for v in values if v is not None]
    return round(statistics.median(vals), 2) if vals else None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokenizer", default=".carry/llama3/tokenizer.json")
    p.add_argument("--out", default="ttft_out")
    p.add_argument("--lengths", default="16,128,1024,4096")
    p.add_argument("--reps", type=int, default=10, help="timed requests per length (after 2 warm-ups)")
    p.add_argument("--max-tokens", type=int, default=32, help="output tokens (S7: 32, streamed)")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--serve-args", default="", help="extra `tokenspeed serve` flags, space separated")
    p.add_argument("--start-timeout", type=float, default=300)
    p.add_argument("--config-overrides", default="{}",
                   help="JSON merged into config.json (a CPU smoke test shrinks the model)")
    args = p.parse_args()

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    lengths = [int(x) for x in args.lengths.split(",")]
    ctx = Ctx(out=out, deadline=time.monotonic() + 3600)
    # The worker logs every step that carries a new request (others: every 10^6th).
    os.environ["TOKENSPEED_STEP_TRACE"] = "1000000"
    # The engine's side of each prefill: submit → plan sent, plan sent → result back.
    os.environ["RUST_LOG"] = "info,tokenspeed_server::engine=debug"
    tag = "ttft"
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_model_dir(Path(tmp), Path(args.tokenizer), args.layers,
                                    json.loads(args.config_overrides))
        started = start_server(ctx, model_dir, tag, args.serve_args.split(), args.start_timeout)
        if started is None:
            return 1
        proc, url = started
        rng = np.random.default_rng(0)
        results: dict[int, list[dict[str, Any]]] = {}
        try:
            with httpx.Client(timeout=120, trust_env=False) as client:
                for n in lengths:
                    runs = []
                    for i in range(args.reps + 2):
                        ids = rng.integers(1000, 100000, n).tolist()
                        r = one_request(client, url, ids, args.max_tokens)
                        raw_ids = rng.integers(1000, 100000, n).tolist()
                        r["raw_first_event"] = raw_first_event(url, raw_ids, args.max_tokens)
                        if i >= 2:
                            runs.append(r)
                    results[n] = runs
                    print(f"{n} tokens: median TTFT {med([r['ttft'] for r in runs])} ms", flush=True)
        finally:
            stop_server(proc)
    steps = worker_steps(out / f"server_{tag}.log")
    eng = engine_steps(out / f"server_{tag}.log")
    rows = []
    for n in lengths:
        # This length's timed prefill steps: the last `reps` steps that prefilled n tokens.
        mine = [s for s in steps if int(s["tokens"]) == n and int(s["batch"]) == 1][-args.reps:]
        runs = results[n]
        emine = [e for e in eng if int(e.get("tokens", -1)) == n and int(e.get("new", 0)) == 1][-args.reps:]
        row = {
            "prompt_tokens": n, "max_tokens": args.max_tokens, "reps": len(runs),
            "ttft_ms": med([r["ttft"] for r in runs]),
            "first_event_ms": med([r["first_event"] for r in runs]),
            "raw_first_event_ms": med([r["raw_first_event"] for r in runs]),
            "headers_ms": med([r["headers"] for r in runs]),
            "engine_ttft_ms": med([r["engine_ttft"] for r in runs]),
            "engine_submit_to_sent_ms": med([e.get("submit_to_sent_us") for e in emine], 1e-3),
            "engine_sent_to_result_ms": med([e.get("sent_to_result_us") for e in emine], 1e-3),
            "worker_total_ms": med([s["total"] for s in mine], 1.0),
            "worker_launch_ms": med([s["launch"] for s in mine], 1.0),
            "worker_gpu_wait_ms": med([s["gpu_wait"] for s in mine], 1.0),
            "gpu_estimate_ms": round(FLOP_PER_TOKEN * n / H100_FLOPS * 1e3, 2),
            "median_itl_ms": med([r["median_gap"] for r in runs]),
            "max_itl_ms": med([r["max_gap"] for r in runs]),
            "serve_args": args.serve_args,
        }
        rows.append(row)
    with open(out / "ttft_probe.jsonl", "a") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    cols = [("prompt", "prompt_tokens"), ("TTFT", "ttft_ms"), ("1st event", "first_event_ms"),
            ("1st event, bare socket", "raw_first_event_ms"),
            ("engine TTFT", "engine_ttft_ms"), ("submit→plan sent", "engine_submit_to_sent_ms"),
            ("plan sent→result", "engine_sent_to_result_ms"), ("worker step", "worker_total_ms"),
            ("worker launch", "worker_launch_ms"), ("gpu wait", "worker_gpu_wait_ms"),
            ("GPU est.", "gpu_estimate_ms"), ("ITL med", "median_itl_ms"), ("ITL max (med)", "max_itl_ms")]
    print(f"\nS7 TTFT at concurrency 1, {args.max_tokens} out, medians of {args.reps} (ms); "
          f"serve args: {args.serve_args or '(defaults)'}")
    print("| " + " | ".join(c[0] for c in cols) + " |")
    print("|" + "---|" * len(cols))
    for row in rows:
        print("| " + " | ".join(str(row[c[1]]) for c in cols) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
