"""S1's workload through the offline API (`tokenspeed.LLM.generate`) and through the server, on one
machine in one run (issue 36's target: the offline API at least as fast as the server).

Both runs are `tokenspeed bench offline` with the same dataset and serve flags: `--via server`
starts `tokenspeed serve` and sends every prompt over HTTP at t=0; `--via engine` runs
`LLM.generate` on the same prompts in its own process. The Llama-3.1-8B config with dummy
weights, as the scoreboard (scoreboard.py) builds it.

    python benches/scenarios/offline_vs_server.py --tokenizer .carry/llama3/tokenizer.json
    python benches/scenarios/offline_vs_server.py --cpu-smoke --tokenizer <dir with tokenizer.json>
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import gpu_bench


def run(via: str, model_dir: Path, a: argparse.Namespace, serve: list[str], out: Path) -> dict:
    cmd = [sys.executable, "-m", "tokenspeed.launch.cli", "bench", "offline", "--via", via,
           "--num-prompts", str(a.prompts), "--random-input-len", str(a.input_len),
           "--random-output-len", str(a.output_len), "--tokenizer", str(a.tokenizer),
           "--output-file", str(out / "offline_vs_server.jsonl"), "--tag", via, "--disable-tqdm",
           "--", str(model_dir), *serve]
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    lines = (out / "offline_vs_server.jsonl").read_text().splitlines()
    return json.loads(lines[-1])["metrics"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokenizer", default=".carry/llama3/tokenizer.json")
    p.add_argument("--out", default=os.environ.get("OUT") or "offline_vs_server_out")
    p.add_argument("--prompts", type=int, default=2000)
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=1024)
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--serve-args", default="--dtype bfloat16", help="extra serve flags, one string")
    p.add_argument("--cpu-smoke", action="store_true", help="a narrow 2-layer model on CPU, 8 x 16/16")
    a = p.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    serve = ["--load-format", "dummy", *a.serve_args.split()]
    layers = a.layers or gpu_bench.MODELS["llama31-8b"][0]["num_hidden_layers"]
    overrides: dict = {}
    if a.cpu_smoke:  # a narrow model over the tokenizer's own vocabulary
        overrides = gpu_bench.cpu_smoke_overrides(Path(a.tokenizer))
        layers, a.prompts, a.input_len, a.output_len = 2, 8, 16, 16
        serve = ["--load-format", "dummy", "--device", "cpu", "--dtype", "float32",
                 "--max-total-tokens", "4096", "--max-running-requests", "16"]
    tmp = Path(tempfile.mkdtemp(prefix="ts-offline-"))
    try:
        model_dir = gpu_bench.write_model_dir(tmp, Path(a.tokenizer), layers, overrides)
        server = run("server", model_dir, a, serve, out)
        engine = run("engine", model_dir, a, serve, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    ratio = engine["output_throughput"] / server["output_throughput"]
    print(f"output tok/s: server {server['output_throughput']:.1f}, LLM.generate "
          f"{engine['output_throughput']:.1f} (ratio {ratio:.3f}); total tok/s: server "
          f"{server['total_throughput']:.1f}, LLM.generate {engine['total_throughput']:.1f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
