"""`bench serve --num-client-processes N`: the measured requests sent from N processes.

One Python process with one event loop cannot read S1's ~50k SSE events a second in time: on an
H100 its loop woke up to 1.8 s late (sender.LoopLag) while the engine's own inter-token gaps stayed
under 300 ms, so the client's max ITL was the client's. Here the request list (built once, in the
parent, with its seeds) is dealt round-robin to N spawned workers, request i to worker i % N, each
with its own event loop and httpx clients. They start at one shared instant, each request at its
own Poisson offset from it (the offsets drawn once over the whole list, as with one process), and
the parent puts result i back at index i, so the metrics are computed over the same list as ever.

Clock: the workers' timestamps (send, chunks, end) are time.perf_counter(), which on Linux is
clock_gettime(CLOCK_MONOTONIC): one clock for every process of the machine, so they compare
across processes. Each worker reports its clock when ready and the parent checks that it lies
between the worker's spawn and its ready message (`ClientProcesses._wait_ready`); any other clock
fails the run instead of skewing it.

Warm-up, the cache flush and the server counter reads stay in the parent, around `run`.

The workers are `python -m tokenspeed.bench.procs FD`, talking over a socketpair (fd FD), rather
than multiprocessing's spawn: spawn re-imports the caller's __main__, which breaks any script
that runs `bench serve` in-process without an `if __name__ == "__main__"` guard.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp  # Pipe: a socketpair of pickling Connections
import os
import subprocess
import sys
import time
import traceback
from multiprocessing.connection import Connection
from pathlib import Path

from tokenspeed.bench.datasets import BenchRequest
from tokenspeed.bench.metrics import RequestResult
from tokenspeed.bench.sender import LoopLag, open_clients, payload_fn, send_all

MAX_AUTO = 8
START_MARGIN_S = 0.05  # from the parent's "go" to the shared start: the pipes' latency, with room
READY_TIMEOUT_S = 120.0


def num_processes(value: str) -> int:
    """--num-client-processes: a count >= 1, or `auto` = min(8, CPU count)."""
    if value == "auto":
        return max(1, min(MAX_AUTO, os.cpu_count() or 1))
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1 or 'auto', got {value!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1 or 'auto', got {value!r}")
    return n


def split(n_items: int, n_parts: int) -> list[list[int]]:
    """Round-robin: part k holds the indices k, k + n_parts, k + 2 n_parts, ..."""
    return [list(range(k, n_items, n_parts)) for k in range(n_parts)]


def merge(parts: list[list[int]], results: list[list[RequestResult]], n_items: int) -> list[RequestResult]:
    """The parts' results back in request order: result i is request i's."""
    out: list[RequestResult | None] = [None] * n_items
    for idx, res in zip(parts, results, strict=True):
        if len(idx) != len(res):
            raise RuntimeError(f"a client process returned {len(res)} results for {len(idx)} requests")
        for i, r in zip(idx, res, strict=True):
            out[i] = r
    missing = [i for i, r in enumerate(out) if r is None]
    if missing:
        raise RuntimeError(f"no result for requests {missing[:5]}")
    return out  # type: ignore[return-value]


class ClientProcesses:
    """N worker processes, each holding its share of the requests, ready to send at `run`."""

    def __init__(self, args: argparse.Namespace, reqs: list[BenchRequest], offsets: list[float],
                 model: str | None, ignore_eos: bool, n: int) -> None:
        if args.max_concurrency:
            raise SystemExit("tokenspeed bench: --max-concurrency is a global cap and cannot be split over "
                             "client processes; use it with --num-client-processes 1")
        self.n_items = len(reqs)
        self.parts = [p for p in split(len(reqs), n) if p]
        self.conns: list[Connection] = []
        self.procs: list[subprocess.Popen] = []
        spawned_at = time.perf_counter()
        pkg_root = str(Path(__file__).resolve().parents[2])  # the dir holding this tokenspeed package
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([pkg_root, *filter(None, [os.environ.get("PYTHONPATH")])])}
        try:
            for idx in self.parts:
                here, there = mp.Pipe()
                self.procs.append(subprocess.Popen(
                    [sys.executable, "-m", "tokenspeed.bench.procs", str(there.fileno())],
                    pass_fds=[there.fileno()], env=env, stdin=subprocess.DEVNULL))
                there.close()
                self.conns.append(here)
            for idx, conn in zip(self.parts, self.conns, strict=True):  # once all are starting up
                conn.send((args, [reqs[i] for i in idx], [offsets[i] for i in idx], model, ignore_eos))
            self._wait_ready(spawned_at)
        except BaseException:
            self.close()
            raise

    def _recv(self, k: int, timeout: float | None = None) -> tuple:
        conn, proc = self.conns[k], self.procs[k]
        deadline = None if timeout is None else time.monotonic() + timeout
        while not conn.poll(0.5):
            if proc.poll() is not None:
                raise SystemExit(f"tokenspeed bench: client process {k} died (exit code {proc.returncode})")
            if deadline is not None and time.monotonic() > deadline:
                raise SystemExit(f"tokenspeed bench: client process {k} not ready after {timeout:.0f} s")
        try:
            msg = conn.recv()
        except EOFError:
            raise SystemExit(f"tokenspeed bench: client process {k} closed its pipe") from None
        if msg[0] == "error":
            raise SystemExit(f"tokenspeed bench: client process {k} failed:\n{msg[1]}")
        return msg

    def _wait_ready(self, spawned_at: float) -> None:
        for k in range(len(self.procs)):
            _, their_clock = self._recv(k, READY_TIMEOUT_S)
            now = time.perf_counter()
            if not spawned_at <= their_clock <= now:
                raise SystemExit("tokenspeed bench: the client processes do not share time.perf_counter's "
                                 f"clock (a worker read {their_clock:.3f} between the parent's {spawned_at:.3f} "
                                 f"and {now:.3f}); use --num-client-processes 1")

    def run(self) -> tuple[list[RequestResult], list[float]]:
        """Every worker sends its requests from one shared start; returns the results in request
        order and the event-loop lateness samples of all workers (sender.LoopLag)."""
        start = time.perf_counter() + START_MARGIN_S
        for conn in self.conns:
            conn.send(("go", start))
        results, lags = [], []
        for k in range(len(self.procs)):
            _, res, lag = self._recv(k)
            results.append(res)
            lags.extend(lag)
        return merge(self.parts, results, self.n_items), lags

    def close(self) -> None:
        for conn in self.conns:
            conn.close()
        for p in self.procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                p.terminate()
                p.wait()


def _worker(conn: Connection) -> None:
    try:
        asyncio.run(_worker_run(conn, *conn.recv()))
    except BaseException:  # noqa: BLE001 - reported to the parent, which fails the run
        try:
            conn.send(("error", traceback.format_exc()))
        except OSError:
            pass
    finally:
        conn.close()


async def _worker_run(conn: Connection, args: argparse.Namespace, reqs: list[BenchRequest],
                      offsets: list[float], model: str | None, ignore_eos: bool) -> None:
    """One worker: open the clients, say ready (with this process's clock), wait for the shared
    start, send every request at start + its offset, return the results and the loop's lateness."""
    import contextlib

    args.disable_tqdm = True  # N bars on one terminal; the parent prints the totals
    clients = open_clients(args, len(reqs))
    async with contextlib.AsyncExitStack() as stack:
        for c in clients:
            await stack.enter_async_context(c)
        conn.send(("ready", time.perf_counter()))
        _, start = await asyncio.to_thread(conn.recv)
        lag = LoopLag()
        await asyncio.sleep(max(0.0, start - time.perf_counter()))
        probe = asyncio.ensure_future(lag.run())
        try:
            results = await send_all(args, reqs, clients, payload_fn(args, model, ignore_eos),
                                            offsets=offsets, start=start)
        finally:
            probe.cancel()
    conn.send(("done", results, lag.lags))


if __name__ == "__main__":
    _worker(Connection(int(sys.argv[1])))
