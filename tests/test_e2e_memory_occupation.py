"""/release_memory_occupation and /resume_memory_occupation end to end (SGLang's sleep and wake):
release frees the worker's weights and KV cache (its resident memory drops by the KV pool's
size), a request sent while released waits in the queue, and after the resume it and
every later request get the same greedy tokens as before the release."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from server_harness import Server, start_server, stop_server

pytestmark = pytest.mark.slow  # one server, a release and a resume on CPU: ~20-40 s

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = start_server(str(tmp_path_factory.mktemp("memory")))
    yield server
    stop_server(server)


def _complete(srv: Server) -> str:
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=120)
    out = client.completions.create(model=srv.info()["served_model_name"], prompt=PROMPT,
                                    max_tokens=8, temperature=0)
    return out.choices[0].text


def _worker_rss_mib(srv: Server) -> float:
    """Resident memory of the server's worker process: its largest child (the others are
    multiprocessing's resource tracker)."""
    sizes = []
    for child in Path(f"/proc/{srv.proc.pid}/task").glob("*/children"):
        for pid in child.read_text().split():
            status = Path(f"/proc/{pid}/status").read_text()
            rss = next(line for line in status.splitlines() if line.startswith("VmRSS"))
            sizes.append(int(rss.split()[1]) / 1024)
    assert sizes, "no worker process found"
    return max(sizes)


def test_release_frees_memory_and_resume_serves_the_same_tokens(srv: Server) -> None:
    before = _complete(srv)
    rss = _worker_rss_mib(srv)
    r = httpx.post(f"{srv.url}/release_memory_occupation", json={}, timeout=120)
    assert r.status_code == 200 and r.json()["success"] is True, r.text
    # On the CPU the weights' host copy takes what their storage gave back; the KV pool (16,384
    # tokens x 30 layers x K and V x 3 heads x 64 x fp32: 720 MiB) is freed.
    assert _worker_rss_mib(srv) < rss - 400, (rss, _worker_rss_mib(srv))
    again = httpx.post(f"{srv.url}/release_memory_occupation", timeout=30)
    assert again.status_code == 400 and again.json()["success"] is False, again.text
    waiting: dict[str, str] = {}
    t = threading.Thread(target=lambda: waiting.update(text=_complete(srv)))
    t.start()
    time.sleep(2)
    assert t.is_alive() and "text" not in waiting, "it waits in the queue"
    r = httpx.post(f"{srv.url}/resume_memory_occupation", timeout=120)
    assert r.status_code == 200 and r.json()["success"] is True, r.text
    t.join(120)
    assert waiting["text"] == before
    assert _complete(srv) == before
    no = httpx.post(f"{srv.url}/resume_memory_occupation", timeout=30)
    assert no.status_code == 400 and no.json()["success"] is False, no.text


def test_partial_tags_are_refused(srv: Server) -> None:
    r = httpx.post(f"{srv.url}/release_memory_occupation", json={"tags": ["kv_cache"]}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tags", r.text
    r = httpx.post(f"{srv.url}/release_memory_occupation", json={"tags": ["gpu"]}, timeout=30)
    assert r.status_code == 400, r.text
    assert _complete(srv)  # still serving
