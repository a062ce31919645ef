"""Soak: many mixed requests (three routes, streaming or not, stop strings, n > 1, cancellations,
invalid bodies) at concurrency 64 against a tiny KV pool and a short queue. Every request must
get its answer or an explicit refusal (400 for an invalid one, 429 when the queue is full), and
no KV page may leak. TOKENSPEED_SOAK_REQUESTS sets the count (default and CI: 2,000)."""

from __future__ import annotations

import asyncio
import collections
import json
import os
import random
import time
from collections.abc import Iterator

import httpx
import pytest

from server_harness import Server, flushed_pages, start_server, stop_server

CONCURRENCY = 64
STOPS = [" the", ".", ",", "\n"]


@pytest.fixture(scope="module")
def soak_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    # 256 pages of 4 tokens; in flight at most 16 running + 32 queued, so 64 clients overflow it.
    server = start_server(str(tmp_path_factory.mktemp("soak")), "--page-size", "4", "--max-total-tokens", "1024",
                          "--max-running-requests", "16", "--max-queued-requests", "32")
    yield server
    stop_server(server)


def _request(rng: random.Random) -> tuple[str, dict | bytes, str]:
    """(path, body, kind); kind is 'ok', 'invalid' (must get 400), 'n' (400 or n choices) or 'cancel'."""
    path = rng.choice(["/v1/completions", "/v1/chat/completions", "/generate"])
    max_tokens = rng.randrange(1, 9)
    stream = rng.random() < 0.5
    stop = rng.sample(STOPS, rng.randrange(3)) if rng.random() < 0.4 else None
    prompt = rng.choice(["Once upon a time", "The capital of France is", "1, 2, 3,", "Write a poem"])
    if path == "/generate":
        body: dict = {"text": prompt, "stream": stream,
                      "sampling_params": {"max_new_tokens": max_tokens, "temperature": rng.choice([0, 0.8])}}
        if stop:
            body["sampling_params"]["stop"] = stop
    else:
        body = {"max_tokens": max_tokens, "stream": stream, "temperature": rng.choice([0, 0.8])}
        if path == "/v1/completions":
            body["prompt"] = prompt
        else:
            body["messages"] = [{"role": "user", "content": prompt}]
        if stop:
            body["stop"] = stop
    roll = rng.random()
    if roll < 0.10:
        if path == "/generate":  # sampling fields live in sampling_params there
            bad = [{**body, "sampling_params": {**body["sampling_params"], "temperature": -3}}, {"text": 5}]
        else:
            bad = [{**body, "temperature": -3}, {**body, "max_tokens": 10**9}]
        return path, rng.choice([b"{oops", b"", b"[]", *(json.dumps(x).encode() for x in bad)]), "invalid"
    if roll < 0.15 and path != "/generate":
        return path, {**body, "n": 2}, "n"
    if roll < 0.30:
        return path, {**body, "max_tokens": 64, "ignore_eos": True} if path != "/generate" else body, "cancel"
    return path, body, "ok"


def _check_answer(path: str, body: dict, data: dict, max_tokens: int) -> None:
    if path == "/generate":
        assert data["meta_info"]["finish_reason"]["type"] in ("stop", "length"), data
        assert data["meta_info"]["completion_tokens"] <= max_tokens, data
    else:
        assert data["choices"] and all(c["finish_reason"] in ("stop", "length") for c in data["choices"]), data
        assert data["usage"]["completion_tokens"] <= max_tokens * len(data["choices"]), data


async def _one(client: httpx.AsyncClient, url: str, rng: random.Random, tally: collections.Counter,
               failures: list) -> None:
    """One request; a 429 is retried (as a client honouring Retry-After would, but sooner) up to
    three times before it counts as refused."""
    path, body, kind = _request(rng)
    for _ in range(3):
        if not await _attempt(client, url, rng, tally, failures, path, body, kind):
            return
        tally["retried-after-429"] += 1
        await asyncio.sleep(rng.uniform(0.1, 0.5))
    if await _attempt(client, url, rng, tally, failures, path, body, kind):
        tally["refused-429"] += 1


async def _attempt(client: httpx.AsyncClient, url: str, rng: random.Random, tally: collections.Counter,
                   failures: list, path: str, body: dict | bytes, kind: str) -> bool:
    """Tallies the outcome, except a 429 (the caller may retry it): True for that."""
    limit = (body.get("max_tokens") or body.get("sampling_params", {}).get("max_new_tokens", 0)
             if isinstance(body, dict) else 0)
    stream = isinstance(body, dict) and body.get("stream", False)
    kwargs = {"json": body} if isinstance(body, dict) else {"content": body}
    try:
        if kind == "cancel":  # walk away after a moment, mid-queue or mid-generation
            try:
                await asyncio.wait_for(client.post(url + path, **kwargs), timeout=rng.uniform(0.05, 0.6))
                tally["cancel-too-late"] += 1
            except asyncio.TimeoutError:
                tally["cancelled"] += 1
            return False
        if stream:
            async with client.stream("POST", url + path, **kwargs) as r:
                if r.status_code != 200:
                    await r.aread()
                    return _refusal(kind, r, tally, failures, path, body)
                events = [line[6:] async for line in r.aiter_lines() if line.startswith("data: ")]
            assert events and events[-1] == "[DONE]", events[-3:]
            chunks = [json.loads(e) for e in events[:-1]]
            assert not any("error" in c for c in chunks), chunks[-1]
            if path == "/generate":
                _check_answer(path, body, chunks[-1], limit)
            else:
                assert any(c["choices"] and c["choices"][0].get("finish_reason") for c in chunks), chunks[-2:]
            tally[f"{kind}-answered"] += 1
            return False
        r = await client.post(url + path, **kwargs)
        if r.status_code != 200:
            return _refusal(kind, r, tally, failures, path, body)
        assert kind != "invalid", (path, body, r.text[:200])
        _check_answer(path, body, r.json(), limit)
        tally[f"{kind}-answered"] += 1
    except Exception as e:  # noqa: BLE001  (any other outcome is a failure to report)
        failures.append((path, kind, str(body)[:150], repr(e)[:300]))
    return False


def _refusal(kind: str, r: httpx.Response, tally: collections.Counter, failures: list, path: str,
             body: object) -> bool:
    """True for a 429 with Retry-After (not tallied); tallies a 400 where one is due."""
    try:
        error = r.json()["error"]
    except (ValueError, KeyError):
        error = None
    if error is None:
        failures.append((path, kind, str(body)[:150], f"{r.status_code} without an OpenAI error: {r.text[:200]}"))
    elif r.status_code == 429 and r.headers.get("retry-after"):
        return True
    elif r.status_code == 400 and kind in ("invalid", "n"):
        tally[f"{kind}-400"] += 1
    else:
        failures.append((path, kind, str(body)[:150], f"{r.status_code}: {r.text[:200]}"))
    return False


async def _soak(url: str, n: int, seed: int) -> tuple[collections.Counter, list, float]:
    rng = random.Random(seed)
    tally: collections.Counter = collections.Counter()
    failures: list = []
    sem = asyncio.Semaphore(CONCURRENCY)
    limits = httpx.Limits(max_connections=CONCURRENCY + 8, max_keepalive_connections=CONCURRENCY)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        async def run(i: int) -> None:
            async with sem:
                await _one(client, url, random.Random(rng.random() + i), tally, failures)

        start = time.monotonic()
        await asyncio.gather(*(run(i) for i in range(n)))
        return tally, failures, time.monotonic() - start


def _run(server: Server, n: int) -> None:
    seed = int(os.environ.get("TOKENSPEED_SOAK_SEED", "7"))
    tally, failures, elapsed = asyncio.run(_soak(server.url, n, seed))
    print(f"\nsoak: {n} requests in {elapsed:.1f}s at concurrency {CONCURRENCY} (seed {seed}): {dict(tally)}")
    assert not failures, f"{len(failures)} failures, first: {failures[:5]}"
    assert sum(v for k, v in tally.items() if k != "retried-after-429") == n, tally
    # The server keeps serving through the overload: a real share is answered, not all refused
    # (alone on 2 cores ~30% of 2,000 are; 1/8 leaves room for a slower or busier CI machine).
    assert tally["ok-answered"] > n // 8 and tally["cancelled"] > 0 and tally["invalid-400"] > 0, tally
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    kv = flushed_pages(server, timeout_s=30)
    assert kv["free"] == kv["total"] and kv["used"] == 0, kv


def test_soak(soak_server: Server) -> None:
    _run(soak_server, int(os.environ.get("TOKENSPEED_SOAK_REQUESTS", "2000")))
