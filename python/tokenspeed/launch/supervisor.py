"""The launcher's watch over its child processes while the Rust core serves: when a worker rank
(or the multi-node plan relay) dies, say which one (rank, pid, node and host, exit code or
signal), then stop the server so that it exits non-zero.

The Rust engine notices a dead pid on its own (every 200 ms) and fails in-flight requests and
/health with 503; it knows pids only. This thread knows what each pid was. It wakes on the
processes' sentinels (a pipe that closes when the process exits, independent of who reaps it),
waits `COLLECT_S` so that ranks dying of the first death (a gloo peer gone) are reported with
it, the likeliest cause first, keeps serving the 503s for `GRACE_S`, then sends the server
SIGTERM: the core shuts down as on Ctrl-C and `launch` returns 1. Children ignore SIGINT
(`without_sigint`), so a Ctrl-C is a shutdown, not a death; a SIGTERM sent to the whole process
group kills them too, and should the server take over `COLLECT_S` to stop, it is reported as one.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

logger = logging.getLogger("tokenspeed.launch.supervisor")

COLLECT_S = 1.0
GRACE_S = 10.0  # long enough for load balancers and slow clients to see the 503s


def without_sigint(target: Callable[..., Any], *args: Any) -> Any:
    """A child's entry point that ignores SIGINT: Ctrl-C reaches the whole process group, and
    only the server should act on it (it stops, then stops its children). A child killed by it
    would look like a death."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    return target(*args)


@dataclass
class Watched:
    """One child: `what` names it ("worker rank 1 of 2"); `link`, when set, may carry a last
    note from it ({"ok": False, "error": ...}) that names a cause it saw (the plan relay
    reports a rank that died on another node)."""

    proc: Any  # multiprocessing.Process
    what: str
    link: Connection | None = None
    note: str | None = field(default=None, init=False)
    status: int | None = field(default=None, init=False)  # exit code, -signal when killed

    def exitcode(self) -> int | None:
        return self.status if self.status is not None else self.proc.exitcode


def how_it_ended(exitcode: int | None) -> str:
    if exitcode is None:  # reaped by someone else (the Rust core's liveness check)
        return "exited (exit status already collected)"
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"was killed by {name}"
    return f"exited with code {exitcode}"


def peek_exit_status(pid: int, wait_s: float = 0.2) -> int | None:
    """A dead child's exit code (-signal when killed) without reaping it: the Rust core's
    liveness check reaps it (waitpid) and must still see it die. The sentinel closes a moment
    before the child turns zombie, hence the short retry; None if someone reaped it first."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return None
        if info is not None:
            return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status
        if time.monotonic() > deadline:
            return None
        time.sleep(0.005)


def describe(w: Watched, where: str) -> str:
    text = f"{w.what} (pid {w.proc.pid}{where}) {how_it_ended(w.exitcode())}"
    return f"{text}: {w.note}" if w.note else text


class DeathWatch:
    """Start with `start()` once the children are up; `stop()` before stopping them on purpose
    (a shutdown is not a death). `failure` holds the message once a child died."""

    def __init__(self, watched: list[Watched], node_rank: int = 0, nnodes: int = 1,
                 grace_s: float = GRACE_S, on_failure: Callable[[str], None] | None = None) -> None:
        self.watched = watched
        self.grace_s = grace_s
        # In-process engines (tokenspeed.LLM) are told instead of the process being stopped.
        self.on_failure = on_failure
        # Multi-node: a rank is found by its node and host; one node needs neither.
        self.where = f", node {node_rank} host {socket.gethostname()}" if nnodes > 1 else ""
        self.failure: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tokenspeed-death-watch",
                                        daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.ident is not None:  # started (not on a relay node, nor before serving)
            self._thread.join(timeout=5)

    def _dead(self, timeout: float = 0) -> list[Watched]:
        # By sentinel, not is_alive(): once the Rust core has reaped a pid, is_alive() (waitpid)
        # says "alive" forever. Exit statuses are read as soon as seen, before it reaps them.
        ended = set(wait([w.proc.sentinel for w in self.watched], timeout=timeout))
        dead = [w for w in self.watched if w.proc.sentinel in ended]
        for w in dead:
            if w.status is None:
                w.status = peek_exit_status(w.proc.pid)
        return dead

    def report(self) -> str | None:
        """What ended so far, the likeliest cause first; None while every child runs."""
        dead = self._dead()
        if not dead:
            return None
        for w in dead:
            if w.note is None and w.link is not None:
                try:
                    if w.link.poll(0):
                        w.note = str(w.link.recv().get("error"))
                except (EOFError, OSError):
                    pass
        # A note naming a remote death, then a process killed by a signal, then ranks that
        # exited on their own (often a collective failing because the first one died).
        dead.sort(key=lambda w: (w.note is None, (w.exitcode() or 0) >= 0))
        msg = f"{describe(dead[0], self.where)}; the worker group cannot serve without it"
        if len(dead) > 1:
            msg += "; also ended: " + "; ".join(describe(w, self.where) for w in dead[1:])
        return msg

    def _run(self) -> None:
        while not self._dead(timeout=0.5):
            if self._stop.is_set():
                return
        collect_end = time.monotonic() + COLLECT_S
        while time.monotonic() < collect_end:  # ranks that die of the first death, statuses read
            if self._stop.wait(0.05):
                return
            self._dead()
        self.failure = self.report()
        if self.on_failure is not None:
            self.on_failure(self.failure or "a worker process ended")
            return
        logger.error("%s. Stopping the server in %.0fs (requests fail with 503 meanwhile).",
                     self.failure, self.grace_s)
        if self._stop.wait(self.grace_s):
            return
        os.kill(os.getpid(), signal.SIGTERM)  # the Rust core's graceful shutdown
