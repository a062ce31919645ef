"""The launcher's death watch (supervisor.py) on plain child processes: it names the rank, pid,
node and host and how the child ended, puts the likeliest cause first, and reads exit statuses
without reaping (the Rust core's liveness check must still see the death)."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import socket
import sys
import time

from tokenspeed.launch.supervisor import DeathWatch, Watched, how_it_ended


def _children(*codes: int | None) -> list[Watched]:
    """Children that sleep (None) or exit with a code; named as ranks of a world of len(codes)."""
    ctx = mp.get_context("fork")
    out = []
    for rank, code in enumerate(codes):
        target = (lambda c=code: sys.exit(c)) if code is not None else (lambda: time.sleep(60))
        proc = ctx.Process(target=target, daemon=True)
        proc.start()
        out.append(Watched(proc, f"worker rank {rank} of {len(codes)}"))
    return out


def _wait_failure(watch: DeathWatch, timeout_s: float = 10) -> str:
    deadline = time.monotonic() + timeout_s
    while watch.failure is None:
        assert time.monotonic() < deadline, "no death reported"
        time.sleep(0.05)
    return watch.failure


def test_a_killed_rank_is_named_with_its_node_and_host_and_left_for_the_core_to_reap() -> None:
    watched = _children(None, None)
    watch = DeathWatch(watched, node_rank=1, nnodes=2, grace_s=60)  # no SIGTERM within the test
    watch.start()
    victim = watched[1].proc.pid
    try:
        os.kill(victim, signal.SIGKILL)
        msg = _wait_failure(watch)
    finally:
        watch.stop()
        watched[0].proc.kill()
    assert msg.startswith(f"worker rank 1 of 2 (pid {victim}, node 1 host {socket.gethostname()}) "
                          "was killed by SIGKILL; the worker group cannot serve without it"), msg
    assert "rank 0" not in msg
    pid, status = os.waitpid(victim, os.WNOHANG)  # still a zombie: the watch did not reap it
    assert pid == victim and os.waitstatus_to_exitcode(status) == -signal.SIGKILL


def test_the_likeliest_cause_comes_first() -> None:
    # Rank 0 exits with an error (a collective failing after its peer died), rank 1 is killed,
    # the relay leaves a note naming a rank on another node: note, then signal, then the rest.
    watched = _children(1, None, 1)
    watched[2].what = "plan relay to the other nodes"
    reader, writer = mp.Pipe(duplex=False)
    watched[2].link = reader
    writer.send({"ok": False, "error": "worker rank 3 of 4 (pid 1, node 1 host h) was killed by SIGKILL"})
    watch = DeathWatch(watched, grace_s=60)
    os.kill(watched[1].proc.pid, signal.SIGKILL)
    for w in watched:
        w.proc.join(10)
    watch.start()
    try:
        msg = _wait_failure(watch)
    finally:
        watch.stop()
    relay, killed, failed = msg.index("plan relay"), msg.index("rank 1 of 3"), msg.index("rank 0 of 3")
    assert relay < killed < failed, msg
    assert "exited with code 1: worker rank 3 of 4 (pid 1, node 1 host h) was killed by SIGKILL" in msg
    assert "also ended:" in msg


def test_a_stopped_watch_reports_nothing() -> None:
    watched = _children(None)
    watch = DeathWatch(watched, grace_s=60)
    watch.start()
    watch.stop()  # a shutdown on purpose: the workers are stopped after this
    watched[0].proc.kill()
    watched[0].proc.join(10)
    time.sleep(0.3)
    assert watch.failure is None


def test_how_it_ended() -> None:
    assert how_it_ended(-9) == "was killed by SIGKILL"
    assert how_it_ended(3) == "exited with code 3"
    assert "already collected" in how_it_ended(None)


def test_ctrl_c_is_a_shutdown_not_a_death(tmp_path) -> None:
    """SIGINT reaches the whole process group; the workers ignore it, the server stops them, and
    the launcher exits 0 without reporting a death."""
    from server_harness import start_server

    srv = start_server(str(tmp_path), "--max-total-tokens", "1024")
    os.killpg(srv.proc.pid, signal.SIGINT)
    assert srv.proc.wait(timeout=60) == 0, srv.log()
    assert "cannot serve without it" not in srv.log()
    assert "KeyboardInterrupt" not in srv.log()
