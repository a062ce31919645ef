"""Faults: a dead or hung worker fails /health within 2 s, ends every in-flight request with an
error (non-stream: a 5xx in the OpenAI format; stream: an error event), and the server exits
non-zero leaving no worker process and no shared-memory segment behind."""

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

LONG = {"prompt": "Once upon a time", "max_tokens": 3000, "ignore_eos": True, "temperature": 0.7}


@pytest.fixture()
def doomed_server(tmp_path, request) -> Iterator[Server]:
    srv = start_server(str(tmp_path), *getattr(request, "param", ()))
    yield srv
    stop_server(srv)


def _non_stream(url: str, outcome: dict) -> None:
    try:
        r = httpx.post(f"{url}/v1/completions", timeout=60, json=LONG)
        outcome["status"], outcome["body"] = r.status_code, r.json()
    except httpx.HTTPError as e:  # a hang would show up as a timeout here
        outcome["exception"] = repr(e)


def _stream(url: str, outcome: dict, started: threading.Event) -> None:
    events: list[str] = []
    try:
        with httpx.stream("POST", f"{url}/v1/chat/completions", timeout=60, json={
                "messages": [{"role": "user", "content": "Tell me a long story."}], "max_tokens": 3000,
                "ignore_eos": True, "stream": True}) as r:
            outcome["status"] = r.status_code
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    started.set()
    except httpx.HTTPError as e:
        outcome["exception"] = repr(e)
    outcome["events"] = events
    started.set()


def _start_in_flight(url: str) -> tuple[list[threading.Thread], dict, dict]:
    plain: dict = {}
    streamed: dict = {}
    started = threading.Event()
    threads = [threading.Thread(target=_non_stream, args=(url, plain)),
               threading.Thread(target=_stream, args=(url, streamed, started))]
    for t in threads:
        t.start()
    assert started.wait(60), "the stream never started"
    time.sleep(0.5)  # a few tokens into both requests
    return threads, plain, streamed


def _wait_health_503(url: str, within_s: float) -> float:
    """Seconds until /health stops answering 200 (503, or the port closed because it exited)."""
    start = time.monotonic()
    while time.monotonic() - start < within_s:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 503:
                return time.monotonic() - start
        except httpx.HTTPError:
            return time.monotonic() - start
        time.sleep(0.05)
    raise AssertionError(f"/health still 200 after {within_s}s")


def _check_failed_everything(srv: Server, threads: list[threading.Thread], plain: dict, streamed: dict,
                             worker_pids: list[int], needle: str) -> None:
    for t in threads:
        t.join(timeout=30)
        assert not t.is_alive(), "an in-flight request hung after the worker failed"
    assert plain.get("status") == 503, plain
    assert needle in plain["body"]["error"]["message"], plain
    assert streamed.get("status") == 200 and streamed["events"], streamed
    errors = [json.loads(e) for e in streamed["events"] if e != "[DONE]" and "error" in json.loads(e)]
    assert errors and needle in errors[-1]["error"]["message"], streamed["events"][-3:]
    code = wait_exit(srv, 30)
    assert code not in (None, 0), f"exit code {code}\n{srv.log()[-3000:]}"
    deadline = time.monotonic() + 10  # the server reaps its workers before it exits
    while any(pid_alive(p) for p in worker_pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in worker_pids if pid_alive(p)], "worker processes outlived the server"
    assert shm_segments(srv) == []


def test_dead_worker_fails_health_requests_and_exits(doomed_server: Server) -> None:
    url = doomed_server.url
    pids = doomed_server.info()["worker_pids"]
    threads, plain, streamed = _start_in_flight(url)
    assert plain == {} and "exception" not in streamed, (plain, streamed)
    os.kill(pids[0], signal.SIGKILL)
    assert _wait_health_503(url, 2.0) < 2.0
    _check_failed_everything(doomed_server, threads, plain, streamed, pids, "worker")
    assert "exited" in doomed_server.log()


# Long enough that a normal step on a loaded 2-core CI machine never trips it.
WATCHDOG_S = 10.0


@pytest.mark.parametrize("doomed_server", [("--watchdog-timeout", str(WATCHDOG_S))], indirect=True)
def test_hung_worker_trips_the_watchdog(doomed_server: Server) -> None:
    url = doomed_server.url
    pids = doomed_server.info()["worker_pids"]
    threads, plain, streamed = _start_in_flight(url)
    assert plain == {} and "exception" not in streamed, (plain, streamed)
    os.kill(pids[0], signal.SIGSTOP)  # alive but never answers: a hang, not a death
    try:
        assert _wait_health_503(url, WATCHDOG_S + 2.0) < WATCHDOG_S + 2.0
        _check_failed_everything(doomed_server, threads, plain, streamed, pids, "watchdog")
    finally:
        for p in pids:
            if pid_alive(p):
                os.kill(p, signal.SIGKILL)
    log = doomed_server.log()
    assert "watchdog: step" in log and "--watchdog-timeout" in log, log[-3000:]
