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
    cmd = [sys.executable, "-m", "tokenspeed.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
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
