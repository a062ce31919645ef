"""The hybrid sliding-window KV layout (--swa-full-tokens-ratio, docs/models.md): `tokenspeed
serve` on CPU (fp32) with tiny random Gemma 3 and GPT-OSS checkpoints (window 8, 4-token pages,
8-token prefill chunks) gives the single layout's greedy tokens over prompts and generations
longer than the window, with a sliding pool far smaller than the full one, concurrent requests
and a repeated prompt; /get_server_info reports both pools. The scheduler's page accounting
(pages given back past the window, admission) is tested in rust/engine/tests/swa.rs."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from test_e2e_model_families import _with_vocab
from test_models_families import GEMMA3, GPT_OSS
from test_models_numerics import save_tiny_checkpoint

from server_harness import start_server, stop_server

PROMPTS = [[(7 * i + 3 * j) % 900 + 100 for j in range(n)] for i, n in enumerate([40, 13, 27, 40])]
PROMPTS[3] = PROMPTS[0]  # a repeated prompt
NEW_TOKENS = 20
COMMON = ("--max-total-tokens", "1024", "--context-length", "128", "--page-size", "4",
          "--chunked-prefill-size", "8")


def _complete(url: str, model: str, ids: list[int]) -> list[int]:
    r = httpx.post(f"{url}/generate", timeout=300, json={
        "input_ids": ids, "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0,
                                              "ignore_eos": True}})
    assert r.status_code == 200, r.text
    return r.json()["output_ids"]


def _serve(tmp_path: Path, path: Path, *flags: str) -> tuple[list[list[int]], dict]:
    srv = start_server(str(tmp_path), str(path), *COMMON, *flags)
    try:
        with ThreadPoolExecutor(3) as pool:  # three at once, then the repeat
            first = list(pool.map(lambda ids: _complete(srv.url, str(path), ids), PROMPTS[:3]))
        out = first + [_complete(srv.url, str(path), PROMPTS[3])]
        info = httpx.get(f"{srv.url}/get_server_info", timeout=30).json()
        return out, info
    finally:
        stop_server(srv)


@pytest.mark.parametrize("family", ["gemma3", "gpt_oss"])
def test_hybrid_layout_gives_the_single_layouts_tokens(tmp_path: Path, family: str) -> None:
    path = tmp_path / family
    save_tiny_checkpoint(_with_vocab({"gemma3": GEMMA3, "gpt_oss": GPT_OSS}[family]), path, seed=3)
    single, info = _serve(tmp_path, path)
    assert info["num_swa_pages_per_rank"] == [0]
    # 1024 * 0.05 = 52 tokens: 13 sliding pages, room for two requests' window + chunk.
    hybrid, info = _serve(tmp_path, path, "--swa-full-tokens-ratio", "0.05")
    assert info["num_swa_pages_per_rank"] == [13]
    assert info["num_pages_per_rank"] == [256]
    assert all(len(t) == NEW_TOKENS for t in hybrid)
    assert hybrid == single
    assert hybrid[3] == hybrid[0]
    off, info = _serve(tmp_path, path, "--swa-full-tokens-ratio", "0.05",
                       "--disable-hybrid-swa-memory")
    assert info["num_swa_pages_per_rank"] == [0] and off == single
