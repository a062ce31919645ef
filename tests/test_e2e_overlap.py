"""Overlap scheduling end to end: the default server (the engine plans step N+1 while step N
runs, decode inputs resolved by the worker) answers exactly like one started with
`--disable-overlap-schedule`, for greedy, seeded, penalized and stop-token requests in one batch."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from server_harness import Server, start_server, stop_server

# The same flags as the session `server` fixture (tests/conftest.py), so only overlap differs.
FLAGS = ("--page-size", "4", "--max-running-requests", "32", "--max-total-tokens", "16384")


@pytest.fixture(scope="module")
def serial_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = start_server(str(tmp_path_factory.mktemp("serial")), *FLAGS, "--disable-overlap-schedule")
    try:
        yield srv
    finally:
        stop_server(srv)


REQUESTS = [
    {"prompt": f"List {i} fruits:", "max_tokens": 24, "temperature": 0} for i in range(2, 8)
] + [
    {"prompt": "Write a haiku about the sea.", "max_tokens": 20, "temperature": 0.8, "seed": 7},
    {"prompt": "Say yes yes yes yes", "max_tokens": 20, "temperature": 0,
     "repetition_penalty": 1.3, "frequency_penalty": 0.5},
    # Ends early on a stop string: the overlapped engine learns it one step late.
    {"prompt": "Count: 1, 2, 3,", "max_tokens": 30, "temperature": 0, "stop": [" 7"]},
    {"prompt": "The capital of France is", "max_tokens": 1, "temperature": 0},
]


def answers(server: Server) -> list[tuple[str, str, int]]:
    def one(body: dict) -> tuple[str, str, int]:
        r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
        r.raise_for_status()
        out = r.json()
        choice = out["choices"][0]
        return choice["text"], choice["finish_reason"], out["usage"]["completion_tokens"]

    with ThreadPoolExecutor(len(REQUESTS)) as pool:
        return list(pool.map(one, REQUESTS))


def test_overlap_flag_is_reported(server: Server, serial_server: Server) -> None:
    assert server.info()["disable_overlap_schedule"] is False
    assert serial_server.info()["disable_overlap_schedule"] is True


def test_overlapped_and_serial_engines_answer_the_same(server: Server,
                                                       serial_server: Server) -> None:
    overlapped, serial = answers(server), answers(serial_server)
    assert overlapped == serial
    text, reason, _ = overlapped[-2]
    assert reason == "stop" and " 7" not in text
    assert [a[1] for a in overlapped[:6]] == ["length"] * 6
    assert all(a[2] == 24 for a in overlapped[:6])
