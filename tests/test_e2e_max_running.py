"""End to end: without --max-running-requests the server derives it from the KV pool
(config/derived.py), reports it in /get_server_info, and its worker holds that many slots."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
from test_models_numerics import save_tiny_checkpoint
from transformers import LlamaConfig

from server_harness import start_server, stop_server
from tokenspeed.config.derived import MIN_DEFAULT_RUNNING_REQUESTS, default_max_running_requests

REQUESTS = 100  # more than the CPU default pool's 64 slots: the derived ones are all there


def test_the_default_max_running_requests_follows_the_kv_pool(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    # A tiny model (512-token context) keeps a large pool cheap: 65536 tokens of 512 bytes.
    save_tiny_checkpoint(LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=96,
                                     num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, max_position_embeddings=512),
                         model, seed=1)
    srv = start_server(str(tmp_path), str(model), "--page-size", "4", "--max-total-tokens", "65536")
    try:
        info = srv.info()
        derived = default_max_running_requests(info["num_pages"] * info["page_size"],
                                               info["context_length"])
        assert derived == 128 > MIN_DEFAULT_RUNNING_REQUESTS
        assert info["max_running_requests"] == derived
        assert "128 running requests (derived from the KV pool)" in srv.log()

        def one(i: int) -> int:
            r = httpx.post(f"{srv.url}/v1/completions", timeout=120, json={
                "model": str(model), "prompt": f"request {i}", "max_tokens": 8,
                "temperature": 0, "ignore_eos": True})
            assert r.status_code == 200, r.text
            return int(r.json()["usage"]["completion_tokens"])

        with ThreadPoolExecutor(REQUESTS) as pool:
            assert list(pool.map(one, range(REQUESTS))) == [8] * REQUESTS
        assert srv.proc.poll() is None, srv.log()
    finally:
        stop_server(srv)
