"""Priority preemption end to end (--priority-scheduling-preemption-threshold, default 10): with
both slots held by low-priority streams, a request that outranks them by more than the threshold
retracts one and starts at once, while one within the threshold waits for a stream to end. The
preempted stream resumes from its cached KV and its greedy tokens equal an unpreempted run's."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from server_harness import Server, start_server, stop_server

pytestmark = pytest.mark.slow  # three rounds of two 40-token streams on CPU: ~30-60 s

LOW_TOKENS = 40
PROMPTS = ["The history of the printing press", "A recipe for bread starts with"]


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = start_server(str(tmp_path_factory.mktemp("preempt")), "--enable-priority-scheduling",
                          "--max-running-requests", "2", "--max-total-tokens", "2048")
    yield server
    stop_server(server)


def _stream(url: str, model: str, prompt: str, priority: int, max_tokens: int,
            out: dict, key: str) -> None:
    """Streams a greedy completion; out[key] = (seconds to the first token, the text)."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)
    sent = time.monotonic()
    first = float("inf")
    text = []
    stream = client.completions.create(
        model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
        extra_body={"ignore_eos": True, "priority": priority})
    for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            first = min(first, time.monotonic() - sent)
            text.append(chunk.choices[0].text)
    out[key] = (first, "".join(text))


def _engine(srv: Server) -> dict:
    return srv.info()["engine"]


def _round(srv: Server, urgent_priority: int | None) -> dict:
    """Two low-priority streams fill both slots; once both decode, an urgent request arrives."""
    model = srv.info()["served_model_name"]
    assert httpx.post(f"{srv.url}/flush_cache", timeout=30).status_code == 200
    out: dict = {}
    lows = [threading.Thread(target=_stream, args=(srv.url, model, p, 0, LOW_TOKENS, out, f"low{i}"))
            for i, p in enumerate(PROMPTS)]
    for t in lows:
        t.start()
    steps = _engine(srv)["steps"]
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        engine = _engine(srv)
        if engine["running_requests"] == 2 and engine["steps"] > steps + 5:
            break
        time.sleep(0.02)
    assert not out, "the streams were still decoding when the urgent request came"
    threads = list(lows)
    if urgent_priority is not None:
        urgent = threading.Thread(target=_stream, args=(srv.url, model, "Say hi", urgent_priority, 2,
                                                        out, "urgent"))
        urgent.start()
        threads.append(urgent)
    for t in threads:
        t.join(300)
    return out


def test_a_much_more_urgent_request_preempts_and_the_victim_resumes_exactly(srv: Server) -> None:
    alone = _round(srv, None)
    before = _engine(srv)["retractions"]
    waits = _round(srv, 5)  # outranks the streams by 5: within the threshold, no preemption
    assert _engine(srv)["retractions"] == before
    preempts = _round(srv, 20)
    assert _engine(srv)["retractions"] > before, "a low-priority stream was retracted"
    # Without preemption the urgent request waits for a 40-token stream to end.
    assert preempts["urgent"][0] < waits["urgent"][0] / 2, (preempts["urgent"], waits["urgent"])
    for key in ("low0", "low1"):
        assert waits[key][1] == alone[key][1], key
        assert preempts[key][1] == alone[key][1], f"{key} resumed with the same greedy tokens"
