"""`tokenspeed bench offline`: throughput at saturation, every prompt at once, through the offline
engine API in this process (`tokenspeed.LLM.generate`, the default) or through a real
`tokenspeed serve` process (`--via server`, or `--base-url` for one already running)."""

from __future__ import annotations

import argparse
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx

from tokenspeed.bench.serve import add_client_args, add_dataset_args, run_serve_bench

EPILOG = """Everything after `--` are `tokenspeed serve` flags (for LLM(...) or the server), e.g.
  tokenspeed bench offline --num-prompts 2000 --random-input-len 1024 --random-output-len 1024 \\
      -- /models/llama-3.1-8b --load-format dummy --dtype bfloat16
Prompts use fixed lengths unless --random-range-ratio is set; every prompt is sent at once.
--via engine (default) runs LLM.generate in this process; --via server the same through HTTP."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tokenspeed bench offline", epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                description="Throughput at saturation: starts `tokenspeed serve` with the "
                                            "flags after -- (or LLM(...) in this process), sends every prompt "
                                            "at once, reports output and total tok/s, stops it.")
    p.add_argument("--via", choices=("engine", "server"), default="engine",
                   help="engine: tokenspeed.LLM.generate in this process (default); server: "
                        "`tokenspeed serve` over HTTP")
    p.add_argument("--base-url", default=None, help="use this running server instead of starting one")
    p.add_argument("--server-timeout", type=float, default=1800, help="seconds to wait for /health (default 1800)")
    p.add_argument("--server-log", default=None, help="file for the server's output (default: a temp file)")
    add_client_args(p)
    add_dataset_args(p)
    return p


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _flag_value(flags: list[str], name: str) -> str | None:
    for i, f in enumerate(flags):
        if f == name and i + 1 < len(flags):
            return flags[i + 1]
        if f.startswith(name + "="):
            return f.split("=", 1)[1]
    return None


def server_command(serve_flags: list[str]) -> tuple[list[str], str]:
    """The `tokenspeed serve` command line and the base URL it will listen on."""
    flags = list(serve_flags)
    host = _flag_value(flags, "--host")
    if host is None:
        host = "127.0.0.1"
        flags += ["--host", host]
    port = _flag_value(flags, "--port")
    if port is None:
        port = str(free_port())
        flags += ["--port", port]
    connect = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    return [sys.executable, "-m", "tokenspeed.launch.cli", "serve", *flags], f"http://{connect}:{port}"


def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float, log_path: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"tokenspeed bench: the server exited with {proc.returncode}:\n{_tail(log_path)}")
        try:
            if httpx.get(f"{url}/health", timeout=2, trust_env=False).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    stop_server(proc)
    raise SystemExit(f"tokenspeed bench: the server was not healthy within {timeout_s}s:\n{_tail(log_path)}")


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _tail(path: str, n: int = 40) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except OSError:
        return ""


def main(argv: list[str]) -> int:
    if "--" in argv:
        cut = argv.index("--")
        own, serve_flags = argv[:cut], argv[cut + 1:]
    else:
        own, serve_flags = argv, []
    args = build_parser().parse_args(own)
    args.request_rate = math.inf
    if args.via == "engine" and not args.base_url:
        from tokenspeed.bench.offline_engine import run_engine_bench

        return run_engine_bench(args, serve_flags, ["tokenspeed", "bench", "offline", *argv])
    record_extra: dict = {"serve_flags": serve_flags}
    proc = None
    if args.base_url:
        if serve_flags:
            print("warning: --base-url given; the flags after -- are ignored", file=sys.stderr)
    else:
        cmd, args.base_url = server_command(serve_flags)
        log_path = args.server_log or tempfile.mkstemp(prefix="tokenspeed-bench-server-", suffix=".log")[1]
        print(f"starting: {' '.join(cmd)}\n  (log: {log_path})")
        with open(log_path, "w") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        t0 = time.monotonic()
        try:
            wait_healthy(args.base_url, proc, args.server_timeout, log_path)
        except BaseException:
            stop_server(proc)
            raise
        record_extra["server_startup_s"] = round(time.monotonic() - t0, 2)
        print(f"server healthy at {args.base_url} after {record_extra['server_startup_s']} s")
    args.base_url = args.base_url.rstrip("/")
    try:
        rc, record = run_serve_bench(args, ["tokenspeed", "bench", "offline", *argv], record_extra, "offline")
    finally:
        if proc is not None:
            stop_server(proc)
            print("server stopped")
    m = record["metrics"]
    if m.get("completed"):
        print(f"offline throughput: output {m['output_throughput']:.1f} tok/s, "
              f"total {m['total_throughput']:.1f} tok/s ({m['completed']} requests, {m['duration_s']:.2f} s)")
    return rc
