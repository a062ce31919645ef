"""Expert parallelism end to end: `tokenspeed serve --tp 2 --ep-size 2` on CPU (gloo) with a tiny
random Qwen3-MoE (SmolLM2's tokenizer) answers the `openai` client's greedy completions with
exactly the text of `--tp 1`, each rank holding half of the experts, and a rank killed under it
stops the server with a non-zero exit and a log line naming the rank; the all-to-all backends
that are not built stop the launch naming the value."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
from test_models_numerics import save_tiny_checkpoint
from transformers import Qwen3MoeConfig

from server_harness import Server, start_server, stop_server

PROMPTS = ["The capital of France is", "def fibonacci(n):", "1, 2, 3, 4,"]
NEW_TOKENS = 10
FLAGS = ("--max-total-tokens", "1024", "--max-running-requests", "4", "--page-size", "4",
         "--moe-backend", "torch_native")


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """8 experts, top 2, the second layer dense (so both MLP kinds run under TP). Weights far
    from the init scale and norm scales near 1, so a dropped expert or partial shows in the text."""
    path = tmp_path_factory.mktemp("qwen3moe_ep")
    cfg = Qwen3MoeConfig(vocab_size=49152, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
                         num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                         mlp_only_layers=[1], max_position_embeddings=512, bos_token_id=1,
                         eos_token_id=2)
    save_tiny_checkpoint(cfg, path, seed=5)
    return path


def _greedy_texts(srv: Server) -> list[str]:
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    texts = []
    for p in PROMPTS:
        choice = client.completions.create(model=model, prompt=p, max_tokens=NEW_TOKENS,
                                           temperature=0, extra_body={"ignore_eos": True}).choices[0]
        texts.append(choice.text)
    return texts


def test_serve_ep2_gives_tp1_text_and_a_dead_rank_stops_it(moe_dir: Path, tmp_path: Path) -> None:
    srv = start_server(str(tmp_path), str(moe_dir), *FLAGS)
    try:
        ref = _greedy_texts(srv)
    finally:
        stop_server(srv)
    assert len(set(ref)) == len(ref) and all(ref), ref  # the model is not degenerate
    srv = start_server(str(tmp_path), str(moe_dir), "--tp", "2", "--ep-size", "2", *FLAGS)
    try:
        info = srv.info()
        parallel = info["parallel"]
        assert (parallel["world_size"], parallel["ep_size"], parallel["moe_tp_size"]) == (2, 2, 1)
        assert _greedy_texts(srv) == ref
        log = srv.log()
        # Each rank loaded only its half of the experts.
        assert "ep rank 0/2 holds experts [0, 4)" in log and "ep rank 1/2 holds experts [4, 8)" in log
        # A rank dies: requests fail with 503 at once, then the server exits non-zero, its log
        # naming the rank (the Rust core alone knows only the pid).
        victim = info["worker_pids"][1]
        os.kill(victim, signal.SIGKILL)
        deadline = time.monotonic() + 15
        while httpx.get(f"{srv.url}/health", timeout=10).status_code != 503:
            assert time.monotonic() < deadline, "the server still looks healthy with a dead rank"
            time.sleep(0.2)
        code = srv.proc.wait(timeout=60)
        assert code != 0, srv.log()
        assert f"worker rank 1 of 2 (pid {victim}) was killed by SIGKILL" in srv.log(), srv.log()
    finally:
        stop_server(srv)


def _serve_fails(*args: str) -> str:
    cmd = [sys.executable, "-m", "tokenspeed.launch.cli", "serve", "--device", "cpu", *args]
    out = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=300)
    assert out.returncode != 0, out.stdout + out.stderr
    return out.stderr


def test_serve_refuses_what_expert_parallelism_cannot_do(moe_dir: Path) -> None:
    err = _serve_fails(str(moe_dir), "--tp", "2", "--ep-size", "2", "--all2all-backend",
                       "deepep_low_latency")
    assert "--all2all-backend" in err and "'deepep_low_latency' is not built into TokenSpeed" in err
    assert "deep_ep package" in err and "torch_all2all" in err, err
    err = _serve_fails(str(moe_dir), "--tp", "4", "--ep-size", "2", "--enable-expert-parallel")
    assert "--enable-expert-parallel" in err and "--world-size 4" in err and "--ep-size is 2" in err
