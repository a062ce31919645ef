"""`--max-logprobs` (vLLM's flag) through the official `openai` client against `tokenspeed serve`
on CPU with the default model (vocabulary 49152): the default cap of 20 refuses more, and -1
("all"), with a 400 naming the field and the cap; a raised cap allows up to it; an uncapped
server returns the whole vocabulary for `logprobs: -1`; and a cap the shared-memory rings cannot
hold at the default step size fails at start, naming the flags."""

from __future__ import annotations

import math
from collections.abc import Iterator

import httpx
import openai
import pytest

from server_harness import Server, start_server, stop_server

VOCAB = 49152  # SmolLM2's
PROMPT = "The capital of France is"
# A vocabulary-wide cap needs small steps: a result slot holds every token of a step with all
# of its logprobs (python/tokenspeed/launch/ring_size.py).
SMALL_STEPS = ("--max-running-requests", "2", "--chunked-prefill-size", "32")


def client_of(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def refusal(server: Server, route: str, body: dict) -> dict:
    r = httpx.post(f"{server.url}{route}", json={"max_tokens": 1, **body}, timeout=60)
    assert r.status_code == 400, r.text
    return r.json()["error"]


@pytest.fixture(scope="module")
def uncapped(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = start_server(str(tmp_path_factory.mktemp("uncapped")), "--max-logprobs", "-1", *SMALL_STEPS)
    try:
        yield srv
    finally:
        stop_server(srv)


@pytest.mark.parametrize(("route", "field", "value"), [
    ("/v1/completions", "logprobs", -1),
    ("/v1/completions", "logprobs", 21),
    ("/v1/completions", "prompt_logprobs", 21),
    ("/v1/chat/completions", "top_logprobs", 21),
    ("/v1/chat/completions", "top_logprobs", -1),
])
def test_the_default_cap_refuses_more_naming_the_field_and_the_cap(server: Server, route: str,
                                                                   field: str, value: int) -> None:
    body = {"prompt": PROMPT} if route == "/v1/completions" else {
        "messages": [{"role": "user", "content": "Hi"}], "logprobs": True}
    e = refusal(server, route, {**body, field: value})
    assert e["param"] == field and "max allowed: 20" in e["message"] and "--max-logprobs" in e["message"], e
    if value == -1:
        assert f"all {VOCAB} tokens" in e["message"], e


def test_the_default_cap_allows_twenty(client: openai.OpenAI, model: str) -> None:
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=1, temperature=0, logprobs=20)
    assert len(r.choices[0].logprobs.top_logprobs[0]) == 20


def test_minus_one_returns_the_whole_vocabulary(uncapped: Server) -> None:
    client = client_of(uncapped)
    model = client.models.list().data[0].id
    ask = {"model": model, "prompt": PROMPT, "max_tokens": 2, "temperature": 0,
           "extra_body": {"return_tokens_as_token_ids": True}}  # keys then unique per token
    full = client.completions.create(logprobs=-1, **ask).choices[0].logprobs
    top5 = client.completions.create(logprobs=5, **ask).choices[0].logprobs
    assert full.tokens == top5.tokens
    for every, best in zip(full.top_logprobs, top5.top_logprobs):
        assert len(every) == VOCAB
        assert math.fsum(math.exp(v) for v in every.values()) == pytest.approx(1.0, abs=1e-3)
        ranked = sorted(every.items(), key=lambda kv: -kv[1])[:5]
        assert dict(ranked) == pytest.approx(best, abs=1e-5)
    # Chat's top_logprobs -1 (vLLM accepts it there too) and the prompt's, one per token.
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=1, temperature=0, logprobs=True, top_logprobs=-1)
    assert len(chat.choices[0].logprobs.content[0].top_logprobs) == VOCAB
    prompt = client.completions.create(model=model, prompt=[1, 2, 3], max_tokens=1,
                                       extra_body={"prompt_logprobs": -1}).choices[0].model_extra
    assert [len(p) for p in prompt["prompt_logprobs"][1:]] == [VOCAB, VOCAB]


def test_a_raised_cap_allows_up_to_it(tmp_path: object) -> None:
    srv = start_server(str(tmp_path), "--max-logprobs", "30", *SMALL_STEPS)
    try:
        client = client_of(srv)
        model = client.models.list().data[0].id
        r = client.completions.create(model=model, prompt=PROMPT, max_tokens=1, logprobs=30)
        assert len(r.choices[0].logprobs.top_logprobs[0]) == 30
        e = refusal(srv, "/v1/completions", {"prompt": PROMPT, "logprobs": 31})
        assert e["param"] == "logprobs" and "max allowed: 30" in e["message"], e
        assert "max allowed: 30" in refusal(srv, "/v1/completions", {"prompt": PROMPT, "logprobs": -1})["message"]
    finally:
        stop_server(srv)


def test_a_cap_the_rings_cannot_hold_fails_at_start(tmp_path: object) -> None:
    # The whole vocabulary for every token of a default step (8192 tokens) is gigabytes a slot.
    with pytest.raises(RuntimeError) as e:
        start_server(str(tmp_path), "--max-logprobs", "-1", timeout_s=120)
    log = str(e.value)
    assert "--max-logprobs -1" in log and "--chunked-prefill-size" in log and "Traceback" not in log, log
