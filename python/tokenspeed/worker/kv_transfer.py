"""Prefill/decode disaggregation: a request's prompt KV moving from a prefill server's worker
to a decode server's (`--disaggregation-mode`, docs/parallelism.md).

The scheduler decides what moves (rust/engine: `KvTransfer`, `copy_kind::KV_SEND` /
`KV_RECV`): the prefill server's plan that computes a prompt's last chunk lists its full pages,
sent after the forward; the decode server's plan that admits the request lists fresh pages to
receive them into, before the forward. Here they travel over torch.distributed (NCCL between
GPUs, gloo on the CPU), rank r of the prefill server to rank r of the decode server (each TP
rank holds its own heads), in one process group of two per rank pair that meets at the prefill
server's bootstrap port (a TCPStore its rank 0 hosts).

Both servers start on their own: the pair connects in a background thread. Transfers are
ordered: the sender writes a header (room, pages) under the next sequence number in the store,
then sends the pages; the receiver reads the headers in order and receives each transfer whole
into a buffer kept by room, where the decode worker's step takes it. The first rank reports
each room that arrived in its step results (`ArrivalReports`); the decode server admits the
request only then, so that rank never waits, and another rank waits in its step at most `WAIT_S`
for a transfer its prefill peer sent alongside. A failure (the peer gone, a layout mismatch, a
missing transfer) fails the requests that needed it, never the worker; a pair that is down is
reported in every result, failing the requests still waiting for their KV.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from tokenspeed.layers.host_copy import to_device_int64
from tokenspeed.layers.kv_cache import PagedKVCache

logger = logging.getLogger(__name__)

KV_SEND, KV_RECV = 6, 7  # rust/engine/src/plan.rs copy_kind
WAIT_S = 30.0  # how long a decode step waits for a transfer it was told to receive
MAX_DOWN_TEXT = 1024  # bytes of why the pair is down, in a result (Rust's bound: MAX_OP_TEXT)
EXPIRE_S = 300.0  # a received transfer no request took is dropped after this
PG_TIMEOUT_S = 120.0  # a transfer whose header arrived but whose pages do not
STATS_EVERY_S = 10.0  # the sender logs its totals this often while it sends
U32_MAX = 2**32 - 1  # a transfer's reported microseconds saturate here (`KvArrival`)


@dataclass(frozen=True)
class PdSettings:
    mode: str  # "prefill" | "decode"
    backend: str  # "nccl" | "gloo"
    host: str
    port: int

    @staticmethod
    def of(settings: dict[str, Any]) -> PdSettings | None:
        """The worker's PD settings from its flags; None on a combined server."""
        mode = settings["disaggregation_mode"]
        if mode in (None, "null"):
            return None
        return PdSettings(mode, settings["disaggregation_transfer_backend"],
                          settings["disaggregation_bootstrap_host"],
                          int(settings["disaggregation_bootstrap_port"]))


def check_disaggregation(cfg: Any, device: str, dp: int, groups: int) -> str | None:
    """Why this launch cannot run its --disaggregation-mode (None: it can)."""
    if cfg.disaggregation_mode in (None, "null"):
        return None
    backend = cfg.disaggregation_transfer_backend
    if dp > 1 or groups > 1 or int(cfg.nnodes or 1) > 1:
        return ("--disaggregation-mode with --dp, data-parallel attention or several nodes is not "
                "supported yet: run one replica per prefill or decode server")
    if cfg.is_embedding:
        return "--disaggregation-mode serves generation; an --is-embedding server has no decode"
    if (backend == "gloo") != (device == "cpu"):
        want = "gloo" if device == "cpu" else "nccl"
        return (f"--disaggregation-transfer-backend {backend} does not run on --device {device}: "
                f"use {want}")
    return None


class KVTransfer:
    """One worker rank's end of its pair: sends (prefill) or receives (decode) page transfers."""

    def __init__(self, settings: PdSettings, kv_cache: PagedKVCache, rank: int, tp: int) -> None:
        if kv_cache.v_from_k:  # its V is a view of K: the pages below would carry it twice
            raise ValueError("--disaggregation-mode is not supported yet for multi-head latent "
                             "attention models (DeepSeek-V2/V3)")
        self.settings = settings
        self.kv = kv_cache
        self.rank, self.tp = rank, tp
        self.device = kv_cache.k[0].device
        self.failed: str | None = None  # why the pair is down, once it is
        self._sends: list[tuple[int, np.ndarray]] = []  # this step's, run after the forward
        self._queue: queue.Queue[tuple[int, torch.Tensor, Any, float]] = queue.Queue()
        self._arrived: dict[int, tuple[torch.Tensor, float]] = {}
        # (room, bytes, microseconds on the wire) of each arrival the results have not reported
        self._unreported: list[tuple[int, int, int]] = []
        self._cond = threading.Condition()
        self.stats = SendStats()
        target = self._send_loop if settings.mode == "prefill" else self._recv_loop
        threading.Thread(target=self._run, args=(target,), name=f"kv-{settings.mode}-{rank}",
                         daemon=True).start()

    # --- the worker's step ------------------------------------------------------------------

    def before_forward(self, src: np.ndarray, dst: np.ndarray, kind: np.ndarray, key: np.ndarray,
                       failed_slots: set[int]) -> tuple[np.ndarray, ...]:
        """Runs the plan's receives (into their pages, before the forward reads them) and keeps
        its sends for `after_forward`; returns the plan's other copies. A receive that fails,
        or a send while the pair is down, adds its slot to `failed_slots` (its request ends
        with an error instead of leaving the decode server waiting)."""
        mine = (kind == KV_SEND) | (kind == KV_RECV)
        if not mine.any():
            return src, dst, kind, key
        for room, rows in _by_room(key, mine):
            if kind[rows[0]] == KV_SEND and self.failed is not None:
                logger.error("KV transfer %#x not sent: %s", room, self.failed)
                failed_slots.add(int(dst[rows[0]]))
            elif kind[rows[0]] == KV_SEND:
                self._sends.append((room, src[rows].astype(np.int64)))
            elif not self._receive(room, dst[rows].astype(np.int64)):
                failed_slots.add(int(src[rows[0]]))
        rest = ~mine
        return src[rest], dst[rest], kind[rest], key[rest]

    def after_forward(self) -> None:
        """Queues this step's sends: each gathers its pages now (queued behind the forward that
        computed them), the sender thread ships them once the copy is done."""
        for room, pages in self._sends:
            buf = self._gather(pages)
            ready = None
            if buf.is_cuda:
                ready = torch.cuda.Event()
                ready.record()
            self._queue.put((room, buf, ready, time.monotonic()))
        self._sends.clear()

    def _gather(self, pages: np.ndarray) -> torch.Tensor:
        idx = to_device_int64([pages], self.device)[0]  # pinned: no wait for the step in flight
        return torch.stack([t[idx] for t in self._tensors()], dim=1)  # [pages, 2 * layers, ...]

    def _receive(self, room: int, pages: np.ndarray) -> bool:
        buf = self._take(room)
        if buf is None or buf.shape[0] != len(pages):
            logger.error("KV transfer %#x: %s", room, self.failed or (
                f"nothing arrived within {WAIT_S:.0f}s" if buf is None else
                f"{buf.shape[0]} pages arrived for {len(pages)}: do both servers run the same "
                "prompt (tokenizer, chat template) and --page-size?"))
            return False
        idx = to_device_int64([pages], self.device)[0]  # pinned: no wait for the step in flight
        for j, t in enumerate(self._tensors()):
            t[idx] = buf[:, j]
        return True

    def _take(self, room: int) -> torch.Tensor | None:
        deadline = time.monotonic() + WAIT_S
        with self._cond:
            while room not in self._arrived and self.failed is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(left)
            got = self._arrived.pop(room, None)
        if got is None:
            return None
        buf = got[0]
        if buf.is_cuda:  # received on the side stream, read on this one
            buf.record_stream(torch.cuda.current_stream(self.device))
        return buf

    def _tensors(self) -> list[torch.Tensor]:
        return [t for pair in zip(self.kv.k, self.kv.v) for t in pair]

    # --- the pair's thread ------------------------------------------------------------------

    def _run(self, loop: Any) -> None:
        try:
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)
            store, pg = self._connect()
            loop(store, pg)
        except Exception as e:  # noqa: BLE001  (the pair is down; requests that need it fail)
            self._fail(f"{type(e).__name__}: {e}")

    def _fail(self, why: str) -> None:
        logger.error("KV transfer pair (rank %d, %s) is down: %s", self.rank, self.settings.mode,
                     why)
        with self._cond:
            self.failed = why
            self._cond.notify_all()

    def _connect(self) -> tuple[dist.Store, Any]:
        s = self.settings
        timeout = datetime.timedelta(seconds=PG_TIMEOUT_S)
        prefill = s.mode == "prefill"
        # An idle pair waits on the store for the next transfer's header for as long as it takes;
        # a peer that dies closes its end, which fails the wait at once.
        store = dist.TCPStore(s.host, s.port, None, is_master=prefill and self.rank == 0,
                              timeout=datetime.timedelta(days=365), wait_for_workers=False)
        pair = dist.PrefixStore(f"pair{self.rank}/", store)
        layout = json.dumps({"tp": self.tp, "pages": [list(t.shape[1:]) for t in self._tensors()],
                             "dtype": str(self.kv.k[0].dtype)})
        pair.set(f"layout/{s.mode}", layout)
        peer = json.loads(pair.get("layout/" + ("decode" if prefill else "prefill")))
        if peer != json.loads(layout):
            raise RuntimeError(f"the two servers' KV layouts differ (this {s.mode} server: "
                               f"{layout}; its peer: {peer}): same model, --tp, --page-size "
                               "and --kv-cache-dtype on both")
        group_rank = 0 if prefill else 1
        if s.backend == "nccl":
            pg = dist.ProcessGroupNCCL(pair, group_rank, 2)
        else:
            pg = dist.ProcessGroupGloo(pair, group_rank, 2, timeout)
        logger.info("KV transfer pair rank %d connected (%s, %s)", self.rank, s.mode, s.backend)
        return pair, pg

    def _send_loop(self, store: dist.Store, pg: Any) -> None:
        stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        seq = 0
        while True:
            room, buf, ready, queued = self._queue.get()
            if ready is not None:
                ready.synchronize()
            store.set(f"hdr/{seq}", f"{room} {buf.shape[0]}")
            seq += 1
            wire = buf.view(torch.uint8)
            start = time.monotonic()
            if stream is None:
                pg.send([wire], 1, 0).wait()
            else:
                with torch.cuda.stream(stream):
                    pg.send([wire], 1, 0).wait()
                stream.synchronize()
            self.stats.add(wire.numel(), start, queued, idle=self._queue.empty())

    def _recv_loop(self, store: dist.Store, pg: Any) -> None:
        stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        shape = (2 * len(self.kv.k), *self.kv.k[0].shape[1:])
        seq = 0
        while True:
            room, pages = (int(x) for x in store.get(f"hdr/{seq}").decode().split())
            start = time.monotonic()  # the sender set the header just before it sends
            store.delete_key(f"hdr/{seq}")
            seq += 1
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                buf = torch.empty((pages, *shape), dtype=self.kv.k[0].dtype, device=self.device)
                pg.recv([buf.view(torch.uint8)], 0, 0).wait()
            if stream is not None:
                stream.synchronize()
            now = time.monotonic()
            with self._cond:
                for old in [r for r, (_, t) in self._arrived.items() if now - t > EXPIRE_S]:
                    del self._arrived[old]
                self._arrived[room] = (buf, now)
                nbytes = buf.numel() * buf.element_size()
                self._unreported.append((room, nbytes, min(int((now - start) * 1e6), U32_MAX)))
                self._cond.notify_all()

    def reports(self, limit: int) -> dict[str, bytes]:
        """A result's transfer reports: up to `limit` transfers that arrived since the last,
        each with its bytes and time on the wire (`StepResult::kv_arrived`; the rest go in the
        next), and why the pair is down (`kv_down`, in every result while it is)."""
        with self._cond:
            got, self._unreported = self._unreported[:limit], self._unreported[limit:]
            failed = self.failed
        rooms, nbytes, micros = zip(*got) if got else ((), (), ())
        out = {"kv_arrived_room": np.asarray(rooms, np.int64).tobytes(),
               "kv_arrived_bytes": np.asarray(nbytes, np.int64).tobytes(),
               "kv_arrived_transfer_us": np.asarray(micros, np.uint32).tobytes()}
        if failed is not None:
            why = failed.encode()[:MAX_DOWN_TEXT]
            out |= {"kv_down_message_len": np.asarray([len(why)], np.uint32).tobytes(),
                    "kv_down_message": why}
        return out


class ArrivalReports:
    """A decode server's first rank's result channel: every result it sends carries the
    transfers that arrived since the previous one, so the engine admits their requests."""

    def __init__(self, channel: Any, kv: KVTransfer, limit: int) -> None:
        self._channel, self._kv, self._limit = channel, kv, limit

    def send_result(self, step_id: int, arrays: dict[str, bytes]) -> None:
        self._channel.send_result(step_id, {**arrays, **self._kv.reports(self._limit)})

    def __getattr__(self, name: str) -> Any:  # recv and the rest: the channel's own
        return getattr(self._channel, name)


class SendStats:
    """The prefill side's transfer totals, logged every `STATS_EVERY_S` while it sends and
    at most every second when its queue runs dry (benches/scenarios/pd_bench.py reads the
    last line)."""

    def __init__(self) -> None:
        self.count, self.bytes, self.wire_s, self.total_s = 0, 0, 0.0, 0.0
        self._logged = time.monotonic()

    def add(self, nbytes: int, start: float, queued: float, idle: bool) -> None:
        now = time.monotonic()
        self.count += 1
        self.bytes += nbytes
        self.wire_s += now - start
        self.total_s += now - queued
        # Also when the queue runs dry, so a burst's totals are in the log once it is over.
        if now - self._logged >= (1.0 if idle else STATS_EVERY_S):
            self._logged = now
            logger.info("%s", self.line())

    def line(self) -> str:
        n = max(self.count, 1)
        return (f"KV transfer sent: {self.count} transfers, {self.bytes / 1e6:.1f} MB, "
                f"{self.bytes / n / 1e6:.2f} MB and {1e3 * self.total_s / n:.2f} ms per transfer "
                f"(forward done to sent), {self.bytes / max(self.wire_s, 1e-9) / 1e9:.2f} GB/s "
                "on the wire")


def _by_room(key: np.ndarray, mine: np.ndarray) -> list[tuple[int, np.ndarray]]:
    """The rows of `mine` grouped by transfer, each in plan order (a transfer's page order)."""
    rows = np.flatnonzero(mine)
    rooms: dict[int, list[int]] = {}
    for r in rows.tolist():
        rooms.setdefault(int(key[r]), []).append(r)
    return [(room, np.asarray(rs)) for room, rs in rooms.items()]
