"""SGLang's router (`sglang-router` from PyPI, unchanged) in front of two `tokenspeed serve`
workers: it discovers them (/health, /server_info, /model_info), answers chat and completions
through them with the real openai client, and its cache-aware policy sends requests sharing a
prefix to one worker, whose radix cache then serves that prefix."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from server_harness import Server, free_port, start_server, stop_server

pytestmark = pytest.mark.slow  # two servers and a router: ~60 s on a 2-core machine

WORKER_FLAGS = ("--max-total-tokens", "2048", "--max-running-requests", "8")


def _routed(srv: Server) -> int:
    return sum(r["routed"] for r in srv.info()["replicas"])


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, list[Server]]]:
    tmp = str(tmp_path_factory.mktemp("fleet"))
    with ThreadPoolExecutor(2) as pool:
        starts = [pool.submit(start_server, tmp, *WORKER_FLAGS) for _ in range(2)]
        workers = [f.result() for f in starts]
    port = free_port()
    log_path = Path(tmp) / "router.log"
    cmd = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
           "--port", str(port), "--prometheus-port", str(free_port()), "--policy", "cache_aware",
           "--log-level", "warn", "--worker-urls", *(w.url for w in workers)]
    with open(log_path, "w") as log:
        router = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_for_workers(url, router, log_path)
        yield url, workers
    finally:
        router.terminate()
        try:
            router.wait(timeout=20)
        except subprocess.TimeoutExpired:
            router.kill()
        for w in workers:
            stop_server(w)


def _wait_for_workers(url: str, router: subprocess.Popen, log_path: Path) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if router.poll() is not None:
            raise RuntimeError(f"router exited {router.returncode}:\n{log_path.read_text()}")
        try:
            models = httpx.get(f"{url}/v1/models", timeout=2).json()["data"]
            if models and httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except (httpx.HTTPError, KeyError, ValueError):
            pass
        time.sleep(0.5)
    raise RuntimeError(f"router never saw its workers:\n{log_path.read_text()}")


def test_router_discovers_the_workers_model(fleet: tuple[str, list[Server]]) -> None:
    url, workers = fleet
    served = workers[0].info()["served_model_name"]
    assert [m["id"] for m in httpx.get(f"{url}/v1/models", timeout=10).json()["data"]] == [served]


def test_router_answers_chat_completions_and_streams(fleet: tuple[str, list[Server]]) -> None:
    url, workers = fleet
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    model = workers[0].info()["served_model_name"]
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Say hello."}], max_tokens=8, temperature=0)
    assert chat.choices[0].message.content and chat.usage.completion_tokens > 0
    completion = client.completions.create(model=model, prompt="The capital of France is",
                                           max_tokens=6, temperature=0)
    direct = openai.OpenAI(base_url=f"{workers[0].url}/v1", api_key="unused", max_retries=0)
    same = direct.completions.create(model=model, prompt="The capital of France is", max_tokens=6,
                                     temperature=0)
    assert completion.choices[0].text == same.choices[0].text  # greedy: the same tokens
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Count to three."}], max_tokens=8,
        temperature=0, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text


def _send(client: openai.OpenAI, model: str, prompt: str) -> None:
    client.completions.create(model=model, prompt=prompt, max_tokens=2, temperature=0)


def test_cache_aware_policy_keeps_a_prefix_on_one_worker(fleet: tuple[str, list[Server]]) -> None:
    url, workers = fleet
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    model = workers[0].info()["served_model_name"]
    shared = {
        "a": "You are a meticulous assistant for a shipping company. Policies: " + "ports, " * 20,
        "b": "Translate the following passages from German into English. Glossary: " + "Haus, " * 20,
    }
    went: dict[str, list[int]] = {}
    for key, prefix in shared.items():
        before = [_routed(w) for w in workers]
        for i in range(3):
            _send(client, model, f"{prefix} Question {i}: what now?")
        went[key] = [_routed(w) - b for w, b in zip(workers, before, strict=True)]
    # Each prefix stayed on one worker (which one the policy picks for an unseen prefix
    # depends on the workers' load and tree sizes).
    assert sorted(went["a"]) == [0, 3] and sorted(went["b"]) == [0, 3], went


def test_cache_aware_routing_hits_the_workers_prefix_cache(fleet: tuple[str, list[Server]]) -> None:
    """The point of the policy: a repeated prefix is served from that worker's radix cache."""
    url, workers = fleet
    model = workers[0].info()["served_model_name"]
    prefix = "Summarize the incident report below in one line. Report: " + "disk full; " * 40
    before = [w.info()["engine"]["prefix_cache_hits"] for w in workers]
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    usages = [client.completions.create(model=model, prompt=f"{prefix} Case {i}.", max_tokens=2,
                                        temperature=0).usage for i in range(3)]
    hits = [w.info()["engine"]["prefix_cache_hits"] - b for w, b in zip(workers, before, strict=True)]
    assert min(hits) == 0 and max(hits) >= 2, hits
    assert all(u.prompt_tokens > 100 for u in usages)

