"""EAGLE-3 end to end on the real default model (SmolLM2) with a random head in the public
layout (hidden 576, a reduced draft vocabulary mapped through d2t): through the real `openai`
client, greedy answers (text, finish reasons, logprobs) are those of the plain session server,
the head's drafts are verified (a random head's are rarely right; the verify path with right
drafts is tests/test_eagle3.py's and rust/engine/tests/speculative.rs's), and acceptance is
reported in /get_server_info and /metrics as NGRAM's is."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from eagle3_head import make_head
from spec_checks import answers, assert_drafts_reported, assert_same_answers
from test_e2e_speculative import FLAGS, REQUESTS

from server_harness import Server, start_server, stop_server


@pytest.fixture(scope="module")
def eagle_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("eagle3")
    target = json.loads((Path(os.environ["TOKENSPEED_TEST_ASSETS"]) / "smollm2" / "config.json")
                        .read_text())
    head = make_head(tmp / "head", target, draft_vocab=8192, seed=1)
    # SGLang's spelling: 3 steps, topk 1, 4 draft tokens counting the verified one.
    srv = start_server(str(tmp), *FLAGS, "--enable-metrics", "--speculative-algorithm", "EAGLE3",
                       "--speculative-draft-model-path", str(head), "--speculative-num-steps", "3",
                       "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4")
    try:
        yield srv
    finally:
        stop_server(srv)


# NGRAM's requests with logprobs, a stop string, n = 2 and a plain prompt (CPU time is short).
BODIES = [REQUESTS[i] for i in (0, 2, 3, 4)]


def test_greedy_answers_are_those_of_plain_decoding(server: Server, eagle_server: Server) -> None:
    assert_same_answers(answers(server, BODIES), answers(eagle_server, BODIES))


def test_drafts_are_verified_and_reported(eagle_server: Server) -> None:
    # After the answers above (one module: the same server).
    info = assert_drafts_reported(eagle_server, "EAGLE3", 3)  # the chain's length
    assert 1.0 <= info["avg_spec_accept_length"] <= 4.0
    assert "EAGLE-3 head" in eagle_server.log()


@pytest.fixture(scope="module")
def gated_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """Speculation off while 2 or more requests run (the acceptance rule off, so only the batch
    decides)."""
    tmp = tmp_path_factory.mktemp("eagle3_gated")
    target = json.loads((Path(os.environ["TOKENSPEED_TEST_ASSETS"]) / "smollm2" / "config.json")
                        .read_text())
    head = make_head(tmp / "head", target, draft_vocab=8192, seed=1)
    srv = start_server(str(tmp), *FLAGS, "--enable-metrics", "--speculative-config",
                       json.dumps({"method": "eagle3", "model": str(head),
                                   "num_speculative_tokens": 3, "disable_by_batch_size": 2}),
                       "--speculative-break-even-accept-length", "0")
    try:
        yield srv
    finally:
        stop_server(srv)


def test_speculation_flips_off_and_on_with_the_batch_exactly(server: Server,
                                                             gated_server: Server) -> None:
    # Three requests of different lengths at once: plain steps while two or more run, drafting
    # resumed (the head's KV kept up meanwhile) for the longest one alone; greedy answers equal.
    bodies = [{**REQUESTS[i], "max_tokens": n} for i, n in ((4, 6), (0, 12), (5, 30))]
    assert_same_answers(answers(server, bodies), answers(gated_server, bodies))
    engine = gated_server.info()["engine"]
    assert engine["spec_off_steps"] > 0 and engine["spec_verify_steps"] > 0, engine
    assert engine["spec_enabled"] is True, engine  # the last request ran alone
    metrics = httpx.get(f"{gated_server.url}/metrics", timeout=10).text
    value = {ln.split("{")[0]: float(ln.split()[-1]) for ln in metrics.splitlines()
             if ln.startswith("tokenspeed:spec_decode_")}
    assert value["tokenspeed:spec_decode_off_steps_total"] == engine["spec_off_steps"]
    assert value["tokenspeed:spec_decode_enabled"] == 1


@pytest.fixture(scope="module")
def paused_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The acceptance rule on (default break-even): the random head's drafts are rarely right,
    so speculation pauses after a few verify steps and is probed every 6 plain steps; the
    overlap scheduler is on (the default) and runs while it is paused."""
    tmp = tmp_path_factory.mktemp("eagle3_paused")
    target = json.loads((Path(os.environ["TOKENSPEED_TEST_ASSETS"]) / "smollm2" / "config.json")
                        .read_text())
    head = make_head(tmp / "head", target, draft_vocab=8192, seed=1)
    srv = start_server(str(tmp), *FLAGS, "--speculative-algorithm", "EAGLE3",
                       "--speculative-draft-model-path", str(head), "--speculative-num-steps", "3",
                       "--speculative-probe-interval", "6")
    try:
        yield srv
    finally:
        stop_server(srv)


def test_paused_speculation_overlaps_exactly(server: Server, paused_server: Server) -> None:
    # Two requests at once: paused steps planned one step ahead (placeholders), probes drained
    # first and verified; greedy answers equal plain decoding's.
    bodies = [{**REQUESTS[i], "max_tokens": n} for i, n in ((0, 24), (5, 40))]
    assert_same_answers(answers(server, bodies), answers(paused_server, bodies))
    info = paused_server.info()
    engine = info["engine"]
    assert info["disable_overlap_schedule"] is False
    assert engine["spec_verify_steps"] > 0 and engine["spec_off_steps"] > 10, engine
    assert engine["spec_ahead_steps"] > 5, engine  # placeholders were used while paused
    assert "overlap scheduler runs while the speculation gate" in paused_server.log()
