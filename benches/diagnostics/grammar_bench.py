"""What structured output costs at decode: S3-style ms/token (batch 1 and a batch of 16, streamed,
256 output tokens) with and without a JSON schema, on one server (the 8B config, dummy weights).

The schema (an array of at least 200 small objects) cannot complete within 256 tokens, so every
constrained request runs its full length, like `ignore_eos` for the unconstrained ones. Each
constrained output is checked to be a valid prefix of such JSON (by the token count and by
`/v1/completions` finish_reason "length"); the grammar's own correctness is tested on the CPU
(tests/test_e2e_structured.py).

Run on the GPU machine from the repo root, with `tokenspeed._core` importable:
    python3 benches/diagnostics/grammar_bench.py --tokenizer .carry/llama3/tokenizer.json --out grammar_out
CPU smoke test (tiny model): add --layers 2 --config-overrides '{"hidden_size": 256, ...}'.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scenarios"))  # gpu_bench (not a package)
from gpu_bench import Ctx, start_server, stop_server, write_model_dir

SCHEMA = {
    "type": "array", "minItems": 200,
    "items": {"type": "object",
              "properties": {"id": {"type": "integer"}, "name": {"type": "string", "maxLength": 12},
                             "ok": {"type": "boolean"}},
              "required": ["id", "name", "ok"], "additionalProperties": False},
}


def sse_lines(r: httpx.Response) -> Iterator[str]:
    """SSE lines end at \n only: httpx's iter_lines also splits at U+2028 and friends, which
    JSON strings (random dummy-weight text) may hold unescaped."""
    buf = b""
    for chunk in r.iter_bytes():
        buf += chunk
        *lines, buf = buf.split(b"\n")
        for line in lines:
            yield line.decode().rstrip("\r")


def one(client: httpx.Client, url: str, prompt: list[int], max_tokens: int,
        constrained: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                            "stream": True, "stream_options": {"include_usage": True}}
    if constrained:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}}
    else:
        body["ignore_eos"] = True
    t0 = time.perf_counter()
    stamps: list[float] = []
    finish, tokens, text = None, 0, []
    with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        r.raise_for_status()
        for line in sse_lines(r):
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            for c in chunk.get("choices", []):
                if c.get("text"):
                    stamps.append(time.perf_counter() - t0)
                    text.append(c["text"])
                finish = c.get("finish_reason") or finish
    per_token = (stamps[-1] - stamps[0]) / max(1, tokens - 1) if len(stamps) > 1 else float("nan")
    return {"ttft": stamps[0] if stamps else None, "tpot": per_token, "tokens": tokens,
            "finish": finish, "text": "".join(text)}


def run(url: str, batch: int, reps: int, constrained: bool, max_tokens: int) -> dict[str, Any]:
    prompts = [[1000 + 7 * i + j for j in range(64)] for i in range(batch)]
    rows = []
    with httpx.Client(timeout=300, trust_env=False) as client:
        for rep in range(reps + 1):  # the first round warms up (and compiles the grammar)
            with concurrent.futures.ThreadPoolExecutor(batch) as pool:
                got = list(pool.map(lambda p: one(client, url, p, max_tokens, constrained), prompts))
            if rep:
                rows.extend(got)
    bad = [r for r in rows if r["tokens"] != max_tokens or r["finish"] != "length"]
    if constrained:  # a valid prefix of the schema's JSON: it starts as an array of objects
        bad += [r for r in rows if not r["text"].lstrip().startswith("[")]
    return {"batch": batch, "constrained": constrained, "reps": reps,
            "ms_per_token": round(statistics.median(r["tpot"] for r in rows) * 1e3, 3),
            "ttft_ms": round(statistics.median(r["ttft"] for r in rows) * 1e3, 2),
            "bad_outputs": len(bad), "sample": rows[0]["text"][:80]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokenizer", default=".carry/llama3/tokenizer.json")
    p.add_argument("--out", default="grammar_out")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--batches", default="1,16")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--serve-args", default="")
    p.add_argument("--config-overrides", default="{}")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ctx = Ctx(out=out, deadline=time.monotonic() + 3600)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_model_dir(Path(tmp), Path(args.tokenizer), args.layers,
                                    json.loads(args.config_overrides))
        started = start_server(ctx, model_dir, "grammar", args.serve_args.split(), 400)
        if started is None:
            return 1
        proc, url = started
        try:
            for batch in [int(b) for b in args.batches.split(",")]:
                for constrained in (False, True):
                    r = run(url, batch, args.reps, constrained, args.max_tokens)
                    print(json.dumps(r), flush=True)
                    results.append(r)
        finally:
            stop_server(proc)
    with open(out / "grammar_bench.jsonl", "a") as f:
        for r in results:
            f.write(json.dumps(r) + "\n")
    print("| batch | JSON schema | ms/token | TTFT ms | bad outputs |")
    print("|---|---|---|---|---|")
    for r in results:
        print(f"| {r['batch']} | {'yes' if r['constrained'] else 'no'} | {r['ms_per_token']} | "
              f"{r['ttft_ms']} | {r['bad_outputs']} |")
    for b in sorted({r["batch"] for r in results}):
        off = next(r for r in results if r["batch"] == b and not r["constrained"])
        on = next(r for r in results if r["batch"] == b and r["constrained"])
        print(f"batch {b}: the grammar costs {100 * (on['ms_per_token'] / off['ms_per_token'] - 1):+.1f}% "
              "per token (target <= 5% at batch 1)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
