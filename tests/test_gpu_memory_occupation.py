"""/release_memory_occupation and /resume_memory_occupation on a GPU (SGLang's sleep and wake, for
an RL trainer that needs the GPU between rollouts): release gives back the worker's weights, KV
pool and CUDA graphs (the device memory its process holds drops to what the CUDA context keeps),
a request sent meanwhile waits, and after the resume every request gets the same greedy tokens as
before, twice over. The CPU twin is tests/test_e2e_memory_occupation.py.

Needs a CUDA GPU and a Llama-3 tokenizer.json (TOKENSPEED_LLAMA3_TOKENIZER, else the device runs'
.carry/llama3/tokenizer.json): the server serves a 4-layer Llama-3.1-8B-shaped model with dummy
weights.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from server_harness import Server, start_server, stop_server
from tokenspeed.bench.model_configs import LLAMA31_8B

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER = Path(os.environ.get("TOKENSPEED_LLAMA3_TOKENIZER", ROOT / ".carry/llama3/tokenizer.json"))

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.skipif(not TOKENIZER.exists(), reason=f"no Llama-3 tokenizer at {TOKENIZER}")]


def _gpu_used_mib() -> int:
    """Device memory held by every process on the GPU (this test's process holds none)."""
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=used_memory", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, check=True).stdout
    return sum(int(line) for line in out.split() if line.strip().isdigit())


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("gpu-memory")
    model = root / "llama31-8b-4l"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({**LLAMA31_8B, "num_hidden_layers": 4,
                                                   "eos_token_id": 128001}))
    shutil.copy(TOKENIZER, model / "tokenizer.json")
    server = start_server(str(root), str(model), "--device", "cuda", "--load-format", "dummy",
                          "--dtype", "bfloat16", "--context-length", "4096")
    yield server
    stop_server(server)


def _complete(srv: Server, prompt: str = "The capital of France is") -> list[str]:
    # httpx, not the openai client: the GPU machine's Python has no openai package.
    r = httpx.post(f"{srv.url}/v1/completions", timeout=300,
                   json={"prompt": prompt, "max_tokens": 16, "temperature": 0, "logprobs": 1})
    assert r.status_code == 200, r.text
    return list(r.json()["choices"][0]["logprobs"]["tokens"])


def test_release_gives_the_gpu_back_and_resume_serves_the_same_tokens(srv: Server) -> None:
    before = _complete(srv)
    for cycle in range(2):
        held = _gpu_used_mib()
        r = httpx.post(f"{srv.url}/release_memory_occupation", json={}, timeout=300)
        assert r.status_code == 200 and r.json()["success"] is True, r.text
        released = _gpu_used_mib()
        print(f"\n[cycle {cycle}] GPU memory held {held} MiB, after release {released} MiB")
        # Weights (~3.4 GiB for 4 layers + embeddings) and the KV pool (most of the card) go;
        # the CUDA context and the allocator's bookkeeping stay.
        assert held > 20_000 and released < 2_000, (held, released)
        waiting: dict[str, list[str]] = {}
        t = threading.Thread(target=lambda box=waiting: box.update(tokens=_complete(srv)))
        t.start()
        time.sleep(2)
        assert t.is_alive() and "tokens" not in waiting, "a request sent while released waits"
        r = httpx.post(f"{srv.url}/resume_memory_occupation", json={}, timeout=300)
        assert r.status_code == 200 and r.json()["success"] is True, r.text
        t.join(300)
        assert waiting["tokens"] == before
        assert _complete(srv) == before
        assert _gpu_used_mib() > 0.9 * held
