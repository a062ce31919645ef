"""Ops and RL hooks on a real server: /pause_generation holds a streaming request mid-answer
(mode in_place) or ends it (the default, abort) and queues new ones, /continue_generation
resumes, and the server keeps serving; --weight-version is reported by /get_weight_version,
/get_model_info and every /generate answer."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from server_harness import Server, start_server, stop_server

pytestmark = pytest.mark.slow  # streams held across pauses: ~40 s, minutes on a busy machine


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = start_server(str(tmp_path_factory.mktemp("ops")), "--weight-version", "step-42",
                          "--max-total-tokens", "1024")
    yield server
    httpx.post(f"{server.url}/continue_generation", timeout=30)
    stop_server(server)


def _stream(url: str, max_tokens: int, out: dict) -> None:
    """A /generate stream; records when each event arrived and how it ended."""
    out["times"], out["status"] = [], None
    try:
        with httpx.stream("POST", f"{url}/generate", timeout=120, json={
                "text": "Once upon a time", "stream": True,
                "sampling_params": {"max_new_tokens": max_tokens, "ignore_eos": True,
                                    "temperature": 0}}) as r:
            out["status"] = r.status_code
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    out["times"].append(time.monotonic())
                    out["last"] = line
    except httpx.HTTPError as e:
        out["exception"] = repr(e)


def _started(out: dict) -> bool:
    deadline = time.monotonic() + 60
    while len(out.get("times", [])) < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    return len(out.get("times", [])) >= 2


def test_pause_in_place_holds_a_stream_and_continue_finishes_it(srv: Server) -> None:
    out: dict = {}
    t = threading.Thread(target=_stream, args=(srv.url, 12, out))
    t.start()
    assert _started(out), out
    r = httpx.post(f"{srv.url}/pause_generation", json={"mode": "in_place"}, timeout=30)
    assert r.status_code == 200, r.text
    time.sleep(0.3)  # a step already on its way may still land
    held_at = len(out["times"])
    time.sleep(1.5)
    assert len(out["times"]) == held_at, "tokens arrived while paused"
    assert t.is_alive()
    queued = httpx.Client(timeout=120)
    later: dict = {}
    waiter = threading.Thread(target=lambda: later.update(r=queued.post(
        f"{srv.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 3})))
    waiter.start()
    time.sleep(0.5)
    assert "r" not in later, "a request sent while paused was answered"
    assert httpx.post(f"{srv.url}/continue_generation", timeout=30).status_code == 200
    t.join(120)
    waiter.join(120)
    assert out["status"] == 200 and '"completion_tokens":12' in out["last"].replace(" ", ""), out
    assert later["r"].status_code == 200, later["r"].text


def test_pause_aborts_in_flight_requests_by_default_and_the_server_goes_on(srv: Server) -> None:
    out: dict = {}
    t = threading.Thread(target=_stream, args=(srv.url, 200, out))
    t.start()
    assert _started(out), out
    assert httpx.post(f"{srv.url}/pause_generation", timeout=30).status_code == 200
    t.join(60)
    assert not t.is_alive()
    assert "error" in out.get("last", "") or "exception" in out, out
    assert httpx.post(f"{srv.url}/continue_generation", timeout=30).status_code == 200
    r = httpx.post(f"{srv.url}/v1/completions", timeout=120, json={"prompt": "Hi", "max_tokens": 3})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text


def test_weight_version_is_reported(srv: Server) -> None:
    assert httpx.get(f"{srv.url}/get_weight_version", timeout=10).json() == {"weight_version": "step-42"}
    assert httpx.get(f"{srv.url}/get_model_info", timeout=10).json()["weight_version"] == "step-42"
    r = httpx.post(f"{srv.url}/generate", timeout=120, json={
        "text": "Hi", "sampling_params": {"max_new_tokens": 2}})
    assert r.json()["meta_info"]["weight_version"] == "step-42", r.text
