"""Step times as running streams see them, from a server log written with TOKENSPEED_STEP_TRACE=1.

A decoding request gets one token per step, so the interval between two consecutive results
the worker sends is the inter-token gap every running stream sees at that step. Comparing
their distribution with the client's ITL splits a latency problem in two: long steps (the
scheduler, a prefill wave, an eager launch) or delays after the result (engine, HTTP, the
benchmark client). An interval that follows an idle worker (nothing in flight) is counted
without the idle time.

    python3 benches/diagnostics/step_intervals.py server_on.log [--since T0 --until T1]

(T0/T1: `time.monotonic()` seconds on the server's machine; gpu_bench passes each scenario's
window when it runs with TOKENSPEED_STEP_TRACE=1.)
"""

from __future__ import annotations

import argparse
import itertools
import re
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

LINE = re.compile(r"step (\d+): batch (\d+) tokens (\d+) new (\d+) \| idle ([\d.]+) launch [\d.]+ "
                  r"gpu_wait [\d.]+ send [\d.]+ total [\d.]+ ms at ([\d.]+) s")


@dataclass(frozen=True)
class Step:
    step: int
    batch: int
    tokens: int
    new: int
    idle_ms: float
    sent_s: float


def parse(text: str) -> list[Step]:
    """Every traced step in the log (only every step when TOKENSPEED_STEP_TRACE=1), by send time."""
    steps = [Step(int(m[1]), int(m[2]), int(m[3]), int(m[4]), float(m[5]), float(m[6]))
             for m in LINE.finditer(text)]
    return sorted(steps, key=lambda s: s.sent_s)


def intervals(steps: list[Step], since: float = float("-inf"),
              until: float = float("inf")) -> list[tuple[float, Step]]:
    """(ms since the previous result, the step) for consecutive steps both sent in the window;
    a gap in the step ids (a trace not logging every step) breaks the chain."""
    out = []
    for prev, cur in itertools.pairwise(steps):
        if prev.sent_s < since or cur.sent_s > until or cur.step != prev.step + 1:
            continue
        out.append((max(0.0, (cur.sent_s - prev.sent_s) * 1e3 - cur.idle_ms), cur))
    return out


def sent_between(steps: list[Step], start: float, end: float) -> list[Step]:
    """The steps whose results were sent in [start, end] (`time.monotonic()` seconds)."""
    return [s for s in steps if start <= s.sent_s <= end]


def summarize(pairs: list[tuple[float, Step]], slowest: int = 5) -> dict[str, Any] | None:
    if not pairs:
        return None
    ms = sorted(p[0] for p in pairs)

    def pct(q: float) -> float:
        return ms[min(len(ms) - 1, round(q * (len(ms) - 1)))]

    top = sorted(pairs, key=lambda p: -p[0])[:slowest]
    return {"steps": len(ms), "median_ms": statistics.median(ms), "p99_ms": pct(0.99),
            "max_ms": ms[-1],
            "slowest": [{"ms": round(t, 2), "step": s.step, "batch": s.batch, "tokens": s.tokens,
                         "new": s.new} for t, s in top]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("log", type=Path)
    p.add_argument("--since", type=float, default=float("-inf"))
    p.add_argument("--until", type=float, default=float("inf"))
    a = p.parse_args()
    s = summarize(intervals(parse(a.log.read_text(errors="replace")), a.since, a.until))
    if s is None:
        print("no consecutive traced steps (run the server with TOKENSPEED_STEP_TRACE=1)")
        return 1
    print(f"{s['steps']} step intervals: median {s['median_ms']:.2f} ms, p99 {s['p99_ms']:.2f}, "
          f"max {s['max_ms']:.2f}")
    for row in s["slowest"]:
        print(f"  {row}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
