#!/usr/bin/env python3
"""S9 multi-LoRA (BENCHMARKS.md): the adapters' overhead against the base model, one GPU,
Llama-3.1-8B config with dummy weights and random rank-16 adapters on all seven projections.

Run on the GPU machine from the repo root, with `tokenspeed._core` importable:

    python benches/scenarios/lora_bench.py --tokenizer .carry/llama3/tokenizer.json --out "$OUT"

One server (`--lora-paths` with 8 adapters, `--max-loras-per-batch 8`) serves both sides, so
the only difference is the adapter:

1. decode at batch 32: 32 streams at once (256 in / 256 out, ignore_eos), first all on the
   base model, then each on an adapter (request i on adapter i % 8: every step mixes the 8).
   Metric: the mean time per output token after the first (TPOT), and its ratio to the base
   model's (target: LoRA within 15%).
2. S3 with one adapter: `tokenspeed bench serve` (128 in / 512 out, concurrency 1, 20 prompts)
   with `--model adapter0`, and with the base model (target: within 10%).

Writes summary.md and lora_bench.jsonl under --out. --quick: 2 layers, fewer tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
import gpu_bench  # the scenario runner's server helpers, beside this file

NUM_ADAPTERS, RANK = 8, 16
MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def write_adapters(root: Path, cfg: dict[str, Any], layers: int) -> list[Path]:
    """NUM_ADAPTERS random PEFT adapters of rank RANK over MODULES (bf16 safetensors)."""
    import torch
    from safetensors.torch import save_file

    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    hd = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    shapes = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
              "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}
    paths = []
    for a in range(NUM_ADAPTERS):
        d = root / f"adapter{a}"
        d.mkdir(parents=True, exist_ok=True)
        gen = torch.Generator().manual_seed(a)
        tensors = {}
        for layer in range(layers):
            for m in MODULES:
                fin, fout = shapes[m]
                part = "self_attn" if m.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "mlp"
                key = f"base_model.model.model.layers.{layer}.{part}.{m}"
                tensors[f"{key}.lora_A.weight"] = (torch.randn(RANK, fin, generator=gen) * 0.01).bfloat16()
                tensors[f"{key}.lora_B.weight"] = (torch.randn(fout, RANK, generator=gen) * 0.01).bfloat16()
        save_file(tensors, str(d / "adapter_model.safetensors"))
        (d / "adapter_config.json").write_text(json.dumps(
            {"peft_type": "LORA", "r": RANK, "lora_alpha": 2 * RANK, "target_modules": MODULES,
             "bias": "none"}))
        paths.append(d)
    return paths


async def decode_tpot(url: str, models: list[str], prompt_len: int, out_len: int) -> float:
    """Mean seconds per output token after the first, over len(models) concurrent streams."""
    import httpx

    prompt = list(range(1000, 1000 + prompt_len))

    async def one(client: httpx.AsyncClient, i: int, model: str) -> float:
        body = {"model": model, "prompt": [p + i for p in prompt], "max_tokens": out_len,
                "temperature": 0, "ignore_eos": True, "stream": True}
        times = []
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    times.append(time.monotonic())
        return (times[-1] - times[0]) / max(1, len(times) - 1)

    async with httpx.AsyncClient(timeout=600) as client:
        tpots = await asyncio.gather(*(one(client, i, m) for i, m in enumerate(models)))
    return sum(tpots) / len(tpots)


def bench_serve_s3(url: str, tokenizer_dir: Path, model: str, out: Path, quick: bool) -> float | None:
    n, inp, outl = (4, 32, 32) if quick else (20, 128, 512)
    cmd = [sys.executable, "-m", "tokenspeed.launch.cli", "bench", "serve", "--base-url", url,
           "--model", model, "--tokenizer", str(tokenizer_dir), "--num-prompts", str(n),
           "--random-input-len", str(inp), "--random-output-len", str(outl),
           "--max-concurrency", "1", "--ignore-eos", "--output-file", str(out / "bench_serve.jsonl"),
           "--tag", f"S3 {model}", "--disable-tqdm"]
    print("$", " ".join(cmd), flush=True)
    if subprocess.run(cmd, check=False, timeout=900).returncode != 0:
        return None
    last = (out / "bench_serve.jsonl").read_text().strip().splitlines()[-1]
    rec = json.loads(last)
    return gpu_bench.dig(rec, "metrics.tpot_ms.mean")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokenizer", required=True, type=Path, help="Llama-3 tokenizer.json (or its dir)")
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--budget-s", type=float, default=1500)
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    ctx = gpu_bench.Ctx(args.out, time.monotonic() + args.budget_s)
    layers = 2 if args.quick else gpu_bench.LLAMA31_8B["num_hidden_layers"]
    root = Path(tempfile.mkdtemp(prefix="lora-bench-"))
    model_dir = gpu_bench.write_model_dir(root, args.tokenizer, layers, {})
    adapters = write_adapters(root / "adapters", gpu_bench.LLAMA31_8B, layers)
    names = [f"adapter{i}" for i in range(NUM_ADAPTERS)]
    extra = ["--lora-paths", *[f"{n}={p}" for n, p in zip(names, adapters)],
             "--max-loras-per-batch", str(NUM_ADAPTERS), "--max-lora-rank", str(RANK)]
    started = gpu_bench.start_server(ctx, model_dir, "lora", extra, 600)
    if started is None:
        return 1
    proc, url = started
    results: dict[str, Any] = {}
    try:
        base = json.loads(gpu_bench.http_get(f"{url}/v1/models")[1])["data"][0]["id"]
        inp, outl = (32, 32) if args.quick else (256, 256)
        asyncio.run(decode_tpot(url, [base] * 4, 16, 8))  # warm-up (compiles, graphs)
        asyncio.run(decode_tpot(url, names, 16, 8))
        results["decode32_base_ms"] = 1e3 * asyncio.run(decode_tpot(url, [base] * 32, inp, outl))
        results["decode32_lora_ms"] = 1e3 * asyncio.run(
            decode_tpot(url, [names[i % NUM_ADAPTERS] for i in range(32)], inp, outl))
        results["s3_base_tpot_ms"] = bench_serve_s3(url, model_dir, base, args.out, args.quick)
        results["s3_lora_tpot_ms"] = bench_serve_s3(url, model_dir, names[0], args.out, args.quick)
    finally:
        gpu_bench.stop_server(proc)
    lines = ["| metric | base | LoRA | ratio | target |", "|---|---|---|---|---|"]
    for label, b, lo, target in (("decode batch 32, 8 adapters: TPOT ms", "decode32_base_ms",
                                  "decode32_lora_ms", "<= 1.15"),
                                 ("S3, one adapter: TPOT ms", "s3_base_tpot_ms", "s3_lora_tpot_ms",
                                  "<= 1.10")):
        vb, vl = results.get(b), results.get(lo)
        ratio = f"{vl / vb:.3f}" if vb and vl else "-"
        lines.append(f"| {label} | {vb and round(vb, 3)} | {vl and round(vl, 3)} | {ratio} | {target} |")
        ctx.row("S9", label, {"base": vb, "lora": vl}, target)
    summary = "\n".join(lines)
    (args.out / "summary.md").write_text(summary + "\n")
    (args.out / "lora_bench.jsonl").write_text(json.dumps(results) + "\n")
    print(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
