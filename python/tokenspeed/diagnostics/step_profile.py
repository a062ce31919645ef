"""torch.profiler traces of the worker's prefill steps, when TOKENSPEED_STEP_PROFILE=DIR is set (a
debug aid, off by default): where a served step's time goes, kernel by kernel and gap by gap,
in the server itself rather than in a bench that rebuilds the step.

Each step that carries new requests (up to TOKENSPEED_STEP_PROFILE_LIMIT of them, default 8) is
profiled from the plan's arrival to its result being sent; the Chrome trace goes to
DIR/step-<id>.json and a summary to the log (`summarize`: kernel time by name, when the first
kernel began, the GPU's idle gaps with the host ops that ran meanwhile, the slowest CUDA runtime
calls). `benches/diagnostics/mixed_step_gpu.py --profile` prints the same summary for a step run in-process.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
from collections import defaultdict
from pathlib import Path
from typing import Any

logger = logging.getLogger("tokenspeed.diagnostics.step_profile")

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
HOST_CATS = ("cpu_op", "user_annotation", "python_function")


def summarize(trace: dict[str, Any], top: int = 8) -> list[str]:
    """Lines describing one profiled step: its `top` costliest kernels (by name), then where the
    GPU waited: from the first host op to the first kernel, the largest gaps between kernels
    (with the kernels around them and the longest host op overlapping each gap: what the host
    was doing while the GPU had nothing queued), and the CUDA runtime calls that took longest on
    the host (a sync or an allocation shows there)."""
    ev = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    gpu = sorted((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)), e["name"])
                 for e in ev if e.get("cat") in GPU_CATS)
    host = [(float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)), e["name"])
            for e in ev if e.get("cat") in HOST_CATS]
    if not gpu or not host:
        return ["  (no GPU kernels or host ops in the trace)"]
    by_name: dict[str, list[float]] = defaultdict(list)
    for start, end, name in gpu:
        by_name[name[:90]].append((end - start) / 1e3)
    total = sum(sum(v) for v in by_name.values())
    lines = [f"  kernels: {total:.2f} ms GPU in {len(gpu)} launches"]
    lines += [f"  {sum(v):7.3f} ms {len(v):5d}x  {name}"
              for name, v in sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:top]]

    t0 = min(h[0] for h in host)
    t_end = max(h[1] for h in host)
    gaps = sorted(((b[0] - a[1], a[1], b[0], a[2], b[2]) for a, b in itertools.pairwise(gpu)),
                  reverse=True)
    idle = sum(g[0] for g in gaps if g[0] > 0)
    ms = 1e-3
    lines.append(f"  GPU: first kernel {ms * (gpu[0][0] - t0):.2f} ms after the step began, last "
                 f"ends {ms * (gpu[-1][1] - t0):.2f}, host done at {ms * (t_end - t0):.2f}; idle "
                 f"between kernels {ms * idle:.2f} ms; largest gaps:")
    for gap, lo, hi, before, after in gaps[:top]:
        if gap <= 20:
            break
        overlapping = [h for h in host if h[0] < hi and h[1] > lo]
        busy = max(overlapping, key=lambda h: min(h[1], hi) - max(h[0], lo), default=None)
        during = f"; host in {busy[2][:50]}" if busy else ""
        lines.append(f"    {ms * gap:.2f} ms at {ms * (lo - t0):.2f}: after {before[:40]} / before "
                     f"{after[:40]}{during}")
    calls: dict[str, list[float]] = defaultdict(list)
    for e in ev:
        if e.get("cat") in ("cuda_runtime", "cuda_driver"):
            calls[e["name"]].append(float(e.get("dur", 0)) / 1e3)
    slow = sorted(calls.items(), key=lambda kv: -sum(kv[1]))[:top]
    lines.append("  host CUDA calls (ms, count): " + ", ".join(
        f"{n} {sum(v):.2f}/{len(v)}" for n, v in slow))
    return lines


class StepProfiler:
    """Profiles whole steps that carry new requests, one at a time (see the module docstring)."""

    def __init__(self, out_dir: Path, limit: int) -> None:
        self.out_dir = out_dir
        self.limit = limit
        self.done = 0
        self._step: int | None = None
        self._prof: Any = None

    @classmethod
    def from_env(cls) -> StepProfiler | None:
        raw = os.environ.get("TOKENSPEED_STEP_PROFILE", "")
        if not raw:
            return None
        out = Path(raw)
        out.mkdir(parents=True, exist_ok=True)
        return cls(out, int(os.environ.get("TOKENSPEED_STEP_PROFILE_LIMIT", "8")))

    def received(self, step_id: int, new_requests: int) -> None:
        if self._prof is not None or new_requests == 0 or self.done >= self.limit:
            return
        import torch

        acts = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            acts.append(torch.profiler.ProfilerActivity.CUDA)
        self._prof = torch.profiler.profile(activities=acts)
        self._prof.__enter__()
        self._step = step_id

    def sent(self, step_id: int) -> None:
        if self._prof is None or step_id != self._step:
            return
        prof, self._prof = self._prof, None
        prof.__exit__(None, None, None)
        self.done += 1
        path = self.out_dir / f"step-{step_id}.json"
        prof.export_chrome_trace(str(path))
        with open(path) as f:
            lines = summarize(json.load(f))
        logger.info("step %d profiled (%s):\n%s", step_id, path, "\n".join(lines))
