"""Starts and stops a real `tokenspeed serve` process on CPU (the default model) for e2e tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    url: str
    proc: subprocess.Popen
    log_path: str

    def log(self) -> str:
        return Path(self.log_path).read_text(errors="replace")

    def info(self) -> dict:
        return httpx.get(f"{self.url}/get_server_info", timeout=10).json()


def start_server(tmp_dir: str, *args: str, timeout_s: float = 300) -> Server:
    port = free_port()
    log_path = os.path.join(tmp_dir, f"server-{port}.log")
    cmd = [sys.executable, "-m", "tokenspeed.launch.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--device", "cpu", *args]
    with open(log_path, "w") as log:  # the child keeps its own copy of the descriptor
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{Path(log_path).read_text()}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return Server(url, proc, log_path)
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    stop_server(Server(url, proc, log_path))
    raise RuntimeError(f"server did not become healthy in {timeout_s}s:\n{Path(log_path).read_text()}")


def stop_server(server: Server) -> None:
    if server.proc.poll() is None:
        os.killpg(server.proc.pid, signal.SIGTERM)
        try:
            server.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.proc.pid, signal.SIGKILL)
            server.proc.wait()


def shm_segments(server: Server) -> list[str]:
    """The server's shared-memory channel segments still in /dev/shm (named after its pid)."""
    shm = Path("/dev/shm")
    if not shm.exists():
        return []
    return sorted(p.name for p in shm.iterdir() if p.name.startswith(f"tokenspeed-{server.proc.pid}"))


def pid_alive(pid: int) -> bool:
    """True while `pid` runs (a zombie counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"


def wait_exit(server: Server, timeout_s: float) -> int | None:
    """The server's exit code, or None if it still runs after `timeout_s`."""
    try:
        return server.proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return None


def flushed_pages(server: Server, timeout_s: float = 30, headers: dict | None = None) -> dict:
    """The KV page counts once the engine is idle and the prefix cache flushed: every page must
    then be free (a leak shows as free < total)."""
    deadline = time.monotonic() + timeout_s
    info: dict = {}
    while time.monotonic() < deadline:
        info = httpx.get(f"{server.url}/get_server_info", timeout=10, headers=headers).json()
        idle = info["engine"]["running_requests"] == 0 and info["engine"]["waiting_requests"] == 0
        if idle and httpx.post(f"{server.url}/flush_cache", timeout=10, headers=headers).status_code == 200:
            info = httpx.get(f"{server.url}/get_server_info", timeout=10, headers=headers).json()
            return info["kv_pages"]
        time.sleep(0.1)
    raise AssertionError(f"server never went idle: {info}")
