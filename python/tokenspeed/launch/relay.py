"""Multi-node: node 0's plans reach the other nodes' shm rings over torch.distributed.

Node 0 runs the server and the scheduler; its plan ring has one extra reader, the *source*
relay (a process of its own, its pid among the server's worker pids, so its death fails the
server fast). Every other node runs one *sink* relay (the `tokenspeed serve --node-rank k`
process itself) that writes each plan into its node's ring, which that node's ranks read like
node 0's. The relays form their own gloo group, one rank per node, at the port after
`--dist-init-addr`'s (the worker ranks use that port). When no plan comes for `TICK_S`, the
source sends a tick, so an idle server never runs into the collective timeout, and the sinks
use the ticks to check their local ranks: a dead rank ends its sink, which breaks the relay
group, which ends the source, which the server sees. Before leaving, the sink writes which rank
died (global rank, pid, node, host, how) into the relay group's TCP store on node 0; the source
passes it to the launcher (supervisor.DeathWatch), so node 0's log names the remote rank.

Plans travel as {schema array name: bytes} (what `WorkerChannel.recv` shows, copied) and are
written with `_core.PlanWriter.create(...).send_plan`, the one way Python can write a
plan today: it re-encodes them through the schema's codec. A raw-slot path
(`WorkerChannel.recv_raw() -> bytes`, a writer's `send_raw(bytes)`) would skip that; it needs
`rust/py` changes.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import traceback
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any

from tokenspeed.launch.supervisor import describe
from tokenspeed.worker.loop import die_with_parent

logger = logging.getLogger("tokenspeed.launch.relay")

TICK_S = 1.0
_SHUTDOWN = "shutdown"
_DEATH_KEY = "tokenspeed/relay/death"


def relay_init_method(dist_init_addr: str) -> str:
    host, _, port = dist_init_addr.rpartition(":")
    return f"tcp://{host}:{int(port) + 1}"


def _death_store(dist_init_addr: str, timeout_s: float) -> Any:
    """A client of the TCP store the relay group met at (served by node 0's source relay)."""
    from torch.distributed import TCPStore

    host, _, port = dist_init_addr.rpartition(":")
    return TCPStore(host, int(port) + 1, is_master=False, wait_for_workers=False,
                    timeout=timedelta(seconds=timeout_s))


def _remote_death(dist_init_addr: str) -> str | None:
    """What a sink wrote before leaving, if it did."""
    try:
        store = _death_store(dist_init_addr, 5.0)
        return store.get(_DEATH_KEY).decode() if store.check([_DEATH_KEY]) else None
    except Exception:  # noqa: BLE001  (only a better message is lost)
        return None


def _join(node_rank: int, nnodes: int, dist_init_addr: str, timeout_s: float) -> None:
    import torch.distributed as dist

    try:
        dist.init_process_group("gloo", init_method=relay_init_method(dist_init_addr),
                                rank=node_rank, world_size=nnodes,
                                timeout=timedelta(seconds=timeout_s))
    except Exception as e:  # name the node and where it waited
        raise RuntimeError(f"node {node_rank} of {nnodes}: the plan relays could not meet at "
                           f"{relay_init_method(dist_init_addr)} within {timeout_s:.0f}s: "
                           f"{type(e).__name__}: {e}") from e


def _min_capacity(capacity: tuple[int, int]) -> tuple[int, int]:
    """The smallest (KV pages, max running requests) of every rank on every node: the
    scheduler's page count, and a slot count every rank's worker holds."""
    import torch
    import torch.distributed as dist

    t = torch.tensor(capacity, dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t[0]), int(t[1])


def _plan_message(raw: dict[str, Any]) -> tuple[int, dict[str, bytes]]:
    """A received plan as (step id, {array name: bytes}), a copy out of the shm slot."""
    return int(raw["step_id"]), {k: v.tobytes() for k, v in raw.items() if k != "step_id"}


def run_source(channel_name: str, reader: int, nnodes: int, dist_init_addr: str,
               timeout_s: float, local: tuple[int, int], ready: Connection) -> None:
    """Node 0's relay process: reads every plan as reader `reader` and broadcasts it."""
    import torch.distributed as dist

    die_with_parent()
    logging.basicConfig(level="INFO", format="[relay 0] %(asctime)s %(levelname)s %(message)s")
    # SIGTERM (the server stopping, or its death): tell the other nodes before leaving.
    stopping: list[int] = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(1))
    try:
        from tokenspeed._core import WorkerChannel

        _join(0, nnodes, dist_init_addr, timeout_s)
        pages, running = _min_capacity(local)
        channel = WorkerChannel.attach(channel_name, reader)
        # `ready` stays open for a death note.
        ready.send({"ok": True, "num_pages": pages, "max_running_requests": running})
    except BaseException as e:  # noqa: BLE001  (reported to the launcher)
        ready.send({"ok": False, "error": f"{type(e).__name__}: {e}",
                    "traceback": traceback.format_exc()})
        sys.exit(1)
    while True:
        try:
            raw = None if stopping else channel.recv(int(TICK_S * 1000))
            msg = _SHUTDOWN if stopping else None if raw is None else _plan_message(raw)
        except ConnectionError:  # the server closed the channel
            msg = _SHUTDOWN
        try:
            dist.broadcast_object_list([msg], src=0)
        except RuntimeError as e:  # a node left: say why when its sink did
            note = _remote_death(dist_init_addr) or (
                f"lost the plan relay group (another node stopped or crashed): {e}")
            logger.error("%s", note)
            ready.send({"ok": False, "error": note})
            sys.exit(1)
        if msg == _SHUTDOWN:
            return


def run_sink(writer: Any, node_rank: int, nnodes: int, dist_init_addr: str, timeout_s: float,
             local: tuple[int, int], workers: list[Any], where: str = "") -> int:
    """Node k's relay (k > 0), in the launcher process: writes node 0's plans into this node's
    ring until node 0 shuts down. `workers`: this node's ranks (supervisor.Watched); `where`
    names the node and host. Returns the process exit code."""
    import torch.distributed as dist

    _join(node_rank, nnodes, dist_init_addr, timeout_s)
    _min_capacity(local)
    store = _death_store(dist_init_addr, timeout_s)
    logger.info("node %d: relaying plans from node 0 to %d local rank(s)", node_rank,
                len(workers))
    while True:
        box: list[Any] = [None]
        try:
            dist.broadcast_object_list(box, src=0)
        except RuntimeError as e:  # node 0 crashed or was killed without a goodbye
            logger.error("node %d: lost node 0's plan relay (%s); stopping", node_rank, e)
            writer.shutdown()
            return 1
        msg = box[0]
        if msg == _SHUTDOWN:
            writer.shutdown()
            return 0
        if msg is not None:
            writer.send_plan(msg[0], msg[1], None)
        for w in workers:
            if not w.proc.is_alive():
                died = describe(w, where)
                logger.error("%s; leaving the relay group so that node 0 fails", died)
                try:  # for node 0's log: which rank, where
                    store.set(_DEATH_KEY, died)
                    store.get(_DEATH_KEY)  # a round trip: stored before the group breaks
                except Exception as e:  # noqa: BLE001  (node 0 still fails, less precisely)
                    logger.error("could not tell node 0: %s", e)
                os._exit(1)  # no clean teardown: node 0 must see the group break
