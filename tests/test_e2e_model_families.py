"""End to end, per new model family: `tokenspeed serve` on CPU (fp32) with a tiny random HF
checkpoint (SmolLM2's tokenizer) answers a greedy completion with HF transformers' greedy
tokens, their logprobs within 1e-3; and the same server starts on dummy weights."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch
from test_models_families import GEMMA3, GPT_OSS, PHI3_LONGROPE
from test_models_numerics import save_tiny_checkpoint
from tokenizers import Tokenizer
from transformers import PretrainedConfig

from server_harness import start_server, stop_server

PROMPT = "The capital of France is a city where"
NEW_TOKENS = 8
VOCAB = 49152  # SmolLM2's tokenizer


def _with_vocab(cfg: PretrainedConfig) -> PretrainedConfig:
    cfg = cfg.__class__.from_dict({**cfg.to_dict(), "vocab_size": VOCAB, "bos_token_id": 1,
                                   "eos_token_id": 2, "pad_token_id": 0})
    return cfg


# Family → (config, the server's --context-length). Phi-3: a context within LongRoPE's original
# window (32), so the short factors rotate, as transformers has them for this short sequence.
FAMILIES: dict[str, tuple[PretrainedConfig, int]] = {
    "phi3": (PHI3_LONGROPE, 32),
    "gemma3": (GEMMA3, 256),
    "gpt_oss": (GPT_OSS, 256),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
           ) -> tuple[Path, list[int], list[int], list[float], int]:
    """(checkpoint dir, prompt ids, HF greedy ids, their HF logprobs, context length)."""
    path = tmp_path_factory.mktemp(request.param)
    cfg, context = FAMILIES[request.param]
    model = save_tiny_checkpoint(_with_vocab(cfg), path, seed=3)
    ids = Tokenizer.from_file(str(path / "tokenizer.json")).encode(PROMPT).ids
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS,
                             min_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
                             pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    new = out.sequences[0, len(ids):].tolist()
    logprobs = [torch.log_softmax(step[0].float(), -1)[t].item() for step, t in zip(out.logits, new)]
    return path, ids, new, logprobs, context


def _complete(url: str, model: str, ids: list[int]) -> dict:
    r = httpx.post(f"{url}/v1/completions", timeout=120, json={
        "model": model, "prompt": ids, "max_tokens": NEW_TOKENS, "temperature": 0,
        "ignore_eos": True, "logprobs": 1})
    assert r.status_code == 200, r.text
    return r.json()


def test_family_serves_hf_greedy_tokens_and_logprobs(family: tuple, tmp_path: Path) -> None:
    path, ids, want, want_lp, context = family
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    srv = start_server(str(tmp_path), str(path), "--max-total-tokens", "2048",
                       "--context-length", str(context))
    try:
        body = _complete(srv.url, str(path), ids)
        choice = body["choices"][0]
        assert body["usage"]["completion_tokens"] == NEW_TOKENS
        assert choice["text"] == tok.decode(want)
        assert choice["logprobs"]["token_logprobs"] == pytest.approx(want_lp, abs=1e-3)
    finally:
        stop_server(srv)
    srv = start_server(str(tmp_path), str(path), "--max-total-tokens", "2048",
                       "--context-length", str(context), "--load-format", "dummy")
    try:
        assert _complete(srv.url, str(path), ids)["usage"]["completion_tokens"] == NEW_TOKENS
    finally:
        stop_server(srv)
