"""Per-request timings → serving metrics (as sglang.bench_serving / vllm bench serve), arrivals, verification."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

import numpy as np


@dataclass
class RequestResult:
    """One streamed request. Times are time.perf_counter() seconds."""

    prompt_len: int  # client-side count
    expected_output_len: int  # max_tokens sent
    send_time: float = 0.0
    chunk_times: list[float] = field(default_factory=list)  # arrival of every non-empty chunk
    end_time: float = 0.0  # end of the stream
    ok: bool = False
    error: str = ""
    text: str = ""
    usage_output_tokens: int | None = None  # as the server reported it
    usage_prompt_tokens: int | None = None
    output_tokens: int = 0  # resolved: usage, else tokenizer count

    @property
    def ttft(self) -> float:
        """Send → first non-empty chunk."""
        return self.chunk_times[0] - self.send_time if self.chunk_times else math.nan

    @property
    def itls(self) -> list[float]:
        """Every gap between consecutive non-empty chunks after the first."""
        t = self.chunk_times
        return [b - a for a, b in itertools.pairwise(t)]

    @property
    def e2e(self) -> float:
        return self.end_time - self.send_time

    @property
    def tpot(self) -> float | None:
        """(E2E − TTFT) / (output tokens − 1); None for single-token outputs."""
        if self.output_tokens <= 1 or not self.chunk_times:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


def arrival_offsets(n: int, request_rate: float, rng: np.random.Generator) -> np.ndarray:
    """Poisson process: the first request at 0, then exponential gaps of mean 1/rate; inf = all at 0."""
    if n <= 0:
        return np.zeros(0)
    if math.isinf(request_rate):
        return np.zeros(n)
    if request_rate <= 0:
        raise ValueError(f"--request-rate must be > 0 (or inf), got {request_rate}")
    gaps = rng.exponential(1.0 / request_rate, size=n)
    gaps[0] = 0.0
    return np.cumsum(gaps)


def _stats(values: list[float], scale: float = 1000.0) -> dict[str, float]:
    """mean / median / p90 / p99 / max / std, scaled (seconds → ms by default)."""
    if not values:
        return {k: math.nan for k in ("mean", "median", "p90", "p99", "max", "std")}
    a = np.asarray(values, dtype=np.float64) * scale
    return {"mean": float(a.mean()), "median": float(np.median(a)), "p90": float(np.percentile(a, 90)),
            "p99": float(np.percentile(a, 99)), "max": float(a.max()), "std": float(a.std())}


def compute_metrics(results: list[RequestResult]) -> dict[str, object]:
    """Aggregate metrics. Throughput = tokens / (first send → last completion) of successful requests."""
    ok = [r for r in results if r.ok]
    out: dict[str, object] = {"num_requests": len(results), "completed": len(ok),
                              "failed": len(results) - len(ok)}
    if not ok:
        return out
    duration = max(r.end_time for r in ok) - min(r.send_time for r in ok)
    server_prompt = all(r.usage_prompt_tokens is not None for r in ok)
    total_in = sum((r.usage_prompt_tokens or 0) if server_prompt else r.prompt_len for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    itls = [g for r in ok for g in r.itls]
    tpots = [t for r in ok if (t := r.tpot) is not None]
    out.update({
        "duration_s": duration,
        "total_input_tokens": total_in,
        "input_tokens_source": "server usage" if server_prompt else "client tokenizer",
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration if duration > 0 else math.nan,
        "input_throughput": total_in / duration if duration > 0 else math.nan,
        "output_throughput": total_out / duration if duration > 0 else math.nan,
        "total_throughput": (total_in + total_out) / duration if duration > 0 else math.nan,
        "concurrency": sum(r.e2e for r in ok) / duration if duration > 0 else math.nan,
        "ttft_ms": _stats([r.ttft for r in ok if r.chunk_times]),
        "tpot_ms": _stats(tpots),
        "itl_ms": _stats(itls),
        "e2e_ms": _stats([r.e2e for r in ok]),
        "slowest_itls": slowest_itls(results),
    })
    return out


def slowest_itls(results: list[RequestResult], n: int = 5) -> list[dict[str, float]]:
    """The n longest inter-token gaps, each with where it happened: request index, chunk index,
    and when the gap ended, both since the first send (`at_s`) and as the raw perf_counter
    value (`clock_s`, CLOCK_MONOTONIC on Linux: the clock of the server's step trace `at`),
    so that a gap can be matched with the server's steps around it."""
    t0 = min((r.send_time for r in results if r.ok), default=0.0)
    gaps = [(b - a, i, k + 1, b) for i, r in enumerate(results) if r.ok
            for k, (a, b) in enumerate(itertools.pairwise(r.chunk_times))]
    return [{"ms": 1e3 * g, "request": i, "chunk": k, "at_s": end - t0, "clock_s": end}
            for g, i, k, end in sorted(gaps, reverse=True)[:n]]


def verify_lengths(results: list[RequestResult]) -> list[tuple[int, int, int]]:
    """(index, expected, got) of every successful request whose output length != max_tokens."""
    return [(i, r.expected_output_len, r.output_tokens) for i, r in enumerate(results)
            if r.ok and r.output_tokens != r.expected_output_len]


def _line(label: str, value: object) -> str:
    if isinstance(value, float):
        value = "nan" if math.isnan(value) else f"{value:.2f}"
    return f"{label:<40} {value:>10}"


def format_metrics(m: dict, header: dict[str, object]) -> str:
    """The human-readable block, laid out like sglang.bench_serving's."""
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=51, c="=")]
    lines += [_line(k + ":", v) for k, v in header.items()]
    lines.append(_line("Successful requests:", m["completed"]))
    if m.get("failed"):
        lines.append(_line("Failed requests:", m["failed"]))
    if not m.get("completed"):
        return "\n".join(lines + ["=" * 51])
    lines += [
        _line("Benchmark duration (s):", m["duration_s"]),
        _line(f"Total input tokens ({m['input_tokens_source']}):"[:39], m["total_input_tokens"]),
        _line("Total generated tokens:", m["total_output_tokens"]),
        _line("Request throughput (req/s):", m["request_throughput"]),
        _line("Input token throughput (tok/s):", m["input_throughput"]),
        _line("Output token throughput (tok/s):", m["output_throughput"]),
        _line("Total token throughput (tok/s):", m["total_throughput"]),
        _line("Concurrency:", m["concurrency"]),
    ]
    sections = [("e2e_ms", "End-to-End Latency", "E2E Latency"),
                ("ttft_ms", "Time to First Token", "TTFT"),
                ("tpot_ms", "Time per Output Token (excl. 1st token)", "TPOT"),
                ("itl_ms", "Inter-Token Latency", "ITL")]
    for key, title, short in sections:
        s = m[key]
        lines.append("{s:{c}^{n}}".format(s=f" {title} ", n=51, c="-"))
        lines += [_line(f"Mean {short} (ms):", s["mean"]), _line(f"Median {short} (ms):", s["median"]),
                  _line(f"P99 {short} (ms):", s["p99"])]
        if key == "itl_ms":
            lines.append(_line(f"Max {short} (ms):", s["max"]))
    idle = m.get("gpu_idle")
    if isinstance(idle, dict):
        # serve.gpu_idle_share says what each counter measures.
        lines.append("{s:{c}^{n}}".format(s=" Server (TokenSpeed engine counters) ", n=51, c="-"))
        if "gpu_idle_share" in idle:  # the worker's GPU idle over the run's wall time
            lines.append(_line("GPU idle between steps (%):", 100.0 * idle["gpu_idle_share"]))
            lines.append(_line("GPU idle between steps (ms):", 1e3 * idle["gpu_idle_s"]))
        lines.append(_line("Engine stalled, no step in flight (%):", 100.0 * idle["engine_stalled_share"]))
        lines.append(_line("Engine stalled, no step in flight (ms):", 1e3 * idle["stalled_s"]))
        if "retractions" in idle:  # each one pauses a stream until it is readmitted
            lines.append(_line("Requests retracted (KV pages ran out):", idle["retractions"]))
    itl = m.get("engine_itl")
    if isinstance(itl, dict):  # serve.engine_itl: the gaps before the HTTP stream and the client
        lines.append(_line("Engine ITL gaps over 300 ms:", itl["over_300ms"]))
        lines.append(_line("Engine max ITL at most (ms):", itl["max_le_ms"]))
    lag = m.get("client_loop_lag")
    if isinstance(lag, dict):  # sender.LoopLag: gaps this client's own event loop made
        lines.append(_line("Client event loop max lateness (ms):", lag["max_ms"]))
        lines.append(_line("Client event loop lateness p99 (ms):", lag["p99_ms"]))
    lines.append("=" * 51)
    return "\n".join(lines)
