"""Graceful shutdown: on SIGTERM new requests get 503 at once, in-flight ones finish within
--shutdown-timeout (then the rest end with an error), the server exits 0 and leaves no worker
process and no shared-memory segment behind."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from server_harness import Server, pid_alive, shm_segments, start_server, stop_server, wait_exit


@pytest.fixture()
def srv(tmp_path, request) -> Iterator[Server]:
    server = start_server(str(tmp_path), *request.param)
    yield server
    stop_server(server)


def _completion(url: str, max_tokens: int, out: dict) -> None:
    try:
        r = httpx.post(f"{url}/v1/completions", timeout=120, json={
            "prompt": "Once upon a time", "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0})
        out["status"], out["body"] = r.status_code, r.json()
    except httpx.HTTPError as e:
        out["exception"] = repr(e)


def _stream(url: str, max_tokens: int, out: dict, started: threading.Event) -> None:
    events: list[str] = []
    try:
        with httpx.stream("POST", f"{url}/generate", timeout=120, json={
                "text": "Once upon a time", "stream": True,
                "sampling_params": {"max_new_tokens": max_tokens, "ignore_eos": True, "temperature": 0}}) as r:
            out["status"] = r.status_code
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    started.set()
    except httpx.HTTPError as e:
        out["exception"] = repr(e)
    out["events"] = events
    started.set()


def _in_flight(url: str, max_tokens: int) -> tuple[list[threading.Thread], dict, dict]:
    plain: dict = {}
    streamed: dict = {}
    started = threading.Event()
    threads = [threading.Thread(target=_completion, args=(url, max_tokens, plain)),
               threading.Thread(target=_stream, args=(url, max_tokens, streamed, started))]
    for t in threads:
        t.start()
    assert started.wait(60), "the stream never started"
    return threads, plain, streamed


def _check_clean_exit(server: Server, workers: list[int]) -> None:
    code = wait_exit(server, 30)
    assert code == 0, f"exit code {code}\n{server.log()[-3000:]}"
    deadline = time.monotonic() + 10
    while any(pid_alive(p) for p in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in workers if pid_alive(p)], "worker processes outlived the server"
    assert shm_segments(server) == []


@pytest.mark.parametrize("srv", [("--shutdown-timeout", "60")], indirect=True)
def test_sigterm_lets_in_flight_requests_finish(srv: Server) -> None:
    workers = srv.info()["worker_pids"]
    threads, plain, streamed = _in_flight(srv.url, 12)
    os.kill(srv.proc.pid, signal.SIGTERM)  # the server only, as an orchestrator sends it
    time.sleep(0.3)
    r = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=10)
    assert r.status_code == 503 and "shutting down" in r.json()["error"]["message"], r.text
    assert httpx.get(f"{srv.url}/health", timeout=10).status_code == 503
    for t in threads:
        t.join(timeout=60)
        assert not t.is_alive()
    assert plain.get("status") == 200, plain
    assert plain["body"]["usage"]["completion_tokens"] == 12, plain
    assert streamed.get("status") == 200 and streamed["events"][-1] == "[DONE]", streamed
    last = json.loads(streamed["events"][-2])
    assert last["meta_info"]["completion_tokens"] == 12, last
    _check_clean_exit(srv, workers)


@pytest.mark.parametrize("srv", [("--shutdown-timeout", "1")], indirect=True)
def test_requests_past_the_shutdown_timeout_are_aborted(srv: Server) -> None:
    workers = srv.info()["worker_pids"]
    threads, plain, streamed = _in_flight(srv.url, 3000)
    started = time.monotonic()
    os.kill(srv.proc.pid, signal.SIGTERM)
    for t in threads:
        t.join(timeout=30)
        assert not t.is_alive(), "an in-flight request hung through the shutdown"
    assert time.monotonic() - started < 10
    assert plain.get("status") == 503 and "shutting down" in plain["body"]["error"]["message"], plain
    assert streamed.get("status") == 200, streamed
    errors = [json.loads(e) for e in streamed["events"] if e != "[DONE]" and "error" in json.loads(e)]
    assert errors and "shutting down" in errors[-1]["error"]["message"], streamed["events"][-3:]
    _check_clean_exit(srv, workers)
