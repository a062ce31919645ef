"""Two simulated nodes on loopback (two `tokenspeed serve --nnodes 2` processes, one gloo rank
each, TP=2 across them) answer exactly like one node with TP=1; node 1 exits when node 0 stops;
a rank killed on node 1 stops both, node 0's log naming that rank and its node and host."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from server_harness import Server, free_port, start_server, stop_server
from tokenspeed.launch.assets import ensure_default_model

PROMPTS = ["The capital of France is", "def fibonacci(n):"]
FLAGS = ("--max-total-tokens", "1024", "--max-running-requests", "4", "--page-size", "4")


def _tiny_model(root: Path) -> Path:
    """A random 2-layer Llama with SmolLM2's tokenizer (its vocabulary size)."""
    cfg = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      tie_word_embeddings=True)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.1)
    model.save_pretrained(root)
    smol = ensure_default_model()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smol / name, root / name)
    return root


def _greedy(srv: Server) -> list[str]:
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    return [client.completions.create(model=model, prompt=p, max_tokens=10, temperature=0)
            .choices[0].text for p in PROMPTS]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(_tiny_model(tmp_path_factory.mktemp("model")))


def test_two_nodes_give_one_nodes_tokens(model: str, tmp_path: Path) -> None:
    srv = start_server(str(tmp_path), model, *FLAGS)
    try:
        ref = _greedy(srv)
    finally:
        stop_server(srv)
    addr = f"127.0.0.1:{free_port()}"
    multi = ("--nnodes", "2", "--tp", "2", "--dist-init-addr", addr, *FLAGS)
    log1 = tmp_path / "node1.log"
    with open(log1, "w") as log:
        node1 = subprocess.Popen([sys.executable, "-m", "tokenspeed.launch.cli", "serve", model,
                                  "--device", "cpu", "--node-rank", "1", *multi],
                                 stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        srv = start_server(str(tmp_path), model, "--node-rank", "0", *multi)
        try:
            info = srv.info()
            assert info["parallel"]["world_size"] == 2 and info["parallel"]["nnodes"] == 2
            assert len(info["worker_pids"]) == 2  # node 0's rank and its plan relay
            assert _greedy(srv) == ref
        finally:
            stop_server(srv)
        deadline = time.monotonic() + 60
        while node1.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
        assert node1.returncode == 0, log1.read_text()
        assert "relaying plans from node 0" in log1.read_text()
    finally:
        if node1.poll() is None:
            node1.kill()
            node1.wait()


def test_a_rank_dying_on_node_1_stops_node_0_naming_it(model: str, tmp_path: Path) -> None:
    addr = f"127.0.0.1:{free_port()}"
    multi = ("--nnodes", "2", "--tp", "2", "--dist-init-addr", addr, *FLAGS)
    log1 = tmp_path / "node1.log"
    with open(log1, "w") as log:
        node1 = subprocess.Popen([sys.executable, "-m", "tokenspeed.launch.cli", "serve", model,
                                  "--device", "cpu", "--node-rank", "1", *multi],
                                 stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        srv = start_server(str(tmp_path), model, "--node-rank", "0", *multi)
        try:
            started = re.search(r"node 1: started 1 worker rank\(s\): rank 1 pid (\d+)",
                                log1.read_text())
            assert started, log1.read_text()
            victim = int(started[1])
            os.kill(victim, signal.SIGKILL)
            assert srv.proc.wait(timeout=60) != 0
            assert node1.wait(timeout=60) != 0
            named = (f"worker rank 1 of 2 (pid {victim}, node 1 host {socket.gethostname()}) "
                     "was killed by SIGKILL")
            assert named in log1.read_text(), log1.read_text()
            assert named in srv.log(), srv.log()  # node 0 learnt it through the relay
        finally:
            stop_server(srv)
    finally:
        if node1.poll() is None:
            node1.kill()
            node1.wait()
