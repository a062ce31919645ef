"""End to end with a mixture-of-experts model: `tokenspeed serve` on CPU with a tiny random
Qwen3-MoE (SmolLM2's tokenizer), each --moe-backend, answers a greedy completion with HF
transformers' greedy tokens for the same prompt."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch
from test_models_numerics import save_tiny_checkpoint
from tokenizers import Tokenizer
from transformers import Qwen3MoeConfig

from server_harness import start_server, stop_server

PROMPT = "The capital of France is"
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """A tiny Qwen3-MoE checkpoint with SmolLM2's tokenizer, and HF's greedy continuation."""
    path = tmp_path_factory.mktemp("qwen3moe")
    cfg = Qwen3MoeConfig(vocab_size=49152, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
                         num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                         max_position_embeddings=512, bos_token_id=1, eos_token_id=2)
    model = save_tiny_checkpoint(cfg, path, seed=3)
    ids = Tokenizer.from_file(str(path / "tokenizer.json")).encode(PROMPT).ids
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
    text = Tokenizer.from_file(str(path / "tokenizer.json")).decode(out[0, len(ids):].tolist())
    return path, text


@pytest.mark.parametrize("backend", ["torch_native", "triton"])
def test_moe_model_serves_hf_greedy_tokens(moe_model: tuple[Path, str], tmp_path: Path, backend: str) -> None:
    path, want = moe_model
    srv = start_server(str(tmp_path), str(path), "--moe-backend", backend, "--max-total-tokens", "2048")
    try:
        r = httpx.post(f"{srv.url}/v1/completions", timeout=120, json={
            "model": str(path), "prompt": PROMPT, "max_tokens": NEW_TOKENS, "temperature": 0,
            "ignore_eos": True})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["usage"]["completion_tokens"] == NEW_TOKENS
        assert body["choices"][0]["text"] == want
        assert f"moe={backend}" in srv.log()
    finally:
        stop_server(srv)
