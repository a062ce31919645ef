"""Faults: a dead worker fails /health and ends in-flight requests with an error (no hang)."""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import pytest

from server_harness import Server, start_server, stop_server


@pytest.fixture()
def doomed_server(tmp_path) -> Server:
    srv = start_server(str(tmp_path))
    yield srv
    stop_server(srv)


def test_dead_worker_fails_health_and_in_flight_requests(doomed_server: Server) -> None:
    url = doomed_server.url
    pid = doomed_server.info()["worker_pids"][0]
    outcome: dict = {}

    def long_request() -> None:
        try:
            r = httpx.post(f"{url}/v1/completions", timeout=60, json={
                "prompt": "Once upon a time", "max_tokens": 3000, "ignore_eos": True, "temperature": 0.7})
            outcome["status"] = r.status_code
            outcome["body"] = r.json()
        except httpx.HTTPError as e:  # a hang would show up as a timeout here
            outcome["exception"] = repr(e)

    t = threading.Thread(target=long_request)
    t.start()
    time.sleep(2.0)
    os.kill(pid, signal.SIGKILL)
    t.join(timeout=30)
    assert not t.is_alive(), "the in-flight request hung after the worker died"
    assert outcome.get("status") == 503, outcome
    assert "worker" in outcome["body"]["error"]["message"]
    assert httpx.get(f"{url}/health", timeout=10).status_code == 503
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=10)
    assert r.status_code == 503 and "error" in r.json()
