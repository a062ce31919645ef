"""The hierarchical cache (--enable-hierarchical-cache) end to end: a device KV pool of 64 pages,
a working set of prompts about 4x larger asked twice. With the host tier the second round finds
its prefixes in host memory (reported by /get_server_info and /metrics) and the greedy tokens
are those of a server without it; off (the default), no host pool and no copies. With a host
tier as small as the device pool and a local-file storage tier below it, the second round finds
them in storage, with the same tokens."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from server_harness import Server, flushed_pages, start_server, stop_server

# 16 pages of 4 tokens; each prompt 29 tokens (7 full pages), 9 distinct ones: ~4x the pool.
SMALL_POOL = ["--max-total-tokens", "64", "--page-size", "4", "--context-length", "48",
              "--enable-metrics"]
PROMPTS = [f"Story {i}: " + " ".join(f"word{i}x{j}" for j in range(6)) for i in range(9)]
POOL, RATIO = 16, 8


def _server(tmp_path_factory: pytest.TempPathFactory, *extra: str) -> Iterator[Server]:
    server = start_server(str(tmp_path_factory.mktemp("hicache")), *SMALL_POOL, *extra)
    yield server
    stop_server(server)


@pytest.fixture(scope="module")
def hicache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from _server(tmp_path_factory, "--enable-hierarchical-cache", "--hicache-ratio", str(RATIO))


@pytest.fixture(scope="module")
def storage_dir(tmp_path_factory: pytest.TempPathFactory):
    return tmp_path_factory.mktemp("kv-storage")


@pytest.fixture(scope="module")
def storage(tmp_path_factory: pytest.TempPathFactory, storage_dir) -> Iterator[Server]:
    extra = json.dumps({"path": str(storage_dir), "capacity_gb": 0.5})
    yield from _server(tmp_path_factory, "--enable-hierarchical-cache", "--hicache-ratio", "1",
                       "--hicache-storage-backend", "file",
                       "--hicache-storage-backend-extra-config", extra)


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from _server(tmp_path_factory)


def _round(server: Server) -> list[str]:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0,
                           timeout=120)
    model = client.models.list().data[0].id
    return [client.completions.create(model=model, prompt=p, max_tokens=3, temperature=0)
            .choices[0].text for p in PROMPTS]


def _host(server: Server) -> dict:
    return server.info()["host_kv_pages"]


def _metric(server: Server, name: str) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    m = re.search(rf"^tokenspeed:{name}(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE)
    assert m, f"{name} not in /metrics"
    return float(m.group(1))


def test_second_round_hits_the_host_tier_with_the_same_tokens(hicache: Server,
                                                              plain: Server) -> None:
    assert _host(hicache)["total"] == RATIO * POOL
    first = _round(hicache)
    after_first = _host(hicache)
    assert after_first["writeback_pages"] > 0 and after_first["used"] > 0, after_first
    second = _round(hicache)
    host = _host(hicache)
    # Most prompts' prefixes were evicted from the device pool by the ones after them.
    assert host["hit_tokens"] >= 4 * 24, host
    assert host["load_pages"] * 4 == host["hit_tokens"], host
    assert _metric(hicache, "host_hit_tokens_total") == host["hit_tokens"]
    assert _metric(hicache, "host_kv_pages") == RATIO * POOL
    reference = _round(plain)
    assert first == second == reference
    assert all(t for t in reference)
    # Idle and flushed, both tiers are empty again: no page leaked in either.
    kv = flushed_pages(hicache)
    assert kv["free"] == kv["total"], kv
    assert _host(hicache)["used"] == 0


def test_off_by_default_no_host_pool_and_no_copies(plain: Server) -> None:
    _round(plain)  # the working set again: evictions, and prefix hits on what is left
    host = _host(plain)
    assert host == {"total": 0, "used": 0, "hit_tokens": 0, "load_pages": 0,
                    "writeback_pages": 0}, host
    assert _metric(plain, "host_kv_pages") == 0


def test_hicache_without_the_radix_cache_is_refused_at_start() -> None:
    r = subprocess.run([sys.executable, "-m", "tokenspeed.launch.cli", "serve", "--device", "cpu",
                        "--enable-hierarchical-cache", "--disable-radix-cache"],
                       check=False, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "cannot be combined with --disable-radix-cache" in r.stderr, r.stderr


def test_what_the_host_tier_drops_comes_back_from_local_files(storage: Server, plain: Server,
                                                              storage_dir) -> None:
    first = _round(storage)
    stored = storage.info()["storage_kv_pages"]
    # Device and host hold 32 pages of the 63 the prompts need: the rest went to storage.
    assert stored["store_pages"] > 0 and stored["used_pages"] > 0, stored
    # Stores and drops are written by the backend's threads, off the step: wait for them.
    deadline = time.monotonic() + 30
    while (files := len(list(storage_dir.rglob("*.kv")))) != stored["used_pages"] \
            and time.monotonic() < deadline:
        time.sleep(0.05)
    assert files == stored["used_pages"], (files, stored)
    second = _round(storage)
    stored = storage.info()["storage_kv_pages"]
    assert stored["hit_tokens"] >= 4 * 24 and stored["fetch_pages"] * 4 == stored["hit_tokens"], stored
    assert _metric(storage, "storage_hit_tokens_total") == stored["hit_tokens"]
    assert _metric(storage, "storage_kv_pages_used") == stored["used_pages"]
    assert first == second == _round(plain)
    kv = flushed_pages(storage)
    assert kv["free"] == kv["total"], kv


def test_storage_is_refused_without_the_host_tier_and_for_backends_not_built() -> None:
    for args, says in ((["--hicache-storage-backend", "file"], "needs --enable-hierarchical-cache"),
                       (["--enable-hierarchical-cache", "--hicache-storage-backend", "mooncake"],
                        "only the local-file storage backend is built")):
        r = subprocess.run([sys.executable, "-m", "tokenspeed.launch.cli", "serve", "--device", "cpu",
                            *args], check=False, capture_output=True, text=True, timeout=120)
        assert r.returncode != 0 and says in r.stderr, r.stderr
