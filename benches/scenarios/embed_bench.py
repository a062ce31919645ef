#!/usr/bin/env python3
"""Embedding throughput on one GPU: a Qwen3-Embedding-0.6B-shaped decoder embedder with dummy
weights, served with `--is-embedding`, and `tokenspeed bench serve --backend openai-embeddings`
over 10,000 random texts of 256 tokens, against the GEMM roofline.

Run on the GPU machine from the repo root, with `tokenspeed._core` importable:

    python benches/scenarios/embed_bench.py --tokenizer .carry/llama3/tokenizer.json --out "$OUT"

(CPU smoke: `--quick --num-prompts 20 --input-len 16 --serve-arg=--device=cpu
--serve-arg=--dtype=float32 --serve-arg=--max-total-tokens=4096`.)

(`--num-prompts 500 --quick` for a smoke run.) Prints requests/s, tokens/s and the share of
the bf16 GEMM roofline (the weights' 2 x params FLOPs per token at --peak-tflops, attention
left out: at 256 tokens it is ~5% of the FLOPs).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import gpu_bench  # the scenario runner's server helpers, beside this file

# Qwen/Qwen3-Embedding-0.6B config.json (public facts).
QWEN3_EMBEDDING_06B = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151669,
    "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
    "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0, "max_position_embeddings": 32768, "tie_word_embeddings": True,
    "hidden_act": "silu", "attention_bias": False, "torch_dtype": "bfloat16",
    "bos_token_id": 151643, "eos_token_id": 151643,
}


def linear_params(c: dict) -> int:
    """Parameters of the per-token matmuls (the embedding lookup is no GEMM)."""
    h, i, d = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    return c["num_hidden_layers"] * (h * (q + 2 * kv) + q * h + 3 * h * i)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokenizer", default=".carry/llama3/tokenizer.json")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--num-prompts", type=int, default=10000)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--peak-tflops", type=float, default=989.0, help="bf16 dense peak (H100 SXM)")
    p.add_argument("--quick", action="store_true", help="2 layers (smoke test)")
    p.add_argument("--serve-arg", action="append", default=[], help="extra `tokenspeed serve` flag")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = dict(QWEN3_EMBEDDING_06B, num_hidden_layers=2) if args.quick else QWEN3_EMBEDDING_06B
    model = Path(tempfile.mkdtemp(prefix="embed-model-"))
    (model / "config.json").write_text(json.dumps(cfg))
    tok = Path(args.tokenizer)
    shutil.copy(tok / "tokenizer.json" if tok.is_dir() else tok, model / "tokenizer.json")
    # every text is sent at once: room for all of them in the queue (the default bound, 4096,
    # answers the rest 429, as a server should; this measures throughput)
    extra = ["--is-embedding", "--max-queued-requests", str(args.num_prompts + 1024), *args.serve_arg]
    started = gpu_bench.start_server(gpu_bench.Ctx(out, time.monotonic() + 900), model, "embed",
                                     extra, 600)
    if started is None:
        return 1
    server, url = started
    try:
        records = out / "embed_bench.jsonl"
        rc = subprocess.call([sys.executable, "-m", "tokenspeed.launch.cli", "bench", "serve",
                              "--base-url", url, "--backend", "openai-embeddings",
                              "--dataset-name", "random", "--num-prompts", str(args.num_prompts),
                              "--random-input-len", str(args.input_len), "--random-range-ratio", "0",
                              "--random-output-len", "1", "--disable-tqdm",
                              "--output-file", str(records)])
        m = json.loads(records.read_text().splitlines()[-1])["metrics"]
        flops = 2 * linear_params(cfg)
        roofline = args.peak_tflops * 1e12 / flops
        print(f"\nembedding: {m['request_throughput']:.1f} req/s, {m['input_throughput']:.0f} tokens/s; "
              f"GEMM roofline {roofline:.0f} tokens/s ({linear_params(cfg) / 1e6:.0f}M linear params "
              f"at {args.peak_tflops:.0f} TFLOP/s): {100 * m['input_throughput'] / roofline:.1f}%")
        return rc
    finally:
        gpu_bench.stop_server(server)


if __name__ == "__main__":
    sys.exit(main())
