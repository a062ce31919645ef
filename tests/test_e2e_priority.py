"""Priority scheduling end to end: with --enable-priority-scheduling, an urgent request sent into
a queue flooded with low-priority ones is admitted at the next free slot, so its time to first
token is well below that of a low-priority request sent at the same moment (which waits for the
whole flood); the `priority` field is read from chat, completions and /generate alike. (Without
the flag a non-zero priority is a 400: rust/server/tests/api.rs.) With --max-queued-requests full,
a more urgent arrival displaces the latest least urgent waiting request (which gets a 429), and one
not more urgent than any waiting request is refused with a 429."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from server_harness import Server, start_server, stop_server

SLOW = pytest.mark.slow  # one slot, a queue of streams: ~40-90 s on a busy 2-core machine

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


@SLOW
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


@SLOW
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



# --max-queued-requests under priority scheduling: one slot held by a long stream, two waiting.
# The threshold keeps the holder from being preempted, so the queue stays as the test built it.

@pytest.fixture(scope="module")
def full(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = start_server(str(tmp_path_factory.mktemp("priority_full")), "--enable-priority-scheduling",
                          "--max-running-requests", "1", "--max-queued-requests", "2",
                          "--priority-scheduling-preemption-threshold", "1000",
                          "--max-total-tokens", "2048")
    yield server
    stop_server(server)


def _client(srv: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=120)


def _hold_the_slot(srv: Server, priority: int) -> openai.Stream:
    """A long stream, returned once it runs (its first token came); closing it aborts it."""
    stream = _client(srv).completions.create(
        model=srv.info()["served_model_name"], prompt="The slot holder:", max_tokens=1000,
        temperature=0, stream=True, extra_body={"ignore_eos": True, "priority": priority})
    for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            return stream
    raise AssertionError("the holder ended before its first token")


def _complete(srv: Server, priority: int, out: dict, key: str) -> None:
    """A short completion; `out[key]` is its text, or the 429 it got."""
    try:
        done = _client(srv).completions.create(
            model=srv.info()["served_model_name"], prompt=f"Request {key}:", max_tokens=3,
            temperature=0, extra_body={"ignore_eos": True, "priority": priority})
        out[key] = done.choices[0].text
    except openai.RateLimitError as e:
        out[key] = e


def _queue(srv: Server, priority: int, out: dict, key: str) -> threading.Thread:
    """Sends a request in the background and waits until it waits in the queue."""
    before = _waiting(srv)
    t = threading.Thread(target=_complete, args=(srv, priority, out, key), daemon=True)
    t.start()
    deadline = time.monotonic() + 30
    while _waiting(srv) <= before and time.monotonic() < deadline:
        time.sleep(0.02)
    assert _waiting(srv) == before + 1, f"{key} never queued"
    return t


def _refused(result: object, says: str) -> None:
    assert isinstance(result, openai.RateLimitError), result
    assert result.status_code == 429
    assert isinstance(result.body, dict) and result.body["type"] == "overloaded_error", result.body
    assert says in result.body["message"], result.body


def test_a_more_urgent_request_displaces_the_latest_least_urgent_waiting_one(full: Server) -> None:
    out: dict[str, object] = {}
    holder = _hold_the_slot(full, 0)
    low = [_queue(full, 0, out, "low1"), _queue(full, 0, out, "low2")]
    urgent = threading.Thread(target=_complete, args=(full, 10, out, "urgent"), daemon=True)
    urgent.start()
    low[1].join(30)
    _refused(out.get("low2"), "a more urgent request displaced this one")
    assert "low1" not in out and _waiting(full) == 2, out
    holder.close()  # frees the slot: the urgent request goes first, then low1
    for t in (urgent, low[0]):
        t.join(60)
    assert isinstance(out["urgent"], str) and isinstance(out["low1"], str), out


def test_a_request_not_more_urgent_than_the_full_queue_is_refused(full: Server) -> None:
    out: dict[str, object] = {}
    holder = _hold_the_slot(full, 10)
    high = [_queue(full, 10, out, "high1"), _queue(full, 10, out, "high2")]
    _complete(full, 0, out, "low")
    _refused(out["low"], "no waiting request is less urgent")
    _complete(full, 10, out, "equal")  # an equal does not displace either
    _refused(out["equal"], "no waiting request is less urgent")
    assert _waiting(full) == 2 and "high1" not in out and "high2" not in out, out
    holder.close()
    for t in high:
        t.join(60)
    assert isinstance(out["high1"], str) and isinstance(out["high2"], str), out
