"""Priority scheduling end to end: with --enable-priority-scheduling, an urgent request sent into
a queue flooded with low-priority ones is admitted at the next free slot, so its time to first
token is well below that of a low-priority request sent at the same moment (which waits for the
whole flood); the `priority` field is read from chat, completions and /generate alike. (Without
the flag a non-zero priority is a 400: rust/server/tests/api.rs.)"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from server_harness import Server, start_server, stop_server

pytestmark = pytest.mark.slow  # one slot, a queue of streams: ~40-90 s on a busy 2-core machine

FLOOD = 6
TOKENS = 6


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = start_server(str(tmp_path_factory.mktemp("priority")), "--enable-priority-scheduling",
                          "--max-running-requests", "1", "--max-total-tokens", "2048")
    yield server
    stop_server(server)


def _ttft(url: str, model: str, priority: int, out: dict, key: str) -> None:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)
    sent = time.monotonic()
    stream = client.completions.create(
        model=model, prompt=f"Request {key}: once upon a time", max_tokens=TOKENS, temperature=0,
        stream=True, extra_body={"ignore_eos": True, "priority": priority})
    for chunk in stream:
        if chunk.choices and chunk.choices[0].text and key not in out:
            out[key] = time.monotonic() - sent
    out.setdefault(key, float("inf"))


def _waiting(srv: Server) -> int:
    return srv.info()["engine"]["waiting_requests"]


def test_an_urgent_request_skips_a_low_priority_flood(srv: Server) -> None:
    model = srv.info()["served_model_name"]
    ttft: dict[str, float] = {}
    flood = [threading.Thread(target=_ttft, args=(srv.url, model, 0, ttft, f"low{i}"))
             for i in range(FLOOD)]
    for t in flood:
        t.start()
    deadline = time.monotonic() + 60
    while _waiting(srv) < FLOOD - 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _waiting(srv) >= FLOOD - 2, "the flood never queued"
    late = [threading.Thread(target=_ttft, args=(srv.url, model, 0, ttft, "control")),
            threading.Thread(target=_ttft, args=(srv.url, model, 10, ttft, "urgent"))]
    for t in late:
        t.start()
    for t in flood + late:
        t.join(300)
    assert len(ttft) == FLOOD + 2 and all(v < float("inf") for v in ttft.values()), ttft
    # The urgent one waits for one slot to free up; the control for the whole flood ahead of it.
    assert ttft["urgent"] < ttft["control"] / 2, ttft
    later_lows = sorted(v for k, v in ttft.items() if k.startswith("low"))[-3:]
    assert ttft["urgent"] < min(later_lows), ttft


def test_priority_reaches_the_scheduler_from_every_route(srv: Server) -> None:
    model = srv.info()["served_model_name"]
    chat = httpx.post(f"{srv.url}/v1/chat/completions", timeout=120, json={
        "model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
        "priority": -5})
    assert chat.status_code == 200, chat.text
    gen = httpx.post(f"{srv.url}/generate", timeout=120, json={
        "text": "hi", "priority": 7, "sampling_params": {"max_new_tokens": 2}})
    assert gen.status_code == 200, gen.text
    bad = httpx.post(f"{srv.url}/generate", timeout=30, json={
        "text": "hi", "priority": 1.5, "sampling_params": {"max_new_tokens": 2}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "priority", bad.text

