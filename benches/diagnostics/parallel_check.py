#!/usr/bin/env python3
"""Tensor and expert parallelism on 2 GPUs through `tokenspeed serve`: greedy tokens at 1 and 2
GPUs must agree, and S3 (batch-1 decode ms/token) on each.

  --mode tp  Llama-3.1-8B config (dummy weights: the same model at any TP, weights.py draws every
             full tensor from a per-name seed and each rank keeps its shard), `--tp 1` vs `--tp 2`
             (NCCL all-reduces inside the decode CUDA graphs); also the all-reduce cost: 64
             all-reduces of [1, 4096] bf16 (one 8B decode step: two per layer) in one CUDA graph.
  --mode ep  Qwen3-30B-A3B shape (128 experts, top 8; vocabulary cut to the Llama-3 tokenizer's
             128256 ids, as gpu_bench.py's `--model qwen3-30b-a3b`), `--tp 1` (every expert on
             one GPU) vs `--tp 2 --ep-size 2` (64 experts per GPU, MoE partial outputs
             all-reduced: `--all2all-backend naive`).
  --mode dpattn  the same Qwen3-30B-A3B shape, `--tp 1` vs data-parallel attention `--tp 2 --dp 2
             --enable-dp-attention --ep-size 2` (two attention groups of one GPU, each its own
             engine; MoE tokens all-gathered: `allgather_reducescatter`). Prompts go one at a
             time, so one group runs idle forward passes at every step: decode steps replay a
             CUDA graph on both GPUs (the idle one on padding rows), prefill steps run eager;
             the table reports the server log's count of graph replays. `dpattn-eager`: the
             same with `--disable-cuda-graph` on the 2-GPU server (the eager baseline).
  --mode dense-dpattn  the tp model under `--tp 2 --dp 2 --enable-dp-attention`: two engines of
             one GPU each, ordinary decode and extend graphs on each.
  --mode epa2a / dpa2a  ep / dpattn with `--all2all-backend torch_all2all`: each token sent only
             to the GPU holding its experts (NCCL all_to_all_single, split sizes read on the host:
             eager, no CUDA graphs); a lone decode token leaves one GPU, the other sends nothing.

Run on a 2-GPU machine from the repo root, with `tokenspeed._core` importable:

    python benches/diagnostics/parallel_check.py --mode tp --tokenizer .carry/llama3/tokenizer.json \
        --out "$OUT"

Checks (`--checks`, comma-separated; default both):
  fp32  4 layers in fp32: the 2-GPU server's greedy tokens on 4 short prompts (32 new tokens
        each, through /generate with input ids) must equal the 1-GPU server's exactly (a split
        sum's fp32 rounding stays far below the logit gaps). Exit code 1 otherwise.
  bf16  every layer in bf16: the same prompts; continuations agree until a near-tie (bf16
        partial sums are rounded before the all-reduce), so at each first divergence the 1-GPU
        run's own top-1/top-2 logprob gap is printed; then S3 (128 in / 512 out, 10 prompts:
        gpu_bench.py's scenario) on each server while it is up.
`--cpu-smoke`: a narrow 2-layer config on gloo CPU ranks (fp32 check only), to check the script
without GPUs:
`python benches/diagnostics/parallel_check.py --mode ep --cpu-smoke --tokenizer <tokenizer.json>`.
Prints one table, and writes it to OUT/<mode>_check.md and OUT/<mode>_check.json.
(An earlier tp_check.py compared ModelRunner ranks without a server; on the H200 pair its TP=2
offline loop never returned while `serve --tp 2` worked, so the check now goes through serve,
as users do.)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scenarios"))  # gpu_bench (not a package)
import gpu_bench

PROMPT_LENS, NEW_TOKENS = (9, 16, 23, 31), 32
# Per mode: the model and the serve flags at 1 and 2 GPUs.
MODES: dict[str, tuple[str, dict[int, list[str]]]] = {
    "tp": ("llama31-8b", {1: ["--tp", "1"], 2: ["--tp", "2"]}),
    "ep": ("qwen3-30b-a3b", {1: ["--tp", "1"], 2: ["--tp", "2", "--ep-size", "2"]}),
    "dpattn": ("qwen3-30b-a3b", {1: ["--tp", "1"], 2: ["--tp", "2", "--dp", "2",
                                                       "--enable-dp-attention", "--ep-size", "2"]}),
    # A dense model under data-parallel attention: two independent engines, each with its
    # own decode and extend graphs (the groups never meet in a collective).
    "dense-dpattn": ("llama31-8b", {1: ["--tp", "1"], 2: ["--tp", "2", "--dp", "2",
                                                          "--enable-dp-attention"]}),
    # dpattn with the graphs off: the eager baseline of its S3 (bf16 check).
    "dpattn-eager": ("qwen3-30b-a3b", {1: ["--tp", "1"], 2: ["--tp", "2", "--dp", "2",
                                                             "--enable-dp-attention", "--ep-size",
                                                             "2", "--disable-cuda-graph"]}),
    "epa2a": ("qwen3-30b-a3b", {1: ["--tp", "1"], 2: ["--tp", "2", "--ep-size", "2",
                                                      "--all2all-backend", "torch_all2all"]}),
    "dpa2a": ("qwen3-30b-a3b", {1: ["--tp", "1"], 2: ["--tp", "2", "--dp", "2",
                                                      "--enable-dp-attention", "--ep-size", "2",
                                                      "--all2all-backend", "torch_all2all"]}),
}


def greedy(url: str, prompts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    """Per prompt: the greedy output ids and, per position, the top-1 minus top-2 logprob."""
    out = []
    for p in prompts:
        body = json.dumps({"input_ids": p, "return_logprob": True, "top_logprobs_num": 2,
                           "sampling_params": {"temperature": 0, "max_new_tokens": NEW_TOKENS,
                                               "ignore_eos": True}}).encode()
        req = urllib.request.Request(f"{url}/generate", body, {"content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as r:
            res = json.loads(r.read())
        tops = res["meta_info"].get("output_top_logprobs") or []
        gaps = [float(t[0][0] - t[1][0]) if len(t) > 1 else float("inf") for t in tops]
        out.append((list(res["output_ids"]), gaps))
    return out


def compare(name: str, ref: list[tuple[list[int], list[float]]],
            got: list[tuple[list[int], list[float]]]) -> dict[str, Any]:
    agree, gaps = [], []
    for (r_ids, r_gaps), (g_ids, _) in zip(ref, got):
        n = next((i for i, (a, b) in enumerate(zip(r_ids, g_ids)) if a != b), min(len(r_ids), len(g_ids)))
        agree.append(n)
        if n < NEW_TOKENS and n < len(r_gaps):
            gaps.append(round(r_gaps[n], 4))
    same = all(n == NEW_TOKENS for n in agree)
    print(f"[{name}] identical: {same}; agreeing prefix per prompt {agree} of {NEW_TOKENS}; "
          f"1-GPU top-1/top-2 logprob gap at each divergence {gaps}", flush=True)
    return {"check": name, "identical": same, "agreeing_prefix": agree, "gaps_at_divergence": gaps}


def run_check(out: Path, model: Path, dtype: str, prompts: list[list[int]], s3: bool,
              cpu: bool, gpu_flags: dict[int, list[str]]
              ) -> tuple[dict[int, Any], dict[int, Any], str | None]:
    """Serve the model on 1 then 2 GPUs: greedy tokens (and S3) from each, and under
    data-parallel attention the server log's last line on decode graphs. A server that does
    not start leaves a string in place of its tokens."""
    tokens: dict[int, Any] = {}
    s3_ms: dict[int, Any] = {}
    graphs = None
    for ep, flags in gpu_flags.items():
        tag = f"{dtype}_{'_'.join(f.strip('-') for f in flags)}"
        ctx = gpu_bench.Ctx(out=out, deadline=time.monotonic() + 500)
        extra = [*flags, "--dtype", dtype]  # the later --dtype wins over gpu_bench's bfloat16
        if cpu:
            extra += ["--device", "cpu", "--max-total-tokens", "2048", "--max-running-requests", "4"]
        started = gpu_bench.start_server(ctx, model, tag, extra, 600)
        if started is None:
            tokens[ep] = s3_ms[ep] = f"server failed (see server_{tag}.log)"
            continue
        proc, url = started
        try:
            tokens[ep] = greedy(url, prompts)
            if s3:
                sc = gpu_bench.scenarios(quick=False)["S3"]
                gpu_bench.run_scenario(ctx, url, model, sc)
                s3_ms[ep] = gpu_bench.dig(ctx.records.get("S3", {}), "metrics.tpot_ms.median")
        finally:
            gpu_bench.stop_server(proc)
        if "--enable-dp-attention" in flags:  # the worker logs how many steps replayed a graph
            log = (out / f"server_{tag}.log").read_text(errors="replace").splitlines()
            said = [ln for ln in log if "decode CUDA graph" in ln]
            graphs = said[-1].split("INFO ")[-1] if said else "no decode CUDA graph line"
    return tokens, s3_ms, graphs


def _allreduce_rank(rank: int, init: str, out: Any) -> None:
    try:
        import torch

        from tokenspeed.distributed.groups import (
            ParallelSizes,
            destroy_distributed,
            init_distributed,
            tp_all_reduce,
        )

        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        init_distributed(rank, ParallelSizes(2, 2, 2, 2), init, device, 120)
        x = torch.zeros(1, 4096, dtype=torch.bfloat16, device=device)
        s = torch.cuda.Stream(device)
        s.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(s):
            for _ in range(3):
                tp_all_reduce(x)
        torch.cuda.synchronize(device)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s):
            for _ in range(64):
                tp_all_reduce(x)
        for _ in range(5):
            g.replay()
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for _ in range(50):
            g.replay()
        torch.cuda.synchronize(device)
        out.put((rank, (time.perf_counter() - t0) / 50 * 1e3))
        destroy_distributed()
    except BaseException as e:  # noqa: BLE001  (reported by the parent)
        out.put((rank, f"failed: {e!r}"))


def allreduce_ms() -> Any:
    """ms per 8B decode step's worth of all-reduces (64 x [1, 4096] bf16, one CUDA graph)."""
    import multiprocessing as mp

    from tokenspeed.distributed.groups import free_tcp_port

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    init = f"tcp://127.0.0.1:{free_tcp_port()}"
    procs = [ctx.Process(target=_allreduce_rank, args=(r, init, q)) for r in range(2)]
    for pr in procs:
        pr.start()
    try:
        got = dict(q.get(timeout=180) for _ in procs)
    except Exception as e:  # noqa: BLE001
        got = {0: f"failed: {e!r}"}
    for pr in procs:
        pr.join(timeout=10)
        if pr.is_alive():
            pr.terminate()
    return got.get(0)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=sorted(MODES), required=True)
    p.add_argument("--tokenizer", default=".carry/llama3/tokenizer.json")
    p.add_argument("--out", default=os.environ.get("OUT") or "parallel_out")
    p.add_argument("--checks", default="fp32,bf16", help="comma-separated: fp32, bf16")
    p.add_argument("--skip-s3", action="store_true", help="bf16 tokens only")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="check the script on CPU: a narrow 2-layer config, the fp32 check only")
    a = p.parse_args()
    model_name, gpu_flags = MODES[a.mode]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"ts-{a.mode}-"))
    checks = ["fp32"] if a.cpu_smoke else [c for c in a.checks.split(",") if c]
    shrink: dict[str, Any] = {}
    if a.cpu_smoke:  # a narrow model (8 experts for ep) with the tokenizer's own vocabulary
        from tokenizers import Tokenizer

        vocab = Tokenizer.from_file(a.tokenizer).get_vocab_size()
        shrink = {"hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
                  "head_dim": 32, "intermediate_size": 256, "vocab_size": vocab}
        if a.mode != "tp":
            shrink |= {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64}
    config = gpu_bench.MODELS[model_name][0]
    vocab = shrink.get("vocab_size", config["vocab_size"])
    rng = np.random.default_rng(0)
    prompts = [rng.integers(100, vocab - 1, n).tolist() for n in PROMPT_LENS]
    rows: list[dict[str, Any]] = []
    s3: dict[int, Any] = {}
    ok = True
    label = {n: " ".join(f) for n, f in gpu_flags.items()}
    for check in checks:
        dtype, layers = {"fp32": ("float32", 2 if a.cpu_smoke else 4),
                         "bf16": ("bfloat16", config["num_hidden_layers"])}[check]
        model = gpu_bench.write_model_dir(tmp / check, Path(a.tokenizer), layers, shrink, model_name)
        tokens, s3_ms, graphs = run_check(out, model, dtype, prompts,
                                          check == "bf16" and not a.skip_s3, a.cpu_smoke, gpu_flags)
        name = (f"{model_name} {dtype} {layers} layers, {label[2]} vs {label[1]}"
                + (" (must be identical)" if check == "fp32" else ""))
        if all(isinstance(tokens.get(n), list) for n in gpu_flags):
            rows.append(compare(name, tokens[1], tokens[2]))
            ok &= rows[-1]["identical"] or check != "fp32"
        else:
            rows.append({"check": name, "value": f"1 GPU: {tokens.get(1)}; 2 GPUs: {tokens.get(2)}"})
            ok = False
        if graphs is not None:
            rows.append({"check": f"decode CUDA graphs, {dtype}, {label[2]} (server log)",
                         "value": graphs})
        s3.update(s3_ms)
    if a.mode == "tp" and not a.cpu_smoke:
        rows.append({"check": "all-reduce ms per 8B decode step (64 x [1, 4096] bf16, one graph)",
                     "value": allreduce_ms()})
    lines = ["| check | result |", "|---|---|"]
    for r in rows:
        lines.append(f"| {r['check']} | " + (f"{r['value']}" if "value" in r else
                     f"identical={r['identical']} prefix={r['agreeing_prefix']} "
                     f"gaps={r['gaps_at_divergence']}") + " |")
    for n, v in s3.items():
        lines.append(f"| S3 median TPOT ms/token, {label[n]} | {v} |")
    if isinstance(s3.get(1), float) and isinstance(s3.get(2), float):
        lines.append(f"| S3 2-GPU speed-up | {s3[1] / s3[2]:.2f}x |")
    table = "\n".join(lines)
    (out / f"{a.mode}_check.md").write_text(table + "\n")
    (out / f"{a.mode}_check.json").write_text(json.dumps({"rows": rows, "s3": s3}, default=str))
    print("\n" + table, flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
