"""NEXTN end to end: `tokenspeed serve` on a tiny random DeepSeek-V3 checkpoint that ships its
multi-token prediction layer (tests/deepseek_mtp_model.py, SmolLM2's tokenizer), with and
without `--speculative-algorithm NEXTN`. Through the real `openai` client, greedy answers (text,
finish reasons, logprobs) are identical; the MTP layer's drafts are proposed and verified
(a random layer's are rarely right: the verify path with right drafts is tests/test_nextn.py's
and rust/engine/tests/speculative.rs's) and reported in /get_server_info and /metrics."""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from deepseek_mtp_model import make_mtp_model
from spec_checks import answers, assert_drafts_reported, assert_same_answers
from test_e2e_speculative import COPY, FLAGS
from test_models_numerics import smollm2_dir

from server_harness import Server, start_server, stop_server


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("deepseek_mtp")
    make_mtp_model(path, vocab_size=49152, max_position_embeddings=512)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2_dir() / name, path / name)
    return path


@pytest.fixture(scope="module")
def servers(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    tmp = str(tmp_path_factory.mktemp("nextn_servers"))
    started: dict[str, Server] = {}
    try:
        started["plain"] = start_server(tmp, str(checkpoint), *FLAGS)
        # SGLang's spelling: 3 steps, topk 1, 4 draft tokens counting the verified one.
        started["nextn"] = start_server(tmp, str(checkpoint), *FLAGS, "--enable-metrics",
                                        "--speculative-algorithm", "NEXTN",
                                        "--speculative-num-steps", "3",
                                        "--speculative-eagle-topk", "1",
                                        "--speculative-num-draft-tokens", "4")
        yield started
    finally:
        for srv in started.values():
            stop_server(srv)


BODIES = [
    {"prompt": COPY, "max_tokens": 24, "temperature": 0, "logprobs": 2},
    {"prompt": COPY, "max_tokens": 7, "temperature": 0},
    {"prompt": COPY, "max_tokens": 20, "temperature": 0, "n": 2},
    {"prompt": "List 5 fruits:", "max_tokens": 24, "temperature": 0, "logprobs": 1,
     "stop": [" the"]},
]


def test_greedy_answers_are_those_of_plain_decoding(servers: dict) -> None:
    assert_same_answers(answers(servers["plain"], BODIES), answers(servers["nextn"], BODIES))


def test_a_stop_string_ends_both_alike(servers: dict) -> None:
    # A stop string taken from the plain answer (random weights: no fixed text to name).
    def one(server: Server, **body: object) -> tuple[str, str]:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0,
                               timeout=400)
        c = client.completions.create(model=client.models.list().data[0].id, prompt=COPY,
                                      max_tokens=16, temperature=0, **body).choices[0]
        return c.text, str(c.finish_reason)

    stop = one(servers["plain"])[0].split()[2]
    want = one(servers["plain"], stop=[stop])
    assert want[1] == "stop"
    assert one(servers["nextn"], stop=[stop]) == want


def test_drafts_are_verified_and_reported(servers: dict) -> None:
    # After the answers above (one module: the same servers).
    srv = servers["nextn"]
    assert_drafts_reported(srv, "NEXTN", 3)  # the chain's length
    assert "DeepSeek MTP layer" in srv.log()


def test_a_model_without_an_mtp_layer_is_refused_at_start(tmp_path: Path) -> None:
    # SmolLM2 (no num_nextn_predict_layers): one line before any worker starts.
    out = subprocess.run([sys.executable, "-m", "tokenspeed.launch.cli", "serve", str(smollm2_dir()),
                          "--device", "cpu", "--speculative-algorithm", "NEXTN",
                          "--speculative-num-steps", "2"],
                         check=False, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1, out.stderr
    assert "not supported yet: --speculative-algorithm NEXTN" in out.stderr
    assert "worker rank(s)" not in out.stderr  # none was spawned
