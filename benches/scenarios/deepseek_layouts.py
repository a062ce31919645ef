#!/usr/bin/env python3
"""DeepSeek-V3 at reduced depth on 4 GPUs (--gpus), two layouts, one time-bounded run (issue 39's
"reduced-layer shapes on 1-4 GPUs"): the released V3 architecture (bench/model_configs.py
DEEPSEEK_V3: MLA, 256 routed experts top-8 grouped sigmoid routing, block-FP8 weights) with
--layers layers (default 5: the 3 dense + 2 MoE), dummy weights, vocabulary cut to the Llama-3
tokenizer's 128256 ids.

Run on the 4-GPU machine from the repo root, with `tokenspeed._core` importable:

    python benches/scenarios/deepseek_layouts.py --tokenizer .carry/llama3/tokenizer.json

Layouts: `tp4` (--tp 4: attention heads, dense MLPs and every expert split 4 ways) and `dp4ep4`
(--tp 4 --dp 4 --enable-dp-attention --ep-size 4: 4 attention groups of one GPU, 64 whole experts
per GPU). For each, one server (gpu_bench.start_server) runs S3 (128 in / 512 out, conc 1:
median TPOT, TTFT) and a reduced S1 (--s1-prompts x 1024 in / 256 out at once: output tok/s)
through `tokenspeed bench serve`, then greedy tokens for a few fixed prompts. Then each layout
again at --agree-layers (4: 3 dense + 1 MoE, so both MLP kinds) in float32, eager, for the
greedy agreement of the two layouts: the dummy weights are drawn per full tensor (seeded by name)
and cut, then block-quantised shard by shard on the 128 grid, so both layouts serve the same
numbers (tests/test_dsv3_dummy_fp8.py). First without the quantization_config (fp32 weights:
the layouts differ only in the order of their sums, so the tokens must agree), then, time
permitting, with the block-FP8 weights (near only: activations are quantised on the fly).

Prints one markdown table with, per layout, the weight-read floor of a decode step at batch 1
(bytes of weights the busiest GPU reads / 3.35 TB/s). Writes under --out ($OUT, default
./dsv3_out): summary.md, rows.jsonl, bench_serve.jsonl, greedy.json and servers.log (every
server's log, concatenated). --cpu-smoke: a narrow V3-shaped model, 2 ranks on CPU (gloo,
torch_native MoE), tiny workloads: the same code path end to end.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_bench import MODELS, Ctx, Scenario, dig, run_scenario, start_server, stop_server, write_model_dir

MODEL = "deepseek-v3"
HBM_BYTES_S = 3.35e12  # H100 SXM datasheet
# name → serve flags (GPU), and their 2-rank CPU counterparts.


def gpu_layouts(n: int) -> dict[str, list[str]]:
    """The two layouts on n GPUs: TP n, and n attention groups of one GPU with EP n."""
    return {f"tp{n}": ["--tp", str(n)],
            f"dp{n}ep{n}": ["--tp", str(n), "--dp", str(n), "--enable-dp-attention", "--ep-size", str(n)]}


CPU_LAYOUTS: dict[str, list[str]] = {
    "tp2": ["--tp", "2"],
    "dp2ep2": ["--tp", "2", "--dp", "2", "--enable-dp-attention", "--ep-size", "2"],
}
CPU_FLAGS = ["--device", "cpu", "--dtype", "float32", "--moe-backend", "torch_native",
             "--max-total-tokens", "4096", "--max-running-requests", "8", "--page-size", "4"]
# V3's shape narrowed for --cpu-smoke: every 2-way shard on the 128 grid (as V3's at TP <= 8).
CPU_SHAPE: dict[str, Any] = {
    "hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 256,
    "num_attention_heads": 8, "num_key_value_heads": 8, "q_lora_rank": 128, "kv_lora_rank": 64,
    "qk_nope_head_dim": 32, "qk_rope_head_dim": 32, "v_head_dim": 64, "n_routed_experts": 8,
    "num_experts_per_tok": 2, "n_group": 4, "topk_group": 2, "first_k_dense_replace": 1}
AGREE_TOKENS = 32


def scenarios(cpu: bool, s1_prompts: int, layout: str) -> dict[str, Scenario]:
    def rid(inp: int, out: int, n: int, conc: int | None = None) -> list[str]:
        a = ["--dataset-name", "random-ids", "--random-input-len", str(inp),
             "--random-output-len", str(out), "--num-prompts", str(n), "--seed", "0"]
        return a + (["--max-concurrency", str(conc)] if conc else [])

    (i3, o3, n3), (i1, o1, n1) = ((16, 8, 2), (16, 8, 4)) if cpu else ((128, 512, 4), (1024, 256, s1_prompts))
    s3, s1 = rid(i3, o3, n3, 1), rid(i1, o1, n1)
    return {
        "S3": Scenario(f"{layout}-S3", f"{layout} S3 batch-1 ({i3} in / {o3} out, conc 1, {n3} prompts)", s3, [
            ("ms/token (median TPOT)", "metrics.tpot_ms.median", "floor: table above"),
            ("median TTFT ms", "metrics.ttft_ms.median", "-")], 150),
        "S1r": Scenario(f"{layout}-S1r", f"{layout} S1 REDUCED ({n1} x {i1} in / {o1} out, all at once)", s1, [
            ("output tok/s", "metrics.output_throughput", "-"),
            ("total tok/s", "metrics.total_throughput", "-")], 200),
    }


def decode_floor_bytes(cfg: dict[str, Any], layers: int, layout: str) -> tuple[float, str]:
    """Bytes of weights the busiest GPU reads in one decode step at batch 1, and how counted:
    fp8 linears and experts (1 B), kv_b_proj and the LM head in bf16 (2 B), the router bf16;
    embeddings (one row) and norms left out. tp*: attention, dense MLPs, shared experts and the
    LM head split n ways, each of the top-k experts too (MoE-TP); dp*ep*: all of those whole on
    every GPU, top-k / n whole experts on average on each."""
    n = int(layout[-1])
    tp = 1 if layout.startswith("dp") else n
    h, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    nope, rope, v = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    kv, ql = cfg["kv_lora_rank"], cfg["q_lora_rank"]
    attn = h * ql + h * (kv + rope) + (ql * heads * (nope + rope) + 2 * kv * heads * (nope + v)
                                       + heads * v * h) / tp
    dense = 3 * h * cfg["intermediate_size"] / tp
    expert = 3 * h * cfg["moe_intermediate_size"]
    k, e = cfg["num_experts_per_tok"], cfg["n_routed_experts"]
    routed = k * expert / n if tp > 1 else k / n * expert
    moe = 2 * h * e + cfg.get("n_shared_experts", 1) * expert / tp + routed
    n_dense = min(layers, cfg["first_k_dense_replace"])
    total = layers * attn + n_dense * dense + (layers - n_dense) * moe + 2 * cfg["vocab_size"] * h / tp
    how = (f"experts split {n} ways (MoE-TP)" if tp > 1 else f"{k}/{n} whole experts per GPU (mean)")
    return total, how


def generate_ids(url: str, prompt: list[int], n: int, timeout: float) -> list[int]:
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": n, "temperature": 0,
                                                     "ignore_eos": True}}
    req = urllib.request.Request(f"{url}/generate", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return [int(t) for t in json.loads(r.read())["output_ids"]]


def agreement_prompts(count: int = 6) -> list[list[int]]:
    """Fixed token-id prompts (16-56 ids from the Llama-3 text range), the same every run."""
    import random

    rng = random.Random(39)
    return [[rng.randrange(1000, 100000) for _ in range(16 + 8 * i)] for i in range(count)]


def greedy(ctx: Ctx, url: str, tag: str, n: int = AGREE_TOKENS) -> list[list[int]] | None:
    out = []
    try:
        for p in agreement_prompts():
            out.append(generate_ids(url, p, n, timeout=max(10.0, min(120.0, ctx.left()))))
    except Exception as e:  # noqa: BLE001  (report, do not stop the run)
        print(f"greedy ({tag}) failed: {type(e).__name__}: {e}", flush=True)
        ctx.row(f"greedy ({tag})", "FAILED", f"{type(e).__name__}: {e}"[:200], "-")
        return None
    return out


def compare(a: list[list[int]], b: list[list[int]]) -> dict[str, float]:
    """Share of positions with the same token, mean common-prefix share, prompts identical."""
    same = sum(x == y for sa, sb in zip(a, b) for x, y in zip(sa, sb))
    total = sum(min(len(sa), len(sb)) for sa, sb in zip(a, b))
    prefixes = []
    for sa, sb in zip(a, b):
        k = 0
        while k < min(len(sa), len(sb)) and sa[k] == sb[k]:
            k += 1
        prefixes.append(k / max(1, len(sa)))
    return {"identical_tokens": round(same / max(1, total), 4),
            "mean_prefix_share": round(sum(prefixes) / max(1, len(prefixes)), 4),
            "prompts_identical": sum(sa == sb for sa, sb in zip(a, b)), "prompts": len(a)}


def serve_layout(ctx: Ctx, model_dir: Path, tag: str, flags: list[str], ids: list[str],
                 scs: dict[str, Scenario], start_s: float) -> list[list[int]] | None:
    """One server: the scenarios `ids`, then the greedy tokens of the fixed prompts."""
    if ctx.left() < 60:
        ctx.row(f"server ({tag})", "skipped", "out of time", "-")
        return None
    started = start_server(ctx, model_dir, tag, flags, min(start_s, ctx.left() - 20))
    if started is None:
        ctx.row(f"server ({tag})", "FAILED to start", f"see servers.log ({tag})", "-")
        return None
    proc, url = started
    try:
        for sid in ids:
            run_scenario(ctx, url, model_dir, scs[sid])
        return greedy(ctx, url, tag)
    finally:
        stop_server(proc)


def agreement(ctx: Ctx, a: argparse.Namespace, layouts: dict[str, list[str]], base: list[str],
              tokens: dict[str, Any]) -> None:
    """Each layout at --agree-layers in float32, eager; their greedy tokens compared (`_agree`)."""
    tmp = Path(tempfile.mkdtemp(prefix="ts-dsv3-agree-"))
    d = write_model_dir(tmp, Path(a.tokenizer), a.agree_layers, dict(CPU_SHAPE) if a.cpu_smoke else {}, MODEL)
    try:
        _agree(ctx, a, layouts, base, tokens, d)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _agree(ctx: Ctx, a: argparse.Namespace, layouts: dict[str, list[str]], base: list[str],
           tokens: dict[str, Any], d: Path) -> None:
    """fp32 weights first: the layouts then differ only in the order of their sums, so their
    greedy tokens must agree. Then, time permitting, the block-FP8 weights, where each linear
    quantises its input per 128-group on the fly: a last-bit difference can round a value to
    another FP8 step, so agreement there is near, not exact (session 26: 0.07 on two H200s)."""
    fp32 = ["--dtype", "float32", "--disable-cuda-graph"]
    quantized = json.loads((d / "config.json").read_text())
    for variant in ("nofp8", "fp8"):
        cfg = dict(quantized)
        if variant == "nofp8":
            cfg.pop("quantization_config", None)
        (d / "config.json").write_text(json.dumps(cfg, indent=1))
        if ctx.left() < 150:
            ctx.row(f"greedy agreement ({variant})", "skipped", "out of time", "-")
            return
        got = {name: serve_layout(ctx, d, f"agree-{variant}-{name}", base + flags + fp32, [], {}, a.start_s)
               for name, flags in layouts.items()}
        tokens.update({f"fp32 {variant} {name}": g for name, g in got.items()})
        a_, b_ = got.values()
        if a_ is None or b_ is None:
            continue
        res = compare(a_, b_)
        label = (f"greedy agreement {' vs '.join(layouts)}: fp32, {a.agree_layers} layers, "
                 f"{'block-FP8 weights' if variant == 'fp8' else 'fp32 weights (no FP8)'}")
        target = "1.0" if variant == "nofp8" else "near (FP8 activation rounding)"
        ctx.row(label, f"identical tokens (of {AGREE_TOKENS} x {res['prompts']})",
                res["identical_tokens"], target, **res)
        ctx.row(label, "mean common prefix / prompts identical",
                f"{res['mean_prefix_share']} / {res['prompts_identical']} of {res['prompts']}", target)


def merge_logs(out: Path) -> None:
    """Every server_*.log into servers.log (first 150 and last 400 lines of each)."""
    with open(out / "servers.log", "w") as dst:
        for log in sorted(out.glob("server_*.log")):
            lines = log.read_text(errors="replace").splitlines()
            if len(lines) > 550:
                lines = lines[:150] + [f"... ({len(lines) - 550} lines left out) ..."] + lines[-400:]
            dst.write(f"===== {log.name}\n" + "\n".join(lines) + "\n")
            log.unlink()


def table(ctx: Ctx, a: argparse.Namespace, layers: int, layouts: dict[str, list[str]],
          elapsed: float) -> str:
    cfg = {**MODELS[MODEL][0], **(CPU_SHAPE if a.cpu_smoke else {})}
    k = cfg["first_k_dense_replace"]
    title = (f"DeepSeek-V3 config ({layers} layers: {min(layers, k)} dense + {max(0, layers - k)} MoE), "
             "dummy block-FP8 weights, bf16, vocab 128256"
             f"{' [CPU SMOKE: narrow model, 2 ranks]' if a.cpu_smoke else ''}; total {elapsed:.0f} s")
    lines = [title, "", ("| layout | S3 median TPOT ms | weight-read floor ms/token | S3 median TTFT ms | "
                         "S1 output tok/s | server start s |"), "|---|---|---|---|---|---|"]
    for name in layouts:
        floor, how = decode_floor_bytes(cfg, layers, name)
        start = next((r["value"] for r in ctx.rows if r["scenario"] == f"start ({name})"), "-")

        def m(sid: str, path: str, name: str = name) -> Any:
            v = dig(ctx.records.get(f"{name}-{sid}", {}), path)
            return round(v, 2) if isinstance(v, float) else ("-" if v is None else v)

        lines.append(f"| {name} | {m('S3', 'metrics.tpot_ms.median')} | {floor / HBM_BYTES_S * 1e3:.3f} "
                     f"({floor / 1e9:.2f} GB/GPU; {how}) | {m('S3', 'metrics.ttft_ms.median')} | "
                     f"{m('S1r', 'metrics.output_throughput')} | {start} |")
    lines += ["", "| scenario | metric | value | floor / target |", "|---|---|---|---|"]
    lines += [f"| {r['scenario']} | {r['metric']} | {r['value']} | {r['floor_target']} |" for r in ctx.rows]
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokenizer", default=".carry/llama3/tokenizer.json", help="Llama-3 tokenizer.json")
    p.add_argument("--out", default=os.environ.get("OUT") or "dsv3_out")
    p.add_argument("--budget-s", type=float, default=520.0, help="wall-clock budget of the whole run")
    p.add_argument("--layers", type=int, default=5, help="layers served for S3 / S1 (3 dense + rest MoE)")
    p.add_argument("--agree-layers", type=int, default=4, help="layers of the fp32 agreement runs")
    p.add_argument("--s1-prompts", type=int, default=512)
    p.add_argument("--gpus", type=int, default=4, help="GPUs of each layout (tpN vs dpNepN)")
    p.add_argument("--start-s", type=float, default=240.0, help="longest wait for one server to start")
    p.add_argument("--skip-agreement", action="store_true", help="no fp32 agreement servers")
    p.add_argument("--serve-args", default="", help="extra `tokenspeed serve` flags, one string")
    p.add_argument("--cpu-smoke", action="store_true", help="narrow V3 shape, 2 CPU ranks, tiny workloads")
    a = p.parse_args()
    t0 = time.monotonic()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    for f in ("gpu_bench.jsonl", "bench_serve.jsonl"):
        (out / f).unlink(missing_ok=True)
    ctx = Ctx(out=out, deadline=t0 + a.budget_s)
    import tokenspeed.layers.quantization.fp8 as fp8_mod

    if not hasattr(fp8_mod, "quantize_blocks"):  # a tokenspeed older than this script
        ctx.row("WARNING", f"{fp8_mod.__file__} predates block-FP8 dummy weights",
                "experts bf16, linears per-channel: not V3's bytes, layouts' weights may differ", "-")
    layers = 2 if a.cpu_smoke and a.layers == 5 else a.layers
    if a.cpu_smoke and a.agree_layers == 4:
        a.agree_layers = 2
    layouts = CPU_LAYOUTS if a.cpu_smoke else gpu_layouts(a.gpus)
    base = (CPU_FLAGS if a.cpu_smoke else []) + a.serve_args.split()
    d = write_model_dir(Path(tempfile.mkdtemp(prefix="ts-dsv3-")), Path(a.tokenizer), layers,
                        dict(CPU_SHAPE) if a.cpu_smoke else {}, MODEL)
    tokens: dict[str, Any] = {"prompts": agreement_prompts()}
    for name, flags in layouts.items():
        scs = scenarios(a.cpu_smoke, a.s1_prompts, name)
        tokens[f"bf16 {name}"] = serve_layout(ctx, d, name, base + flags, list(scs), scs, a.start_s)
    x, y = (tokens[f"bf16 {n}"] for n in layouts)
    if x is not None and y is not None:
        res = compare(x, y)
        ctx.row(f"greedy agreement {' vs '.join(layouts)}: {'fp32' if a.cpu_smoke else 'bf16'}, {layers} "
                "layers, block-FP8 (bench servers)",
                f"identical tokens / mean prefix / prompts identical (of {AGREE_TOKENS} x {res['prompts']})",
                f"{res['identical_tokens']} / {res['mean_prefix_share']} / {res['prompts_identical']}",
                "bf16: near, not exact", **res)
    if not a.skip_agreement:
        agreement(ctx, a, layouts, base, tokens)
    shutil.rmtree(d.parent, ignore_errors=True)
    (out / "greedy.json").write_text(json.dumps(tokens))
    merge_logs(out)
    if (out / "gpu_bench.jsonl").exists():
        (out / "gpu_bench.jsonl").replace(out / "rows.jsonl")
    text = table(ctx, a, layers, layouts, time.monotonic() - t0)
    (out / "summary.md").write_text(text + "\n")
    print("\n" + text, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
