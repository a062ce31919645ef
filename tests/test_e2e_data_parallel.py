"""Data parallelism end to end (`--dp-size 2`): two replicas, each its own engine thread and
worker, behind the Rust server's router. Two replicas answer 64 concurrent greedy requests
exactly like one; round_robin spreads requests over both; cache_aware sends a repeated long
system prompt to the replica whose radix cache holds it; a disconnect frees the owner's slot."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import httpx
import openai
import pytest

from server_harness import Server, pid_alive, shm_segments, start_server, stop_server, wait_exit
from tokenspeed.launch.serve import LaunchError, data_parallel_size

# The session `server` fixture's flags (tests/conftest.py): the one-replica reference.
FLAGS = ("--page-size", "4", "--max-running-requests", "32", "--max-total-tokens", "16384",
         "--enable-metrics")


@pytest.fixture(scope="module")
def dp_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """Two replicas, the default method (round_robin)."""
    srv = start_server(str(tmp_path_factory.mktemp("dp2")), *FLAGS, "--dp", "2")
    try:
        yield srv
    finally:
        stop_server(srv)


@pytest.fixture(scope="module")
def cache_aware_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = start_server(str(tmp_path_factory.mktemp("dp2ca")), *FLAGS, "--data-parallel-size", "2",
                       "--load-balance-method", "cache_aware")
    try:
        yield srv
    finally:
        stop_server(srv)


def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300)


def model(c: openai.OpenAI) -> str:
    return c.models.list().data[0].id


PROMPTS = [f"Q{i}: name {i % 7 + 2} colors and {i % 5 + 1} animals:" for i in range(64)]


def greedy_answers(server: Server) -> list[tuple[str, str]]:
    c = client(server)
    name = model(c)

    def one(prompt: str) -> tuple[str, str]:
        out = c.completions.create(model=name, prompt=prompt, max_tokens=6, temperature=0)
        return out.choices[0].text, out.choices[0].finish_reason

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        return list(pool.map(one, PROMPTS))


def routed(server: Server) -> list[int]:
    return [r["routed"] for r in server.info()["replicas"]]


def wait_idle(server: Server, timeout_s: float = 30) -> dict:
    """Server info once no replica has a request running or queued."""
    deadline = time.monotonic() + timeout_s
    while True:
        info = server.info()
        if all(r["running"] == 0 and r["queued"] == 0 and r["outstanding"] == 0
               for r in info["replicas"]):
            return info
        if time.monotonic() > deadline:
            raise AssertionError(f"replicas still busy after {timeout_s}s: {info['replicas']}")
        time.sleep(0.1)


def test_two_replicas_are_reported(dp_server: Server) -> None:
    info = dp_server.info()
    assert info["dp_size"] == 2 and info["load_balance_method"] == "round_robin"
    assert [r["dp_rank"] for r in info["replicas"]] == [0, 1]
    assert all(r["healthy"] for r in info["replicas"])
    # The warm-up probed each replica: each has run steps of its own.
    assert all(r["steps"] > 0 for r in info["replicas"])
    assert info["engine"]["total_pages"] == 2 * info["num_pages"]


def test_two_replicas_answer_exactly_like_one(server: Server, dp_server: Server) -> None:
    before = routed(dp_server)
    two = greedy_answers(dp_server)
    one = greedy_answers(server)
    assert two == one
    assert len({text for text, _ in one}) > 8  # the prompts really differ
    # round_robin: the 64 requests split evenly.
    after = routed(dp_server)
    assert [a - b for a, b in zip(after, before)] == [32, 32]


def test_round_robin_spreads_a_repeated_prompt_over_both(dp_server: Server) -> None:
    c = client(dp_server)
    before = routed(dp_server)
    for _ in range(4):
        c.completions.create(model=model(c), prompt=SYSTEM + " Hi.", max_tokens=1, temperature=0)
    assert [a - b for a, b in zip(routed(dp_server), before)] == [2, 2]


# ~260 tokens of system prompt, then a short question: the cached prefix is most of the prompt.
SYSTEM = ("You are a meticulous assistant for a botanical garden. Answer questions about plants, "
          "their care, watering schedules, soil types, sunlight needs and pests. ") * 8


def test_cache_aware_sends_a_repeated_system_prompt_to_the_replica_holding_it(
        cache_aware_server: Server) -> None:
    c = client(cache_aware_server)

    def ask(question: str) -> None:
        c.chat.completions.create(model=model(c), max_tokens=2, temperature=0, messages=[
            {"role": "system", "content": SYSTEM}, {"role": "user", "content": question}])

    info = wait_idle(cache_aware_server)
    assert info["load_balance_method"] == "cache_aware"
    start = info["replicas"]
    ask("How often should I water a fern?")
    first = wait_idle(cache_aware_server)["replicas"]
    holder = next(r for r in range(2) if first[r]["routed"] > start[r]["routed"])
    other = 1 - holder
    questions = ["Which soil suits cacti?", "Do orchids need direct sun?", "What eats basil?",
                 "When do I repot a palm?"]
    for q in questions:
        ask(q)
    end = wait_idle(cache_aware_server)["replicas"]
    assert end[holder]["routed"] - first[holder]["routed"] == len(questions)
    assert end[other]["routed"] == first[other]["routed"]
    # The holder served the system prompt from its cache each time (over 200 tokens a time).
    hits = end[holder]["cached_tokens"] - first[holder]["cached_tokens"]
    assert hits >= 200 * len(questions), (first, end)
    assert end[other]["cached_tokens"] == first[other]["cached_tokens"]


def test_cache_aware_spreads_unrelated_prompts(cache_aware_server: Server) -> None:
    c = client(cache_aware_server)
    before = routed(cache_aware_server)
    for i in range(4):  # nothing cached to follow: the least loaded, ties taken in turn
        c.completions.create(model=model(c), prompt=f"Unrelated {i} {'xyz ' * i}", max_tokens=1)
    assert [a - b for a, b in zip(routed(cache_aware_server), before)] == [2, 2]


def test_a_disconnect_frees_the_owning_replica(dp_server: Server) -> None:
    wait_idle(dp_server)
    body = {"prompt": "Tell me a very long story about", "max_tokens": 1500, "temperature": 0,
            "ignore_eos": True, "stream": True}
    for _ in range(2):  # one per replica
        with httpx.stream("POST", f"{dp_server.url}/v1/completions", json=body, timeout=60) as r:
            next(r.iter_lines())
    # Each abort must reach the replica running the request; a stray one would leave it
    # generating 1500 tokens.
    info = wait_idle(dp_server, timeout_s=10)
    assert all(r["free_pages"] + r["cached_pages"] == info["num_pages"] for r in info["replicas"])


def test_metrics_sum_the_replicas_pools(dp_server: Server) -> None:
    info = wait_idle(dp_server)
    text = httpx.get(f"{dp_server.url}/metrics", timeout=10).text
    free = next(float(line.split()[-1]) for line in text.splitlines()
                if line.startswith("tokenspeed:free_kv_pages"))
    assert free == sum(r["free_pages"] for r in info["replicas"])


def test_a_dead_worker_in_one_replica_fails_health_and_stops_the_server(dp_server: Server) -> None:
    """Last in the module: it ends `dp_server`."""
    pids = dp_server.info()["worker_pids"]
    assert len(pids) == 2  # one rank per replica, replica 0's first
    os.kill(pids[1], signal.SIGKILL)
    deadline = time.monotonic() + 2
    while httpx.get(f"{dp_server.url}/health", timeout=1).status_code == 200:
        assert time.monotonic() < deadline, "/health still 200 two seconds after a replica died"
        time.sleep(0.05)
    code = wait_exit(dp_server, 30)
    assert code not in (None, 0), f"exit code {code}\n{dp_server.log()[-3000:]}"
    log = dp_server.log()
    assert "data-parallel replica 1" in log, log[-3000:]
    deadline = time.monotonic() + 10
    while pid_alive(pids[0]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not pid_alive(pids[0]), "replica 0's worker outlived the server"
    assert shm_segments(dp_server) == []  # both replicas' channels unlinked


def test_data_parallel_across_nodes_is_refused_naming_both_values() -> None:
    with pytest.raises(LaunchError, match="--dp-size 2 with --nnodes 2"):
        data_parallel_size(SimpleNamespace(dp_size=2), 2)
    assert data_parallel_size(SimpleNamespace(dp_size=2), 1) == 2
