#!/usr/bin/env python3
"""The scoreboard (BENCHMARKS.md, "Rules for a number"): S1, S2 and S3 in bf16, fp8 KV and fp8
weights+KV on one GPU, compared with the last recorded numbers of that GPU.

For each precision -- bf16 (no flags), fp8-kv (`--kv-cache-dtype fp8`), fp8-both
(`--quantization fp8 --kv-cache-dtype fp8`) -- ONE `tokenspeed serve` (Llama-3.1-8B config, dummy
weights, benches/scenarios/gpu_bench.py's server) runs, in this order:
  S3  batch-1:  128 in / 512 out, concurrency 1, 10 prompts (random-ids)
  S2  online:   1024 in / 256 out at 8 req/s (Poisson, seed 0), 600 prompts (random-ids; --s2-prompts)
  S1  offline:  1024 in / 1024 out, 2000 prompts (dataset `random`: TEXT prompts, re-tokenized to
                1024 tokens), all sent at t=0 with no staggering (`bench serve`'s default; --s1-prompts),
                from 4 client processes (`--num-client-processes 4`, --s1-client-processes: one Python event
                loop cannot read S1's ~50k SSE events/s in time and its lateness showed up as max ITL)
Metrics: S1 output tok/s (higher is better) and max ITL ms; S2 median TTFT ms and p99 ITL ms; S3
median TPOT ms (ms/token) and median TTFT ms (lower is better). One markdown table:
scenario | precision | metric | now | last recorded | change % | flag, where a row more than 3% worse
than the last recorded value (direction-aware) says WORSE. The last recorded numbers live in
benches/scenarios/scoreboard_baseline.json, keyed by torch.cuda.get_device_name(); `--record` writes
this run's numbers there for the GPU they were measured on (each with its commit and date).

Under --out (default $OUT, else ./scoreboard_out): scoreboard.jsonl (one line per scenario and
precision run: status, metrics, commit, GPU, workload), summary.md (the table), and gpu_bench's
bench_serve.jsonl (raw `bench serve` records), gpu_bench.jsonl and server_<precision>.log.
A (scenario, precision) whose last line in scoreboard.jsonl is ok (same GPU, same workload) is not
run again unless --rerun, so the matrix can be spread over several commands (the same --out) and
`--report-only` prints the table of what is there. --budget-s bounds the run: a server or
scenario that no longer fits is skipped (and runs next time). The whole matrix takes ~25 minutes
on an H100 (S1 ~5 min a precision, S2 ~1.5, S3 ~0.5, a server start ~1-2).

Device commands (repo root; `.carry/` as in benches/README.md: the abi3 wheel in .carry/wheel,
the Llama-3 tokenizer in .carry/llama3; carry [".carry"]; <HEAD> = `git rev-parse --short HEAD`
here, since the device's copy may not know the commit). Each command is limited to 10 minutes, so
one precision per command (timeout_s 600); a machine stays warm only ~30 s after a call, so the
results are kept in /tmp/sb there and copied to $OUT after each call:

    python3 -m pip install -q --no-deps --no-index --upgrade --target /tmp/site .carry/wheel/*.whl &&
    cp /tmp/site/tokenspeed/_core.abi3.so python/tokenspeed/ && export PYTHONPATH=$PWD/python &&
    mkdir -p /tmp/sb && { [ -f .carry/sb/scoreboard.jsonl ] && cp -n .carry/sb/scoreboard.jsonl /tmp/sb/; true; } &&
    python3 benches/scenarios/scoreboard.py --tokenizer .carry/llama3/tokenizer.json --out /tmp/sb \
        --commit <HEAD> --only-precision bf16 --budget-s 560; cp /tmp/sb/scoreboard.jsonl /tmp/sb/summary.md $OUT/

then the same with `--only-precision fp8-kv`, then `--only-precision fp8-both` (what did not fit
in one command runs in the next: run it again until the table has no "not run"; the pip/cp setup
is needed again only on a fresh machine, and copying the returned scoreboard.jsonl to
.carry/sb/scoreboard.jsonl here lets a fresh machine resume). Or all of it detached on one warm
machine (each later call within ~30 s of the last; a machine goes back after 30 minutes held):

    <setup as above>; PYTHONUNBUFFERED=1 setsid nohup python3 benches/scenarios/scoreboard.py \
        --tokenizer .carry/llama3/tokenizer.json --out /tmp/sb --commit <HEAD> --budget-s 1650 \
        >/tmp/sb.log 2>&1 & echo $! >/tmp/sb.pid; sleep 585; tail -3 /tmp/sb.log      # call 1
    sleep 585; tail -3 /tmp/sb.log                                                  # call 2
    while kill -0 "$(cat /tmp/sb.pid)" 2>/dev/null; do sleep 10; done               # call 3
    python3 benches/scenarios/scoreboard.py --out /tmp/sb --report-only; cp /tmp/sb/scoreboard.jsonl /tmp/sb/summary.md /tmp/sb.log $OUT/

Then, here: `python3 benches/scenarios/scoreboard.py --out <the returned folder> --report-only
[--record]` (--record: after a change that is accepted, and only from full-size runs). Smoke
tests: `--quick` (2 layers, tiny workloads, ~2 minutes for the whole matrix on an H100; its
results are kept apart, not compared and never recorded) on the GPU, and
`--cpu-smoke --tokenizer <a tokenizer.json> --only-precision bf16` without one.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # gpu_bench (benches/scenarios/ is not a package)
import gpu_bench

BASELINE = HERE / "scoreboard_baseline.json"
RESULTS = "scoreboard.jsonl"
THRESHOLD_PCT = 3.0
MODEL = "llama31-8b"
PRECISIONS: dict[str, list[str]] = {
    "bf16": [],
    "fp8-kv": ["--kv-cache-dtype", "fp8"],
    "fp8-both": ["--quantization", "fp8", "--kv-cache-dtype", "fp8"],
}
SCENARIOS = ("S3", "S2", "S1")  # the order on each server: the short ones first
STANDARD_PROMPTS = {"S1": 2000, "S2": 600, "S3": 10}
# S1's ~2,000 streams at once are more than one client event loop reads in time (issue 29: its
# loop woke up to 1.8 s late while the engine's gaps stayed <= 300 ms): 4 processes send them.
S1_CLIENT_PROCESSES = 4


@dataclass(frozen=True)
class Metric:
    name: str
    path: str  # in the `bench serve` record
    higher_is_better: bool


METRICS: dict[str, tuple[Metric, ...]] = {
    "S1": (Metric("output tok/s", "metrics.output_throughput", True),
           Metric("max ITL ms", "metrics.itl_ms.max", False)),
    "S2": (Metric("median TTFT ms", "metrics.ttft_ms.median", False),
           Metric("p99 ITL ms", "metrics.itl_ms.p99", False)),
    "S3": (Metric("median TPOT ms", "metrics.tpot_ms.median", False),
           Metric("median TTFT ms", "metrics.ttft_ms.median", False)),
}


@dataclass(frozen=True)
class Workload:
    sid: str
    text: str
    args: list[str]  # `tokenspeed bench serve` flags
    prompts: int
    est_s: float  # expected run time: what must be left of the budget to start it
    timeout_s: float
    standard: bool  # BENCHMARKS.md's size (only those are comparable with the baseline)


def workloads(quick: bool = False, s1_prompts: int = 2000, s2_prompts: int = 600,
              s1_processes: int = S1_CLIENT_PROCESSES) -> dict[str, Workload]:
    def ds(name: str, inp: int, out: int, n: int) -> list[str]:
        return ["--dataset-name", name, "--random-input-len", str(inp), "--random-output-len", str(out),
                "--num-prompts", str(n)]

    s1_client = ["--num-client-processes", str(s1_processes)]
    if quick:
        return {
            "S3": Workload("S3", "quick: 32 in / 32 out, conc 1, 3 prompts",
                           ds("random-ids", 32, 32, 3) + ["--max-concurrency", "1"], 3, 20, 120, False),
            "S2": Workload("S2", "quick: 64 in / 16 out at 8 req/s, 16 prompts",
                           ds("random-ids", 64, 16, 16) + ["--request-rate", "8", "--seed", "0"], 16, 20,
                           120, False),
            "S1": Workload("S1", "quick: 64 in / 64 out, 32 text prompts, all at once",
                           ds("random", 64, 64, 32) + s1_client, 32, 20, 180, False),
        }
    s2_s = s2_prompts / 8.0
    s1_s = s1_prompts * 1024 / 7000.0  # ~7,300 output tok/s on an H100 in bf16
    return {
        "S3": Workload("S3", "128 in / 512 out, conc 1, 10 prompts",
                       ds("random-ids", 128, 512, 10) + ["--max-concurrency", "1"], 10, 60, 180, True),
        "S2": Workload("S2", f"1024 in / 256 out at 8 req/s (Poisson, seed 0), {s2_prompts} prompts",
                       ds("random-ids", 1024, 256, s2_prompts) + ["--request-rate", "8", "--seed", "0"],
                       s2_prompts, s2_s + 30, s2_s * 1.5 + 120, s2_prompts == STANDARD_PROMPTS["S2"]),
        "S1": Workload("S1", f"1024 in / 1024 out, {s1_prompts} text prompts, all at once",
                       ds("random", 1024, 1024, s1_prompts) + s1_client, s1_prompts, s1_s + 30, s1_s * 1.6 + 90,
                       s1_prompts == STANDARD_PROMPTS["S1"]),
    }


# --- results (scoreboard.jsonl) and resuming --------------------------------------------------

def load_results(out: Path) -> list[dict[str, Any]]:
    path = out / RESULTS
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def append_result(out: Path, entry: dict[str, Any]) -> None:
    with open(out / RESULTS, "a") as f:
        f.write(json.dumps(entry, default=str) + "\n")


def latest(results: Iterable[dict[str, Any]], gpu: str, quick: bool) -> dict[tuple[str, str], dict[str, Any]]:
    """The last entry of each (scenario, precision) measured on `gpu` (quick runs apart)."""
    last: dict[tuple[str, str], dict[str, Any]] = {}
    for e in results:
        if e.get("gpu") == gpu and bool(e.get("quick")) == quick:
            last[(e["scenario"], e["precision"])] = e
    return last


def pending(results: list[dict[str, Any]], gpu: str, quick: bool, wl: dict[str, Workload],
            precisions: Iterable[str], scenarios: Iterable[str], rerun: bool = False) -> dict[str, list[str]]:
    """What is left to run, by precision: every wanted (scenario, precision) unless its last entry
    on this GPU is ok and ran the same workload (or --rerun)."""
    last = latest(results, gpu, quick)
    todo: dict[str, list[str]] = {}
    for prec in precisions:
        sids = []
        for sid in scenarios:
            e = last.get((sid, prec))
            if rerun or e is None or e.get("status") != "ok" or e.get("args") != wl[sid].args:
                sids.append(sid)
        if sids:
            todo[prec] = sids
    return todo


# --- comparison with the last recorded numbers ------------------------------------------------

@dataclass
class Row:
    scenario: str
    precision: str
    metric: str
    now: float | None
    last: float | None
    change_pct: float | None
    flag: str
    recorded: dict[str, Any] | None = None  # the baseline cell (value, commit, date, note)


def compare(now: float | None, last: float | None, higher_is_better: bool,
            threshold_pct: float = THRESHOLD_PCT) -> tuple[float | None, str]:
    """(change in % of the last recorded value, flag): WORSE when more than threshold_pct worse in
    the metric's direction, "better" when more than that better, "new" with nothing recorded."""
    if now is None:
        return None, "not run"
    if last is None or last == 0:
        return None, "new"
    change = (now - last) / abs(last) * 100.0
    worse = -change if higher_is_better else change
    if worse > threshold_pct:
        return change, "WORSE"
    if worse < -threshold_pct:
        return change, "better"
    return change, ""


def baseline_cell(baseline: dict[str, Any], gpu: str, sid: str, prec: str, metric: str) -> dict[str, Any] | None:
    cell = baseline.get(gpu, {}).get(sid, {}).get(prec, {}).get(metric)
    return cell if isinstance(cell, dict) and isinstance(cell.get("value"), (int, float)) else None


def build_rows(entries: dict[tuple[str, str], dict[str, Any]], baseline: dict[str, Any], gpu: str,
               precisions: Iterable[str], scenarios: Iterable[str]) -> list[Row]:
    rows = []
    for sid in scenarios:
        for prec in precisions:
            e = entries.get((sid, prec))
            for m in METRICS[sid]:
                now = None
                if e is not None and e.get("status") == "ok":
                    v = e.get("metrics", {}).get(m.name)
                    now = float(v) if isinstance(v, (int, float)) else None
                cell = baseline_cell(baseline, gpu, sid, prec, m.name)
                last = float(cell["value"]) if cell else None
                change, flag = compare(now, last, m.higher_is_better)
                if now is None and e is not None and e.get("status") != "ok":
                    flag = str(e.get("status", "failed")).upper()
                rows.append(Row(sid, prec, m.name, now, last, change, flag, cell))
    return rows


def fmt(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.2f}"


def render(rows: list[Row], title: str, entries: dict[tuple[str, str], dict[str, Any]],
           wl: dict[str, Workload]) -> str:
    lines = [title, "", "| scenario | precision | metric | now | last recorded | change % | flag |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        change = "-" if r.change_pct is None else f"{r.change_pct:+.1f}%"
        flag = f"**{r.flag}**" if r.flag == "WORSE" else r.flag
        lines.append(f"| {r.scenario} | {r.precision} | {r.metric} | {fmt(r.now)} | {fmt(r.last)} | "
                     f"{change} | {flag} |")
    notes = []
    worse = sum(r.flag == "WORSE" for r in rows)
    notes.append(f"{worse} row(s) more than {THRESHOLD_PCT:g}% worse than the last recorded value"
                 + (" (a regression to fix or to justify in benches/RESULTS.md)" if worse else ""))
    sources: dict[tuple[str, str], int] = {}
    for r in rows:
        if r.recorded:
            key = (str(r.recorded.get("commit")), str(r.recorded.get("date")))
            sources[key] = sources.get(key, 0) + 1
    for (commit, date), n in sorted(sources.items(), key=lambda kv: kv[0][1]):
        notes.append(f"last recorded: {n} row(s) from commit {commit}, {date}")
    for r in rows:
        if r.recorded and r.recorded.get("note"):
            notes.append(f"last recorded {r.scenario} {r.precision} {r.metric}: {r.recorded['note']}")
    runs: dict[str, set[str]] = {}
    for (sid, prec), e in sorted(entries.items()):
        runs.setdefault(f"{e.get('commit')} ({e.get('date')})", set()).add(f"{sid}/{prec}")
        if not e.get("quick") and e.get("prompts") != STANDARD_PROMPTS[sid]:
            notes.append(f"now {sid} {prec}: {e.get('workload')} (not BENCHMARKS.md's size: compare with care)")
        if e.get("length_mismatches"):
            notes.append(f"now {sid} {prec}: {e['length_mismatches']} output length mismatches")
    for src, keys in runs.items():
        notes.append(f"now: commit {src}: {', '.join(sorted(keys))}")
    for sid in SCENARIOS:
        if any(r.scenario == sid for r in rows):
            notes.append(f"{sid}: {wl[sid].text}")
    return "\n".join(lines + [""] + [f"- {n}" for n in notes])


# --- recording --------------------------------------------------------------------------------

def load_baseline(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.exists() else {}


def record(baseline: dict[str, Any], gpu: str, entries: dict[tuple[str, str], dict[str, Any]]) -> int:
    """Writes each ok entry's metrics into baseline[gpu] (with its commit and date; a workload
    other than BENCHMARKS.md's is noted); returns how many values it wrote."""
    n = 0
    for (sid, prec), e in entries.items():
        if e.get("status") != "ok" or e.get("quick"):
            continue
        for m in METRICS[sid]:
            v = e.get("metrics", {}).get(m.name)
            if not isinstance(v, (int, float)):
                continue
            cell: dict[str, Any] = {"value": round(float(v), 2), "commit": e.get("commit"), "date": e.get("date")}
            if e.get("prompts") != STANDARD_PROMPTS[sid]:
                cell["note"] = f"measured with {e.get('prompts')} prompts"
            baseline.setdefault(gpu, {}).setdefault(sid, {}).setdefault(prec, {})[m.name] = cell
            n += 1
    return n


# --- running ----------------------------------------------------------------------------------

def detect_gpu() -> str:
    """torch.cuda.get_device_name() in a child process (this one keeps no CUDA context)."""
    code = "import torch; print(torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu')"
    try:
        res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                             check=False)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    lines = res.stdout.strip().splitlines()
    return lines[-1] if res.returncode == 0 and lines else "unknown"


def repo_commit() -> str | None:
    """HEAD of the checkout this script lies in (None outside git)."""
    try:
        res = subprocess.run(["git", "rev-parse", "--short=7", "HEAD"], capture_output=True, text=True,
                             timeout=5, check=False, cwd=HERE)
        return (res.stdout.strip() or None) if res.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def make_entry(sid: str, prec: str, wl: Workload, status: str, record_: dict[str, Any], gpu: str,
               quick: bool, commit: str | None) -> dict[str, Any]:
    now = datetime.datetime.now(datetime.timezone.utc)
    return {
        "scenario": sid, "precision": prec, "status": status, "gpu": gpu, "quick": quick,
        "commit": commit or (str(record_["commit"])[:7] if record_.get("commit") else None),
        "date": now.date().isoformat(),
        "time": now.isoformat(timespec="seconds"), "workload": wl.text, "prompts": wl.prompts,
        "args": wl.args, "serve_flags": PRECISIONS[prec],
        "metrics": {m.name: gpu_bench.dig(record_, m.path) for m in METRICS[sid]},
        "stagger_starts": record_.get("stagger_starts"),
        "num_client_processes": record_.get("num_client_processes", 1),
        "length_mismatches": record_.get("length_mismatches"), "first_error": record_.get("first_error"),
    }


def run_matrix(a: argparse.Namespace, out: Path, gpu: str, wl: dict[str, Workload],
               precisions: list[str], scenarios: list[str]) -> None:
    t0 = time.monotonic()
    ctx = gpu_bench.Ctx(out=out, deadline=t0 + a.budget_s)
    todo = pending(load_results(out), gpu, a.quick, wl, precisions, scenarios, a.rerun)
    commit = a.commit or repo_commit()  # else the bench record's
    for prec in precisions:
        if prec not in todo:
            print(f"{prec}: {', '.join(scenarios)} already in {out / RESULTS} (--rerun runs them again)",
                  flush=True)
    if not todo:
        return
    layers = a.layers or (2 if a.quick else gpu_bench.MODELS[MODEL][0]["num_hidden_layers"])
    overrides: dict[str, Any] = {}
    serve_args = a.serve_args.split()
    if a.cpu_smoke:  # a narrow model over the tokenizer's own vocabulary
        overrides = gpu_bench.cpu_smoke_overrides(Path(a.tokenizer))
        serve_args = ["--device", "cpu", "--dtype", "float32", "--max-total-tokens", "4096",
                      "--max-running-requests", "16", "--grammar-backend", "none", *serve_args]
    tmp = Path(tempfile.mkdtemp(prefix="ts-scoreboard-"))
    try:
        model_dir = gpu_bench.write_model_dir(tmp, Path(a.tokenizer), layers, overrides, MODEL)
        start_reserve = 30.0 if a.quick else 120.0
        for prec, sids in todo.items():
            if ctx.left() < start_reserve + min(wl[s].est_s for s in sids):
                print(f"{prec}: skipped (out of time: {ctx.left():.0f} s left); runs next time", flush=True)
                continue
            started = gpu_bench.start_server(ctx, model_dir, prec, PRECISIONS[prec] + serve_args,
                                             min(300.0, ctx.left() - 30))
            if started is None:
                for sid in sids:
                    append_result(out, make_entry(sid, prec, wl[sid], "server failed", {}, gpu, a.quick, commit))
                continue
            proc, url = started
            try:
                for sid in sids:
                    w = wl[sid]
                    if ctx.left() < w.est_s + 10:
                        print(f"{sid} {prec}: skipped (~{w.est_s:.0f} s needed, {ctx.left():.0f} s left); "
                              "runs next time", flush=True)
                        continue
                    sc = gpu_bench.Scenario(f"{sid}/{prec}", f"{sid} {prec} ({w.text})", w.args,
                                            [(m.name, m.path, "-") for m in METRICS[sid]], w.timeout_s)
                    status, rec = gpu_bench.run_scenario(ctx, url, model_dir, sc, out / f"server_{prec}.log")
                    if status == "skipped":
                        continue
                    entry = make_entry(sid, prec, w, status, rec, gpu, a.quick, commit)
                    append_result(out, entry)
                    # Why a run failed travels with its line: a failed request's error, or
                    # responses shorter than max_tokens (the bench's length check).
                    why = "" if status == "ok" else (
                        f" first_error={rec.get('first_error')!r} "
                        f"length_mismatches={rec.get('length_mismatches')}")
                    print(f"{sid} {prec}: {status} {json.dumps(entry['metrics'])}{why}", flush=True)
            finally:
                gpu_bench.stop_server(proc)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"matrix: {time.monotonic() - t0:.0f} s", flush=True)


def tokenizer_file(p: Path) -> Path:
    return p / "tokenizer.json" if p.is_dir() else p


def pick(value: str | None, allowed: Iterable[str], what: str) -> list[str]:
    allowed = list(allowed)
    if not value:
        return allowed
    got = [v.strip() for v in value.split(",") if v.strip()]
    bad = [v for v in got if v not in allowed]
    if bad:
        raise SystemExit(f"scoreboard: unknown {what} {bad}; choose from {allowed}")
    return [v for v in allowed if v in got]  # the matrix's order


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokenizer", default=".carry/llama3/tokenizer.json",
                   help="Llama-3 tokenizer.json (or its directory)")
    p.add_argument("--out", default=os.environ.get("OUT") or "scoreboard_out")
    p.add_argument("--budget-s", type=float, default=540.0,
                   help="wall-clock budget of this run (default 540: one 10-minute device command)")
    p.add_argument("--only", default=None, help="comma-separated scenarios (S1,S2,S3)")
    p.add_argument("--only-precision", default=None, help="comma-separated precisions (bf16,fp8-kv,fp8-both)")
    p.add_argument("--s1-prompts", type=int, default=STANDARD_PROMPTS["S1"],
                   help="S1's prompts (default 2000; fewer is not comparable with the baseline)")
    p.add_argument("--s1-client-processes", type=int, default=S1_CLIENT_PROCESSES,
                   help="client processes sending S1 (default 4; 1 is how S1 was measured before session 26)")
    p.add_argument("--s2-prompts", type=int, default=STANDARD_PROMPTS["S2"],
                   help="S2's prompts (default 600; fewer is not comparable with the baseline)")
    p.add_argument("--rerun", action="store_true", help="run again what --out already holds")
    p.add_argument("--report-only", action="store_true", help="print the table of what --out holds")
    p.add_argument("--record", action="store_true",
                   help="write the numbers in --out into the baseline file, for the GPU they ran on")
    p.add_argument("--baseline", default=str(BASELINE), help="(default benches/scenarios/scoreboard_baseline.json)")
    p.add_argument("--gpu", default=None,
                   help="GPU name to run as / report (default: torch.cuda.get_device_name(); "
                        "--report-only: the GPU of the last result in --out)")
    p.add_argument("--commit", default=None,
                   help="commit to store with the results (default: this checkout's HEAD, else the bench record's)")
    p.add_argument("--quick", action="store_true", help="smoke test: 2 layers, tiny workloads")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="check the script without a GPU: a narrow 2-layer config on CPU (implies --quick)")
    p.add_argument("--layers", type=int, default=None, help="override num_hidden_layers")
    p.add_argument("--serve-args", default="", help="extra `tokenspeed serve` flags, one string")
    a = p.parse_args(argv)
    a.quick = a.quick or a.cpu_smoke
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    precisions = pick(a.only_precision, PRECISIONS, "precision")
    scenarios = pick(a.only, SCENARIOS, "scenario")
    wl = workloads(a.quick, a.s1_prompts, a.s2_prompts, a.s1_client_processes)
    if a.report_only:
        results = [e for e in load_results(out) if bool(e.get("quick")) == a.quick]
        gpu = a.gpu or (results[-1]["gpu"] if results else "unknown")
    else:
        if not tokenizer_file(Path(a.tokenizer)).is_file():
            raise SystemExit(f"scoreboard: no tokenizer at {a.tokenizer} (--tokenizer)")
        gpu = a.gpu or ("cpu" if a.cpu_smoke else detect_gpu())
        print(f"GPU: {gpu}", flush=True)
        run_matrix(a, out, gpu, wl, precisions, scenarios)
        results = load_results(out)
    entries = latest(results, gpu, a.quick)
    baseline_path = Path(a.baseline)
    baseline = load_baseline(baseline_path)
    rows = build_rows(entries, {} if a.quick else baseline, gpu, precisions, scenarios)
    if a.quick:  # not the baseline's workload: nothing to compare with
        for r in rows:
            r.flag = "quick" if r.flag == "new" else r.flag
    model_label = gpu_bench.MODELS[MODEL][1]
    title = (f"Scoreboard: {model_label} config, dummy weights, {gpu}"
             + (" [QUICK: 2 layers, tiny workloads, not compared]" if a.quick else ""))
    table = render(rows, title, entries, wl)
    (out / "summary.md").write_text(table + "\n")
    print("\n" + table, flush=True)
    if a.record:
        if a.quick:
            raise SystemExit("scoreboard: --quick results are never recorded")
        n = record(baseline, gpu, {k: v for k, v in entries.items() if k[0] in scenarios and k[1] in precisions})
        baseline_path.write_text(json.dumps(baseline, indent=1) + "\n")
        print(f"recorded {n} value(s) for {gpu} in {baseline_path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
