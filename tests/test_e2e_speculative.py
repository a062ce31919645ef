"""Speculative decoding (NGRAM) end to end on the real default model: a server with
`--speculative-algorithm NGRAM` answers greedy requests exactly like the plain session server
(same tokens, finish reasons, usage; logprobs within float noise), on copy-heavy prompts where
drafts are accepted and on ordinary ones, with stop strings, `max_tokens` cut inside an
accepted run, logprobs and `n > 1`; and it reports its acceptance (/get_server_info,
/metrics)."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from server_harness import Server, start_server, stop_server

# The session `server` fixture's flags (tests/conftest.py), so only speculation differs.
FLAGS = ("--page-size", "4", "--max-running-requests", "32", "--max-total-tokens", "16384")

COPY = ("Copy the text exactly.\nText: The old lighthouse keeper climbed the stairs every "
        "night, lit the lamp, and watched the ships pass.\nCopy: The old lighthouse keeper "
        "climbed the stairs every night, lit the lamp, and watched the ships pass.\nText: The "
        "old lighthouse keeper climbed the stairs every night, lit the lamp, and watched the "
        "ships pass.\nCopy:")


@pytest.fixture(scope="module")
def spec_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = start_server(str(tmp_path_factory.mktemp("spec")), *FLAGS,
                       "--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "4")
    try:
        yield srv
    finally:
        stop_server(srv)


REQUESTS = [
    {"prompt": COPY, "max_tokens": 24, "temperature": 0, "logprobs": 2},
    # Cut by max_tokens in the middle of the copied run.
    {"prompt": COPY, "max_tokens": 7, "temperature": 0},
    # A stop string inside the copied run: nothing after it.
    {"prompt": COPY, "max_tokens": 30, "temperature": 0, "stop": ["lamp"]},
    {"prompt": COPY, "max_tokens": 16, "temperature": 0, "n": 2},
    {"prompt": "List 5 fruits:", "max_tokens": 24, "temperature": 0, "logprobs": 1},
    {"prompt": "Count: 1, 2, 3,", "max_tokens": 30, "temperature": 0, "stop": [" 9"]},
]


def answers(server: Server) -> list[dict]:
    def one(body: dict) -> dict:
        r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=400)
        r.raise_for_status()
        return r.json()

    with ThreadPoolExecutor(len(REQUESTS)) as pool:
        return list(pool.map(one, REQUESTS))


def test_greedy_answers_are_those_of_plain_decoding(server: Server, spec_server: Server) -> None:
    plain, spec = answers(server), answers(spec_server)
    for want, got in zip(plain, spec):
        # Cached prompt tokens depend on each server's history, not on speculation.
        assert {k: v for k, v in got["usage"].items() if k != "prompt_tokens_details"} == \
            {k: v for k, v in want["usage"].items() if k != "prompt_tokens_details"}
        for w, g in zip(want["choices"], got["choices"], strict=True):
            assert (g["text"], g["finish_reason"]) == (w["text"], w["finish_reason"])
            if w["logprobs"] is None:
                assert g["logprobs"] is None
                continue
            assert g["logprobs"]["tokens"] == w["logprobs"]["tokens"]
            assert g["logprobs"]["token_logprobs"] == pytest.approx(
                w["logprobs"]["token_logprobs"], abs=2e-3)
            assert [sorted(t) for t in g["logprobs"]["top_logprobs"]] == \
                [sorted(t) for t in w["logprobs"]["top_logprobs"]]
    copied, cut, stopped = spec[0]["choices"][0], spec[1]["choices"][0], spec[2]["choices"][0]
    assert "lighthouse keeper" in copied["text"]  # the copy that drafts predict
    assert cut["finish_reason"] == "length" and spec[1]["usage"]["completion_tokens"] == 7
    assert stopped["finish_reason"] == "stop" and "lamp" not in stopped["text"]


def test_acceptance_is_reported(spec_server: Server) -> None:
    answers(spec_server)
    info = spec_server.info()
    assert info["speculative_algorithm"] == "NGRAM"
    assert info["disable_overlap_schedule"] is False  # overlap while speculation is paused
    engine = info["engine"]
    assert engine["spec_accepted_tokens"] > 0
    assert 0 < engine["spec_accepted_tokens"] <= engine["spec_draft_tokens"]
    assert 1.0 < info["avg_spec_accept_length"] <= 5.0
    assert "the overlap scheduler runs while the speculation gate" in spec_server.log()


def test_sampled_requests_run_with_drafts(spec_server: Server) -> None:
    body = {"prompt": COPY, "max_tokens": 24, "temperature": 0.7, "seed": 3}
    r = httpx.post(f"{spec_server.url}/v1/completions", json=body, timeout=400)
    r.raise_for_status()
    out = r.json()
    assert out["usage"]["completion_tokens"] == 24
    # Seeded: the same request gives the same answer.
    again = httpx.post(f"{spec_server.url}/v1/completions", json=body, timeout=400).json()
    assert again["choices"][0]["text"] == out["choices"][0]["text"]
