"""Sending a benchmark's requests: the clients, every request at its arrival, and a probe of
the sending event loop's own lateness. One process runs it (`bench serve`), or each of
--num-client-processes workers (bench/procs.py) runs it on its share of the requests."""

from __future__ import annotations

import argparse
import asyncio
import gc
import math
import ssl
import sys
import time
from collections.abc import Awaitable, Callable

import httpx
import numpy as np

from tokenspeed.bench.client import build_payload, send
from tokenspeed.bench.datasets import BenchRequest
from tokenspeed.bench.metrics import RequestResult

CONNS_PER_CLIENT = 32


class LoopLag:
    """How late the client's own event loop wakes during the run: a task that sleeps `period`
    and records by how much it overslept. Every stream's tokens wait in their sockets while
    the loop is busy, so a client-side inter-token gap as long as the loop's lateness was made
    by the client (one Python process parsing ~50k SSE events a second in S1), not the server."""

    def __init__(self, period: float = 0.005) -> None:
        self.period = period
        self.lags: list[float] = []

    async def run(self) -> None:
        while True:
            t = time.perf_counter()
            await asyncio.sleep(self.period)
            self.lags.append(time.perf_counter() - t - self.period)

    def summary(self, over_s: float = 0.1) -> dict | None:
        if not self.lags:
            return None
        a = np.asarray(self.lags)
        return {"max_ms": float(a.max() * 1e3), "p99_ms": float(np.percentile(a, 99) * 1e3),
                f"over_{int(over_s * 1e3)}ms": int((a > over_s).sum()), "samples": len(a)}


def payload_fn(args: argparse.Namespace, model: str | None,
               ignore_eos: bool) -> Callable[[BenchRequest], tuple[str, dict]]:
    def payload(r: BenchRequest) -> tuple[str, dict]:
        return build_payload(args.backend, model, r, ignore_eos=ignore_eos,
                             temperature=args.temperature, extra=args.extra_body)
    return payload


def open_clients(args: argparse.Namespace, num_requests: int) -> list[httpx.AsyncClient]:
    """httpx's pool scans all its connections on every request and release (O(n^2) at high
    concurrency), so requests are spread over clients of <= ~CONNS_PER_CLIENT connections each."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(args.request_timeout, connect=60)
    in_flight = min(num_requests, args.max_concurrency or num_requests)
    ssl_ctx = ssl.create_default_context()
    return [httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False, verify=ssl_ctx)
            for _ in range(max(1, math.ceil(in_flight / CONNS_PER_CLIENT)))]


async def send_all(args: argparse.Namespace, reqs: list[BenchRequest],
                    clients: list[httpx.AsyncClient], payload: Callable[[BenchRequest], tuple[str, dict]],
                    offsets: np.ndarray | list[float], start: float | None = None) -> list[RequestResult]:
    """Every request at `start` (a perf_counter time; default now) + its arrival offset, at most
    --max-concurrency at once."""
    sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    results = [RequestResult(r.prompt_len, r.output_len) for r in reqs]
    bar = None
    if not args.disable_tqdm:
        from tqdm import tqdm

        bar = tqdm(total=len(reqs), desc="requests", file=sys.stderr)
    # The client's own garbage collector pauses every stream at once, and the metrics would
    # count the pause as the server's inter-token gap (S1 holds ~1,000 streams): collected
    # before the run, frozen, and off until it ends (reference cycles wait till then).
    gc.collect()
    gc.freeze()
    gc.disable()
    t0 = time.perf_counter() if start is None else start

    async def one(i: int) -> None:
        delay = t0 + float(offsets[i]) - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        path, body = payload(reqs[i])
        c = clients[i % len(clients)]
        if sem is None:
            await send(c, args.base_url, args.backend, path, body, results[i])
        else:
            async with sem:
                await send(c, args.base_url, args.backend, path, body, results[i])
        if bar is not None:
            bar.update(1)

    try:
        await start_all(one, len(reqs), args.stagger_starts)
    finally:
        gc.enable()
        gc.unfreeze()
    if bar is not None:
        bar.close()
    return results


async def start_all(one: Callable[[int], Awaitable[None]], n: int, stagger: bool) -> None:
    """Start request 0..n-1's tasks and wait for all of them."""
    if not stagger:
        # Every task created before any runs (sglang.bench_serving, vllm bench serve):
        # all requests are due at t=0 and none waits for the client to start the others.
        await asyncio.gather(*[asyncio.ensure_future(one(i)) for i in range(n)])
        return
    # --stagger-starts: one task at a time, the event loop polling its sockets between
    # starts. Started all at once (S1 sends 2,000 at t=0), every task's first steps (~1 ms
    # of Python each) run back to back before the loop reads any stream, and the first
    # streams' tokens wait ~0.2 s in the socket: a client-made gap that the metrics count
    # as the server's inter-token latency (session 14).
    tasks = []
    for i in range(n):
        tasks.append(asyncio.ensure_future(one(i)))
        await asyncio.sleep(0)
    await asyncio.gather(*tasks)
