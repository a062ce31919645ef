#!/usr/bin/env python3
"""BENCHMARKS.md scenarios on one GPU in one time-bounded run (Llama-3.1-8B config, dummy weights;
`--model qwen3-30b-a3b` serves the Qwen3-30B-A3B MoE config instead).

Run on the GPU machine from the repo root, with `tokenspeed._core` importable:

    python benches/scenarios/gpu_bench.py --tokenizer .carry/llama3/tokenizer.json --out "$OUT"

Starts `tokenspeed serve <tmp dir> --load-format dummy` (config.json written here, the Llama-3
tokenizer.json copied beside it), runs `tokenspeed bench serve` for S3, S4, S1 (reduced), S5
(reduced; radix cache on vs off, and 0% sharing), then an HF transformers baseline on the same
dummy architecture, and prints one markdown table. Every step has a timeout; a step that no
longer fits in --budget-s is skipped and says so. Writes under --out: summary.md,
gpu_bench.jsonl (one line per table row), bench_serve.jsonl (raw `bench serve` records) and
the server logs. --quick shrinks the model (2 layers) and every workload for a smoke test.
--quantization fp8 / --kv-cache-dtype fp8 serve FP8 weights / an FP8 KV cache (the summary's
title says which), e.g. `--only S3 --skip-hf --quantization fp8`.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenspeed.bench.model_configs import (
    DEEPSEEK_V2_LITE,
    DEEPSEEK_V3,
    GEMMA3_12B,
    GPT_OSS_20B,
    LLAMA31_8B,
    PHI4,
    QWEN3_30B_A3B,
)

HF_WORKER = "--hf-worker"
# --model → (config, label). Served with the Llama-3 tokenizer: a MoE config's vocabulary is cut to
# the tokenizer's 128256 ids, so that every id a dummy model samples can be detokenized.
MODELS: dict[str, tuple[dict[str, Any], str]] = {
    "llama31-8b": (LLAMA31_8B, "Llama-3.1-8B"),
    "qwen3-30b-a3b": ({**QWEN3_30B_A3B, "vocab_size": 128256, "bos_token_id": LLAMA31_8B["bos_token_id"],
                       "eos_token_id": LLAMA31_8B["eos_token_id"]},
                      "Qwen3-30B-A3B (vocab 128256)"),
    **{name: ({**cfg, "vocab_size": 128256, "bos_token_id": LLAMA31_8B["bos_token_id"],
               "eos_token_id": LLAMA31_8B["eos_token_id"]}, f"{label} (vocab 128256)")
       for name, cfg, label in [("phi-4", PHI4, "Phi-4"), ("gemma-3-12b", GEMMA3_12B, "Gemma-3-12B"),
                                ("gpt-oss-20b", GPT_OSS_20B, "GPT-OSS-20B"),
                                ("deepseek-v2-lite", DEEPSEEK_V2_LITE, "DeepSeek-V2-Lite"),
                                ("deepseek-v3", DEEPSEEK_V3, "DeepSeek-V3 (block FP8)")]},
}
# Flags a model needs beyond the scenario's (none now: "auto" gives every model, GPT-OSS too,
# the triton attention and MoE backends on a GPU).
MODEL_SERVE_ARGS: dict[str, list[str]] = {}


@dataclass
class Scenario:
    sid: str
    label: str
    args: list[str]
    metrics: list[tuple[str, str, str]]  # (metric name, path in the record, floor/target text)
    timeout_s: float
    hit_rate: bool = False


@dataclass
class Ctx:
    out: Path
    deadline: float
    rows: list[dict[str, Any]] = field(default_factory=list)
    records: dict[str, dict[str, Any]] = field(default_factory=dict)

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def row(self, scenario: str, metric: str, value: Any, target: str, **extra: Any) -> None:
        r = {"scenario": scenario, "metric": metric, "value": value, "floor_target": target, **extra}
        self.rows.append(r)
        with open(self.out / "gpu_bench.jsonl", "a") as f:
            f.write(json.dumps(r, default=str) + "\n")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http_get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode(errors="replace")
    except Exception as e:  # noqa: BLE001  (not up yet / no such route)
        return 0, str(e)


def start_server(ctx: Ctx, model_dir: Path, tag: str, extra: list[str],
                 timeout_s: float) -> tuple[subprocess.Popen, str] | None:
    port = free_port()
    cmd = [sys.executable, "-m", "tokenspeed.launch.cli", "serve", str(model_dir), "--load-format", "dummy",
           "--dtype", "bfloat16", "--host", "127.0.0.1", "--port", str(port),
           "--context-length", "8192", "--enable-metrics", *extra]
    log = open(ctx.out / f"server_{tag}.log", "w")  # noqa: SIM115  (the server writes it)
    print(f"$ {' '.join(cmd)}", flush=True)
    t0 = time.monotonic()
    # An A/B of another commit's server with this checkout's client: TOKENSPEED_SERVER_PYTHONPATH
    # names where that commit's wheel is installed (the client stays on PYTHONPATH).
    env = dict(os.environ)
    if os.environ.get("TOKENSPEED_SERVER_PYTHONPATH"):
        env["PYTHONPATH"] = os.environ["TOKENSPEED_SERVER_PYTHONPATH"]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    url = f"http://127.0.0.1:{port}"
    while time.monotonic() - t0 < timeout_s:
        if proc.poll() is not None:
            print(f"server {tag} exited with {proc.returncode}; see server_{tag}.log", flush=True)
            return None
        if http_get(f"{url}/health", 2)[0] == 200:
            print(f"server {tag} healthy after {time.monotonic() - t0:.1f} s", flush=True)
            ctx.row(f"start ({tag})", "server start to /health (s)", round(time.monotonic() - t0, 1),
                    "-", command=cmd)
            return proc, url
        time.sleep(1.0)
    print(f"server {tag} not healthy within {timeout_s:.0f} s", flush=True)
    stop_server(proc)
    return None


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def cache_counters(url: str) -> tuple[float, float] | None:
    """(prompt tokens looked up in the prefix cache, those found) from /metrics, if exposed."""
    code, text = http_get(f"{url}/metrics")
    if code != 200:
        return None
    vals = {}
    queries, hits = "tokenspeed:prefix_cache_queries_total", "tokenspeed:prefix_cache_hits_total"
    for name in (queries, hits):
        m = re.search(rf"^{name}(?:{{[^}}]*}})?\s+([0-9.eE+-]+)", text, re.MULTILINE)
        vals[name] = float(m.group(1)) if m else None
    if None in vals.values():
        return None
    return vals[queries], vals[hits]


def dig(record: dict[str, Any], path: str) -> Any:
    cur: Any = record
    for key in path.split("."):
        if not isinstance(cur, dict) or key not in cur:
            return None
        cur = cur[key]
    return cur


def run_scenario(ctx: Ctx, url: str, tokenizer_dir: Path, sc: Scenario,
                 server_log: Path | None = None) -> tuple[str, dict[str, Any]]:
    """One `tokenspeed bench serve` run; returns its status ("ok", "failed", "timed out",
    "skipped") and its JSON record ({} if none). With TOKENSPEED_STEP_TRACE=1 in the environment
    (the server inherits it), also the step intervals of the run from `server_log`
    (benches/diagnostics/step_intervals.py): the gaps the server produced, beside the client's ITL."""
    timeout = min(sc.timeout_s, ctx.left())
    if timeout < 20:
        ctx.row(sc.label, "skipped", "out of time", "-")
        return "skipped", {}
    raw = ctx.out / "bench_serve.jsonl"
    cmd = [sys.executable, "-m", "tokenspeed.launch.cli", "bench", "serve", "--base-url", url,
           "--tokenizer", str(tokenizer_dir), "--output-file", str(raw), "--tag", sc.sid,
           "--disable-tqdm", *sc.args]
    print(f"\n=== {sc.label}\n$ {' '.join(cmd)}", flush=True)
    before = cache_counters(url) if sc.hit_rate else None
    started = time.monotonic()
    try:
        res = subprocess.run(cmd, timeout=timeout, check=False)
        rc = res.returncode
    except subprocess.TimeoutExpired:
        ctx.row(sc.label, "timed out", f"> {timeout:.0f} s", "-")
        return "timed out", {}
    record: dict[str, Any] = {}
    if raw.exists():
        for line in raw.read_text().splitlines():
            rec = json.loads(line)
            if rec.get("tag") == sc.sid:
                record = rec
    ctx.records[sc.sid] = record
    if server_log is not None and os.environ.get("TOKENSPEED_STEP_TRACE") == "1":
        step_rows(ctx, sc, server_log, (started, time.monotonic()),
                  dig(record, "metrics.slowest_itls") or [])
    if rc != 0 or not record:
        ctx.row(sc.label, "FAILED", f"rc={rc}", "-", first_error=record.get("first_error"))
    mism = record.get("length_mismatches")
    for metric, path, target in sc.metrics:
        val = dig(record, path)
        ctx.row(sc.label, metric, round(val, 2) if isinstance(val, float) else val, target,
                length_mismatches=mism, command=cmd)
    if before is not None:
        after = cache_counters(url)
        if after is not None and after[0] > before[0]:
            hit = (after[1] - before[1]) / (after[0] - before[0])
            ctx.row(sc.label, "prefix cache hit rate (server counters)", round(hit, 3), "-")
    return ("ok" if rc == 0 and record else "failed"), record


def step_rows(ctx: Ctx, sc: Scenario, server_log: Path, window: tuple[float, float],
              client_gaps: list[dict[str, float]]) -> None:
    """The run's step intervals, and for each of the client's slowest gaps the server's steps
    inside it: several steps there put the delay after the server's results (engine, HTTP,
    the client), none puts it in the server's step."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "diagnostics"))
    import step_intervals  # benches/diagnostics/ (not a package), needed only under a step trace

    steps = step_intervals.parse(server_log.read_text(errors="replace"))
    for gap in client_gaps:
        end = float(gap["clock_s"])
        inside = step_intervals.sent_between(steps, end - float(gap["ms"]) / 1e3, end)
        ctx.row(sc.label, "client gap (ms) / server results inside it", round(float(gap["ms"]), 1),
                "-", at_s=round(float(gap["at_s"]), 2), request=gap["request"],
                chunk=gap["chunk"], server_results=len(inside),
                longest_server_interval_ms=round(max(
                    (1e3 * (b.sent_s - a.sent_s) for a, b in itertools.pairwise(inside)),
                    default=0.0), 1))
    s = step_intervals.summarize(step_intervals.intervals(steps, *window))
    if s is None:
        ctx.row(sc.label, "step intervals (server trace)", "no traced steps", "-")
        return
    ctx.row(sc.label, "step interval median / p99 / max ms (server trace)",
            f"{s['median_ms']:.1f} / {s['p99_ms']:.1f} / {s['max_ms']:.1f}", "-",
            slowest=s["slowest"])
    print(f"step intervals (server trace): {s['steps']} steps, median {s['median_ms']:.2f} ms, "
          f"p99 {s['p99_ms']:.2f}, max {s['max_ms']:.2f}; slowest: {s['slowest']}", flush=True)


def scenarios(quick: bool, full: bool = False, model: str = "llama31-8b") -> dict[str, Scenario]:
    def rid(inp: int, out: int, n: int, conc: int | None = None) -> list[str]:
        a = ["--dataset-name", "random-ids", "--random-input-len", str(inp),
             "--random-output-len", str(out), "--num-prompts", str(n)]
        return a + (["--max-concurrency", str(conc)] if conc else [])

    def gsp(groups: int, per: int, sys_len: int, q: int, out: int) -> list[str]:
        return ["--dataset-name", "generated-shared-prefix", "--gsp-num-groups", str(groups),
                "--gsp-prompts-per-group", str(per), "--gsp-system-prompt-len", str(sys_len),
                "--gsp-question-len", str(q), "--gsp-output-len", str(out)]

    q = quick
    tag = "[quick, shrunk workload] " if quick else ""
    # --full: BENCHMARKS.md's sizes (S1 2000 prompts, S5 64 groups); ~10 and ~6 minutes on an H100.
    reduced = "" if full else "REDUCED "
    s1_prompts, s5_groups = (2000, 64) if full else (400, 16)
    s3 = rid(32, 32, 3, 1) if q else rid(128, 512, 10, 1)
    s2, s2_prompts = ((64, 16), 16) if q else ((1024, 256), 600 if full else 200)
    s4 = (512, 4) if q else (4096, 32)
    s1 = rid(64, 64, 32) if q else rid(1024, 1024, s1_prompts)
    g = (2, 4, 256, 32, 16) if q else (s5_groups, 16, 2048, 128, 256)
    g0 = (g[0] * g[1], 1, *g[2:])
    tput = "output_throughput"
    table = {
        "S3": Scenario("S3", "S3 batch-1 (128 in / 512 out, conc 1, 10 prompts)", s3, [
            ("ms/token (median TPOT)", "metrics.tpot_ms.median",
             # Llama-3.1-8B's H100 figures; another model's floor is its own (RESULTS.md)
             "floor 4.5 (datasheet) / 5.0 (measured); SGLang 6.32, vLLM 7.5"
             if model == "llama31-8b" else "-"),
            ("ms/token (mean TPOT)", "metrics.tpot_ms.mean", "-"),
            ("median TTFT ms", "metrics.ttft_ms.median", "-")], 150),
        # Speculation's other regime (issue 32: >= 1.3x at acceptance 3 here, or it turns off).
        "C16": Scenario("C16", "concurrency 16 (128 in / 256 out, 64 prompts)",
                        rid(32, 32, 16, 16) if q else rid(128, 256, 64, 16), [
            ("ms/token (median TPOT)", "metrics.tpot_ms.median", "-"),
            ("output tok/s", f"metrics.{tput}", "-")], 120),
        "S2r8": Scenario("S2r8", f"S2 online {'' if full else 'REDUCED '}(1024/256 at 8 req/s, "
                         f"Poisson, {s2_prompts} prompts)",
                         rid(*s2, s2_prompts) + ["--request-rate", "8", "--seed", "0"], [
            ("median TTFT ms", "metrics.ttft_ms.median", "issue 14: <= 40"),
            ("p99 TTFT ms", "metrics.ttft_ms.p99", "-"),
            ("median TPOT ms", "metrics.tpot_ms.median", "-"),
            ("p99 ITL ms", "metrics.itl_ms.p99", "issue 14: <= 25"),
            ("max ITL ms", "metrics.itl_ms.max", "-"),
            ("GPU idle between steps (share, worker)", "metrics.gpu_idle.gpu_idle_share", "-"),
            ("engine stalled (share)", "metrics.gpu_idle.engine_stalled_share", "-")], 200),
        "S4c1": Scenario("S4c1", "S4 prefill (4096 in / 1 out, 32 prompts, conc 1)",
                         rid(s4[0], 1, s4[1], 1), [
            ("input tok/s", "metrics.input_throughput", "compute bound ~49k tok/s"),
            ("median TTFT ms", "metrics.ttft_ms.median", "-")], 120),
        "S4all": Scenario("S4all", "S4 prefill (4096 in / 1 out, 32 prompts, all at once)",
                          rid(s4[0], 1, s4[1]), [
            ("input tok/s", "metrics.input_throughput", "compute bound ~49k tok/s"),
            ("median TTFT ms", "metrics.ttft_ms.median", "-")], 120),
        "S1r": Scenario("S1r", f"S1 offline {reduced}(1024/1024, {s1_prompts} of 2000 prompts, "
                        "all at once)", s1, [
            ("output tok/s", f"metrics.{tput}", "> 10x HF (HF 494 tok/s)"),
            ("total tok/s", "metrics.total_throughput", "compute bound ~49k tok/s")],
                        600 if full else 240),
        "S5on": Scenario("S5on", f"S5 {reduced}gsp {s5_groups}x16, 2048 sys + 128 q, 256 out, cache ON",
                         gsp(*g), [("output tok/s", f"metrics.{tput}", "ratio on/off > 1"),
                                   ("median TTFT ms", "metrics.ttft_ms.median", "-")], 480 if full else 180,
                         hit_rate=True),
        "S5zero_on": Scenario("S5zero_on", f"S5 {reduced}0% sharing ({s5_groups * 16} groups x 1), cache ON",
                              gsp(*g0), [("output tok/s", f"metrics.{tput}", "~= cache OFF")], 480 if full else 180,
                              hit_rate=True),
        "S5off": Scenario("S5off", f"S5 {reduced}gsp {s5_groups}x16, 2048 sys + 128 q, 256 out, cache OFF",
                          gsp(*g), [("output tok/s", f"metrics.{tput}", "-"),
                                    ("median TTFT ms", "metrics.ttft_ms.median", "-")], 480 if full else 180),
        "S5zero_off": Scenario("S5zero_off", f"S5 {reduced}0% sharing ({s5_groups * 16} groups x 1), cache OFF",
                               gsp(*g0), [("output tok/s", f"metrics.{tput}", "-")], 480 if full else 180),
    }
    for sc in table.values():
        sc.label = tag + sc.label
    return table


def ratio(ctx: Ctx, a: str, b: str, label: str, target: str) -> None:
    x, y = (dig(ctx.records.get(k, {}), "metrics.output_throughput") for k in (a, b))
    if isinstance(x, (int, float)) and isinstance(y, (int, float)) and y > 0:
        ctx.row(label, "throughput ratio", round(x / y, 3), target)


def hf_worker(layers: int, quick: bool, model_name: str = "llama31-8b") -> None:
    """Runs in a subprocess: HF transformers generate on the same dummy architecture."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    base = MODELS[model_name][0]
    cfg = AutoConfig.for_model(base["model_type"], **{k: v for k, v in base.items() if k != "model_type"}
                               | {"num_hidden_layers": layers, "eos_token_id": None})
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg).eval()
    gen = model.generation_config
    gen.eos_token_id, gen.pad_token_id = None, 0

    def timed(batch: int, inp: int, new: int) -> float:
        ids = torch.randint(10, 120000, (batch, inp), device="cuda")
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                                 min_new_tokens=new, do_sample=False)
        torch.cuda.synchronize()
        assert out.shape[1] == inp + new, out.shape
        return time.perf_counter() - t0

    n1 = 8 if quick else 64
    timed(1, 128, 2)  # warm-up
    t_long, t_short = timed(1, 128, n1), timed(1, 128, 1)
    print(json.dumps({"hf_ms_per_token_bs1": (t_long - t_short) / (n1 - 1) * 1e3}), flush=True)
    bs, inp, new = (4, 64, 8) if quick else (32, 512, 64)
    t = timed(bs, inp, new)
    print(json.dumps({"hf_batch_output_tok_s": bs * new / t, "hf_batch": f"{bs} x {inp} in / {new} out"}),
          flush=True)


def run_hf(ctx: Ctx, layers: int, quick: bool, model_name: str = "llama31-8b") -> None:
    timeout = min(150.0, ctx.left())
    if timeout < 30:
        ctx.row("HF transformers baseline", "skipped", "out of time", "-")
        return
    cmd = [sys.executable, __file__, HF_WORKER, "--layers", str(layers), "--model", model_name] + \
        (["--quick"] if quick else [])
    print(f"\n=== HF transformers baseline\n$ {' '.join(cmd)}", flush=True)
    try:
        res = subprocess.run(cmd, timeout=timeout, capture_output=True, text=True, check=False)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        res = None
        print(f"HF baseline timed out after {timeout:.0f} s", flush=True)
    else:
        out = res.stdout
        if res.returncode != 0:
            print(res.stderr[-3000:], flush=True)
    got: dict[str, Any] = {}
    for line in out.splitlines():
        if line.startswith("{"):
            got.update(json.loads(line))
    if "hf_ms_per_token_bs1" in got:
        ms = got["hf_ms_per_token_bs1"]
        ctx.row("HF transformers batch-1 (128 in, generate)", "ms/token", round(ms, 2),
                "BENCHMARKS: HF 100 ms/token")
        s3 = dig(ctx.records.get("S3", {}), "metrics.tpot_ms.median")
        if isinstance(s3, (int, float)) and s3 > 0:
            ctx.row("S3 vs HF", "speed-up (HF ms/token / TokenSpeed ms/token)", round(ms / s3, 1),
                    "> 10x")
    else:
        ctx.row("HF transformers batch-1", "FAILED" if res is not None else "timed out", "-", "-")
    if "hf_batch_output_tok_s" in got:
        ctx.row(f"HF transformers batched generate ({got['hf_batch']})", "output tok/s",
                round(got["hf_batch_output_tok_s"], 1), "BENCHMARKS: HF generate_batch 494 tok/s")


def cpu_smoke_overrides(tokenizer: Path) -> dict[str, Any]:
    """A narrow model over the tokenizer's own vocabulary: the scenarios' --cpu-smoke runs."""
    from tokenizers import Tokenizer

    tok_file = tokenizer / "tokenizer.json" if tokenizer.is_dir() else tokenizer
    return {"hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
            "intermediate_size": 256, "vocab_size": Tokenizer.from_file(str(tok_file)).get_vocab_size()}


def scenario_model(tokenizer: str, cpu_smoke: bool, prefix: str) -> tuple[Path, int]:
    """The Llama-3.1-8B dummy model dir a scenario serves (narrow and 2 layers under --cpu-smoke)
    in a fresh temporary directory, and its layer count."""
    layers = 2 if cpu_smoke else LLAMA31_8B["num_hidden_layers"]
    overrides = cpu_smoke_overrides(Path(tokenizer)) if cpu_smoke else {}
    return write_model_dir(Path(tempfile.mkdtemp(prefix=prefix)), Path(tokenizer), layers, overrides), layers


def write_model_dir(root: Path, tokenizer: Path, layers: int, overrides: dict[str, Any],
                    model_name: str = "llama31-8b") -> Path:
    base = MODELS[model_name][0]
    d = root / f"{model_name}-dummy"
    d.mkdir(parents=True, exist_ok=True)
    cfg = {**base, "num_hidden_layers": layers, **overrides}
    (d / "config.json").write_text(json.dumps(cfg, indent=1))
    tok_file = tokenizer / "tokenizer.json" if tokenizer.is_dir() else tokenizer
    shutil.copy(tok_file, d / "tokenizer.json")
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": base["eos_token_id"]}))
    return d


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokenizer", default=".carry/llama3/tokenizer.json",
                   help="Llama-3 tokenizer.json (or its directory)")
    p.add_argument("--out", default=os.environ.get("OUT") or "bench_out")
    p.add_argument("--budget-s", type=float, default=500.0, help="wall-clock budget of the whole run")
    p.add_argument("--model", choices=sorted(MODELS), default="llama31-8b",
                   help="architecture served with dummy weights (bench/model_configs.py)")
    p.add_argument("--layers", type=int, default=None,
                   help="override num_hidden_layers (default: the model's, 32 / 48)")
    p.add_argument("--quick", action="store_true", help="smoke test: 2 layers, tiny workloads")
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--full", action="store_true",
                   help="BENCHMARKS.md's full S1 (2000 prompts) and S5 (64 groups) workloads")
    p.add_argument("--only", default=None, help="comma-separated scenario ids (S3,C16,S2r8,S4c1,S4all,S1r,S5)")
    p.add_argument("--serve-args", default="", help="extra `tokenspeed serve` flags, one string")
    p.add_argument("--config-overrides", default="{}", help="JSON merged into config.json")
    p.add_argument("--quantization", default=None, help="serve with --quantization (fp8)")
    p.add_argument("--kv-cache-dtype", default=None, help="serve with --kv-cache-dtype (fp8)")
    p.add_argument(HF_WORKER, action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    layers = a.layers or (2 if a.quick else MODELS[a.model][0]["num_hidden_layers"])
    if a.hf_worker:
        hf_worker(layers, a.quick, a.model)
        return 0
    t_start = time.monotonic()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    ctx = Ctx(out=out, deadline=t_start + a.budget_s)
    hf_reserve = 0.0 if a.skip_hf else (45.0 if a.quick else 150.0)
    tmp = Path(tempfile.mkdtemp(prefix="ts-bench-"))
    model_dir = write_model_dir(tmp, Path(a.tokenizer), layers, json.loads(a.config_overrides), a.model)
    sc = scenarios(a.quick, a.full, a.model)
    precision = "bf16" + (f", --quantization {a.quantization}" if a.quantization else "") + (
        f", --kv-cache-dtype {a.kv_cache_dtype}" if a.kv_cache_dtype else "")
    quant_args = (["--quantization", a.quantization] if a.quantization else []) + (
        ["--kv-cache-dtype", a.kv_cache_dtype] if a.kv_cache_dtype else [])
    only = set(a.only.split(",")) if a.only else None

    def wanted(sid: str) -> bool:
        return only is None or sid in only or (sid.startswith("S5") and "S5" in only)

    plan = [("on", [], [k for k in ("S3", "C16", "S2r8", "S4c1", "S4all", "S1r", "S5on", "S5zero_on")
                        if wanted(k)]),
            ("nocache", ["--disable-radix-cache"], [k for k in ("S5off", "S5zero_off") if wanted(k)])]
    for tag, extra, ids in plan:
        if not ids:
            continue
        ctx.deadline = t_start + a.budget_s - hf_reserve
        if ctx.left() < 60:
            ctx.row(f"server ({tag})", "skipped", "out of time", "-")
            continue
        started = start_server(ctx, model_dir, tag, extra + quant_args + MODEL_SERVE_ARGS.get(a.model, [])
                               + a.serve_args.split(),
                               min(300.0, ctx.left() - 30))
        if started is None:
            ctx.row(f"server ({tag})", "FAILED to start", f"see server_{tag}.log", "-")
            continue
        proc, url = started
        try:
            for sid in ids:
                run_scenario(ctx, url, model_dir, sc[sid], ctx.out / f"server_{tag}.log")
        finally:
            stop_server(proc)
    ratio(ctx, "S5on", "S5off", "S5 cache on vs off", "> 1 (hit rate ~ 15/16 of the system prompt)")
    ratio(ctx, "S5zero_on", "S5zero_off", "S5 0% sharing, cache on vs off", "~ 1.0 (overhead)")
    ctx.deadline = t_start + a.budget_s
    if not a.skip_hf:
        run_hf(ctx, layers, a.quick, a.model)
    shutil.rmtree(tmp, ignore_errors=True)
    lines = [(f"GPU bench: {MODELS[a.model][1]} config ({layers} layers), dummy weights, {precision}; "
              f"total {time.monotonic() - t_start:.0f} s"), "",
             "| scenario | metric | value | floor / target |", "|---|---|---|---|"]
    lines += [f"| {r['scenario']} | {r['metric']} | {r['value']} | {r['floor_target']} |" for r in ctx.rows]
    table = "\n".join(lines)
    (out / "summary.md").write_text(table + "\n")
    print("\n" + table, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
