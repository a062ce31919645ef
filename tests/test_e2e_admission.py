"""What the HTTP layer refuses before any work is done: a missing or wrong API key (401, on
every route but /health, /ping and /metrics), a body over --max-request-body-bytes (413),
malformed UTF-8 (400), a request beyond --max-running-requests + --max-queued-requests (a fast
429 with Retry-After); and random bodies on every POST route never get a 5xx."""

from __future__ import annotations

import json
import os
import random
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from server_harness import Server, start_server, stop_server

KEY = "sk-reliab-0123456789"
BODY_LIMIT = 65536
AUTH = {"Authorization": f"Bearer {KEY}"}
# Every POST route and a minimal valid body (few tokens: CPU).
POST_ROUTES = {
    "/v1/completions": {"prompt": "Hello", "max_tokens": 2},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
    "/generate": {"text": "Hello", "sampling_params": {"max_new_tokens": 2}},
    "/tokenize": {"prompt": "Hello"},
    "/detokenize": {"tokens": [1, 2, 3]},
}
GET_ROUTES = ["/v1/models", "/get_model_info", "/get_server_info", "/flush_cache", "/health_generate"]
OPEN_ROUTES = ["/health", "/ping", "/metrics"]
FUZZ_CASES = int(os.environ.get("TOKENSPEED_FUZZ_CASES", "250"))


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = start_server(str(tmp_path_factory.mktemp("admission")), "--api-key", KEY,
                          "--max-running-requests", "2", "--max-queued-requests", "2",
                          "--max-request-body-bytes", str(BODY_LIMIT), "--enable-metrics",
                          "--max-total-tokens", "4096", "--page-size", "4",
                          # A fuzzed body that loses its max_tokens asks for the default length:
                          # a short context refuses that (400) instead of generating for long.
                          "--context-length", "64")
    yield server
    stop_server(server)


def _is_openai_error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, (r.status_code, r.text[:300])
    err = r.json()["error"]
    assert {"message", "type", "param", "code"} <= set(err), err
    return err


def test_api_key_is_required_on_every_route_but_health_ping_metrics(srv: Server) -> None:
    wrong = {"Authorization": f"Bearer {KEY[:-1]}X"}  # same length: only the last byte differs
    for headers in ({}, wrong, {"Authorization": KEY}):
        for path, body in POST_ROUTES.items():
            _is_openai_error(httpx.post(srv.url + path, json=body, headers=headers, timeout=30), 401)
        for path in GET_ROUTES:
            _is_openai_error(httpx.get(srv.url + path, headers=headers, timeout=30), 401)
        for path in OPEN_ROUTES:
            assert httpx.get(srv.url + path, headers=headers, timeout=30).status_code == 200, path
    for path, body in POST_ROUTES.items():
        r = httpx.post(srv.url + path, json=body, headers=AUTH, timeout=60)
        assert r.status_code == 200, (path, r.text[:300])
    for path in GET_ROUTES:
        assert httpx.get(srv.url + path, headers=AUTH, timeout=60).status_code == 200, path


def test_body_over_the_limit_gets_413(srv: Server) -> None:
    pad = " " * (BODY_LIMIT - 100)
    ok = ('{"prompt": "Hello", "max_tokens": 1}' + pad).encode()
    assert len(ok) <= BODY_LIMIT
    assert httpx.post(f"{srv.url}/v1/completions", content=ok, headers=AUTH, timeout=30).status_code == 200
    big = ok + b" " * 200
    for path in POST_ROUTES:
        err = _is_openai_error(httpx.post(srv.url + path, content=big, headers=AUTH, timeout=30), 413)
        assert str(BODY_LIMIT) in err["message"]

    def chunks() -> Iterator[bytes]:  # no Content-Length: the limit applies while reading
        yield b'{"prompt": "'
        for _ in range(BODY_LIMIT // 1024 + 2):
            yield b"a" * 1024
        yield b'", "max_tokens": 1}'

    _is_openai_error(httpx.post(f"{srv.url}/v1/completions", content=chunks(), headers=AUTH, timeout=30), 413)
    assert httpx.get(f"{srv.url}/health", timeout=10).status_code == 200


def test_malformed_utf8_gets_400(srv: Server) -> None:
    for path in POST_ROUTES:
        body = b'{"prompt": "\xff\xfe\xc3", "text": "\xc3\x28", "messages": [{"role": "user", "content": "\xff"}]}'
        _is_openai_error(httpx.post(srv.url + path, content=body, headers=AUTH, timeout=30), 400)


def test_a_full_queue_gets_a_fast_429_with_retry_after(srv: Server) -> None:
    body = {"prompt": "Count to one hundred:", "max_tokens": 6, "ignore_eos": True}

    def one(_: int) -> tuple[int, float, httpx.Response]:
        start = time.monotonic()
        r = httpx.post(f"{srv.url}/v1/completions", json=body, headers=AUTH, timeout=300)
        return r.status_code, time.monotonic() - start, r

    with ThreadPoolExecutor(12) as pool:
        results = list(pool.map(one, range(12)))
    statuses = sorted(s for s, _, _ in results)
    assert set(statuses) <= {200, 429}, statuses
    assert statuses.count(200) >= 2 and statuses.count(429) >= 1, statuses
    for status, elapsed, r in results:
        if status == 429:
            err = _is_openai_error(r, 429)
            assert "overloaded" in err["message"]
            assert r.headers.get("retry-after", "").isdigit(), r.headers
            assert elapsed < 2.0, elapsed  # refused before tokenizing, not after waiting
        else:
            assert r.json()["usage"]["completion_tokens"] == 6
    metrics = httpx.get(f"{srv.url}/metrics", timeout=10).text
    assert "tokenspeed:requests_rejected_total" in metrics
    r = httpx.post(f"{srv.url}/v1/completions", json=body, headers=AUTH, timeout=120)
    assert r.status_code == 200, r.text


# --- raw random bodies -------------------------------------------------------------------------

def _random_value(rng: random.Random, depth: int = 0) -> object:
    kind = rng.randrange(9 if depth < 3 else 6)
    if kind == 0:
        return None
    if kind == 1:
        return rng.choice([True, False])
    if kind == 2:
        return rng.choice([0, 1, -1, 2**31, 2**63, -(2**70), rng.randrange(-1000, 1000)])
    if kind == 3:
        return rng.choice([0.0, -0.5, 1e308, float("inf"), float("nan"), rng.uniform(-10, 10)])
    if kind in (4, 5):
        return "".join(rng.choice("ab \n\"\\{}[]é中\u0000\ud7ff") for _ in range(rng.randrange(12)))
    if kind in (6, 7):
        return [_random_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    return {rng.choice(["prompt", "messages", "text", "n", "stop", "x"]): _random_value(rng, depth + 1)
            for _ in range(rng.randrange(4))}


def _random_body(rng: random.Random, path: str) -> bytes:
    style = rng.randrange(4)
    if style == 0:  # bytes
        return bytes(rng.randrange(256) for _ in range(rng.randrange(64)))
    if style == 1:  # any JSON
        return json.dumps(_random_value(rng), allow_nan=True).encode()
    body = json.loads(json.dumps(POST_ROUTES[path]))
    if style == 2:  # a valid request with one field set to a random value
        field = rng.choice(["prompt", "messages", "text", "input_ids", "max_tokens", "temperature", "top_p",
                            "top_k", "n", "stop", "stream", "logprobs", "top_logprobs", "seed", "tokens",
                            "sampling_params", "stop_token_ids", "min_tokens", "model", "echo"])
        value = _random_value(rng)
        if isinstance(value, int) and not isinstance(value, bool) and 4 < value < 2**31:
            value = value % 5  # in range, a count would only make the run slow (max_tokens, n)
        if isinstance(value, dict) and field == "sampling_params":
            value["max_new_tokens"] = 2
        body[field] = value
    raw = json.dumps(body, allow_nan=True).encode()
    if style == 3 and raw:  # a valid request, truncated or with a byte flipped
        i = rng.randrange(len(raw))
        raw = raw[:i] if rng.random() < 0.5 else raw[:i] + bytes([rng.randrange(256)]) + raw[i + 1:]
    return raw


def test_random_bodies_never_get_a_5xx(srv: Server) -> None:
    seed = int(os.environ.get("TOKENSPEED_FUZZ_SEED", "12"))
    rng = random.Random(seed)
    paths = list(POST_ROUTES)
    failures = []
    with httpx.Client(headers=AUTH, timeout=60) as client:
        for case in range(FUZZ_CASES):
            path = paths[case % len(paths)]
            body = _random_body(rng, path)
            r = client.post(srv.url + path, content=body)
            if r.status_code >= 500:
                failures.append((path, body[:200], r.status_code, r.text[:200]))
            elif r.status_code >= 400:
                assert "error" in r.json(), (path, body[:200], r.text[:200])
    assert not failures, f"seed {seed}: {failures[:5]}"
    assert httpx.get(f"{srv.url}/health", timeout=10).status_code == 200
    r = httpx.post(f"{srv.url}/v1/completions", json=POST_ROUTES["/v1/completions"], headers=AUTH, timeout=60)
    assert r.status_code == 200
