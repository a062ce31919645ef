"""Host (CPU) time of an eager model step at a large batch (issue 29): N requests decoding in a
Llama (by default tiny: 32 layers like Llama-3.1-8B but hidden 64, so the arithmetic is small
and the time is mostly the worker's Python and torch dispatch), then per kind of step
(decode-only: N decodes; mixed: N decodes + one prompt chunk) the median of: the launch's wall
and CPU ms (the host's work to queue the step), the whole step's wall ms, the GPU's ms between
events around it (CUDA), ms per step with one step in flight as the worker loop runs them
(worker/loop.py: the GPU's step time when the host keeps ahead, the host's when it does not),
and the result's encoding (StepOutput.arrays). Eager only: no CUDA graphs.

    python3 benches/diagnostics/host_step_cost.py [--requests 820] [--prompt 1024] [--reps 10]
        [--layers 32] [--profile 25] [--ops] [--device cpu|cuda] [--placeholders]
        [--full --kv-cache-dtype fp8 --context 1024]  (CUDA: the served S1 shape)

On the CPU the served path runs, the triton backend, with every Triton launch a no-op (outputs
stay unwritten): the backend's and the kernel wrappers' host code runs, their arithmetic and the
launch itself do not. Every torch op runs synchronously there, so a step's time is host work
plus the (small) arithmetic of the GEMMs and norms; --ops counts the aten ops (noise-free) and
the cProfile lists compare by function and call count (--dump, then --compare A B).
On CUDA (bf16) torch.cuda.synchronize brackets each timed step; --sync-debug warns on every op
that waits for the GPU (a launch that syncs has launch ms close to step ms).

Runs against 9577187's package too (PYTHONPATH=/tmp/old957, the wheel in .carry/old): every API
it calls exists there (LAST_SAMPLED is looked up with a fallback), so the two compare like for
like; --compare A B lines up two --dump files by function, without line numbers.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from runner_steps import PlanBuilder, llama31_8b_dir
from tokenspeed.bench.model_configs import LLAMA31_8B
from tokenspeed.worker.model_runner import ModelRunner

PAGE = 16
PROFILED = 10  # steps per profile


def tiny_llama_dir(layers: int, vocab: int) -> str:
    """Llama-3.1-8B's config at a tiny width: the same layers and code path, little arithmetic.
    Heads of 64 in groups of 4 (8B: 128 in groups of 4): a head size the GPU kernels are tested
    with, on a 64-wide residual stream."""
    cfg = dict(LLAMA31_8B, hidden_size=64, intermediate_size=128, num_attention_heads=4,
               num_key_value_heads=1, head_dim=64, num_hidden_layers=layers, vocab_size=vocab,
               torch_dtype="float32")
    path = tempfile.mkdtemp(prefix="tiny-llama-")
    with open(f"{path}/config.json", "w") as f:
        json.dump(cfg, f)
    return path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=820, help="requests decoding in every step")
    ap.add_argument("--prompt", type=int, default=1024, help="the mixed steps' prompt chunk")
    ap.add_argument("--context", type=int, default=32, help="tokens each decoding request holds")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: less noise)")
    ap.add_argument("--profile", type=int, default=0, metavar="N", help="cProfile top N per kind")
    ap.add_argument("--sort", default="tottime", help="cProfile sort key (tottime, cumtime)")
    ap.add_argument("--dump", default=None, metavar="PREFIX",
                    help="also write each kind's profile to PREFIX-<kind>.pstats (--compare reads them)")
    ap.add_argument("--compare", nargs=2, default=None, metavar=("A", "B"),
                    help="no steps: per function, calls and own ms per step in two --dump files")
    ap.add_argument("--placeholders", action="store_true",
                    help="decodes read their input from the last sampled token (LAST_SAMPLED), "
                         "as the server's one-step-ahead plans do")
    ap.add_argument("--sync-debug", action="store_true", help="CUDA: warn on ops that sync")
    ap.add_argument("--attention-backend", default="triton",
                    help="triton (served; on the CPU its launches are stubbed, see below) or "
                         "torch_native (the CPU reference: its own host loops and arithmetic)")
    ap.add_argument("--ops", action="store_true",
                    help="count the torch (aten) ops of one step of each kind: every one is a "
                         "dispatch, on CUDA most are a kernel launch (noise-free, unlike ms)")
    ap.add_argument("--full", action="store_true", help="Llama-3.1-8B's real widths (CUDA)")
    ap.add_argument("--kv-cache-dtype", default="auto", help="fp8: the served fp8 KV cache")
    args = ap.parse_args()
    if args.compare:
        print(_compare(*args.compare, args.profile or 40))
        return
    torch.set_num_threads(args.threads)
    if args.device == "cpu" and args.attention_backend == "triton":
        _stub_triton_launches()
    runner, plan, cases = _setup(args)
    cuda = args.device == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    if args.sync_debug and cuda:
        torch.cuda.set_sync_debug_mode("warn")
    what = "Llama-3.1-8B" if args.full else "tiny Llama"
    print(f"{what}, {runner.config.num_hidden_layers} layers, {args.device}, "
          f"{torch.get_num_threads()} torch thread(s), attention {runner.attention_backend}, "
          f"KV {runner.kv_dtype}; medians of {args.reps} steps (min)\n"
          "| step | launch ms | launch CPU ms | step ms | GPU ms | pipelined ms/step | result ms |\n"
          "|---|---|---|---|---|---|---|")
    profiles = {}
    for name, make in cases.items():
        runs = [_timed(runner, plan(make()), sync) for _ in range(args.reps + 1)][1:]  # 1st: warm-up
        cols = [[r[i] for r in runs] for i in range(5)]
        gpu = f"{statistics.median(cols[3]):.2f}" if cuda else "-"
        pipe = _pipelined(runner, [plan(make()) for _ in range(args.reps)], sync)
        print(f"| {name} | {statistics.median(cols[0]):.2f} (min {min(cols[0]):.2f}) | "
              f"{statistics.median(cols[1]):.2f} (min {min(cols[1]):.2f}) | "
              f"{statistics.median(cols[2]):.2f} (min {min(cols[2]):.2f}) | {gpu} | {pipe:.2f} | {statistics.median(cols[4]):.2f} |",
              flush=True)
        if args.ops:
            counts = _op_counts(runner, plan(make()))
            print(f"|   aten ops per step: {sum(counts.values())} ("
                  + ", ".join(f"{k} {v}" for k, v in counts.most_common(12)) + ") | | | | | | |")
        if args.profile:
            dump = f"{args.dump}-{name.split()[0]}.pstats" if args.dump else None
            profiles[name] = _profiled(runner, [plan(make()) for _ in range(PROFILED)], sync,
                                       args.profile, args.sort, dump)
    for name, text in profiles.items():
        print(f"\n### {name}: cProfile of {PROFILED} steps, top {args.profile} by {args.sort}\n{text}")


def _setup(args: argparse.Namespace) -> tuple[ModelRunner, Callable, dict[str, Callable]]:
    """The runner, its plan builder, and per kind of step a maker of its (slot, tokens) rows,
    `requests` of them already decoding."""
    cuda = args.device == "cuda"
    n, reps = args.requests, args.reps
    steps = 2 * (2 * reps + 1 + PROFILED + 2)  # decode steps every request runs, both kinds
    slots = n + 2 * (2 * reps + 1 + PROFILED + 2)  # a fresh one per mixed step
    ctx = -(-max(args.context + steps + 8, args.prompt) // PAGE) * PAGE
    path = llama31_8b_dir(args.layers) if args.full else tiny_llama_dir(args.layers, args.vocab)
    runner = ModelRunner(path, device=args.device, dtype="bfloat16" if cuda else "float32",
                         load_format="dummy", page_size=PAGE, num_pages=slots * ctx // PAGE + 8,
                         max_slots=slots, max_context_len=ctx, disable_cuda_graph=True,
                         attention_backend=args.attention_backend,
                         kv_cache_dtype=args.kv_cache_dtype)
    plan = PlanBuilder(ctx, PAGE).plan
    rng = np.random.default_rng(0)
    vocab = runner.config.vocab_size

    def ids(k: int) -> list[int]:
        return rng.integers(10, min(vocab, 30000), k).tolist()

    decoding = list(range(n))
    per_step = max(1, 8192 // max(args.context, 1))  # their contexts, <= 8192 tokens a step
    for i in range(0, n, per_step):
        runner.step(plan([(s, ids(args.context)) for s in decoding[i:i + per_step]]))
    fresh = list(range(n, slots))
    last = _last_sampled()
    decode_ids = (lambda: [last]) if args.placeholders and last is not None else (lambda: ids(1))

    def decodes() -> list[tuple[int, list[int]]]:
        return [(s, decode_ids()) for s in decoding]

    cases = {f"decode-only ({n})": decodes,
             f"mixed ({n} decodes + {args.prompt}-token prompt)":
                 lambda: decodes() + [(fresh.pop(), ids(args.prompt))]}
    return runner, plan, cases


def _timed(runner: ModelRunner, p: Any, sync: Callable[[], None]) -> tuple[float, ...]:
    """(launch wall ms, launch CPU ms of this thread, step wall ms, GPU ms between events around
    the step (CUDA; 0 elsewhere), result-encoding ms) of one step, alone: nothing queued before
    it."""
    cuda = runner.device.type == "cuda"
    sync()
    events = [torch.cuda.Event(enable_timing=True) for _ in range(2)] if cuda else []
    t0, c0 = time.perf_counter(), time.thread_time()
    if events:
        events[0].record()
    pending = runner.launch(p)
    if events:
        events[1].record()
    t1, c1 = time.perf_counter(), time.thread_time()
    out = pending.wait()
    sync()
    t2 = time.perf_counter()
    out.arrays()  # the worker loop's encoding of the result for the scheduler
    t3 = time.perf_counter()
    gpu = events[0].elapsed_time(events[1]) if events else 0.0
    return 1e3 * (t1 - t0), 1e3 * (c1 - c0), 1e3 * (t2 - t0), gpu, 1e3 * (t3 - t2)


def _pipelined(runner: ModelRunner, plans: list, sync: Callable[[], None]) -> float:
    """Wall ms per step with one step in flight, as the worker loop runs them (worker/loop.py:
    launch the next plan, then wait for the one before): the GPU's step time when the host
    keeps ahead, the host's when it does not."""
    sync()
    t0 = time.perf_counter()
    pending = None
    for p in plans:
        step = runner.launch(p)
        if pending is not None:
            pending.wait()
        pending = step
    if pending is not None:
        pending.wait()
    sync()
    return 1e3 * (time.perf_counter() - t0) / max(len(plans), 1)


def _op_counts(runner: ModelRunner, p) -> Counter:
    """aten ops dispatched while one step runs, by name."""
    from torch.utils._python_dispatch import TorchDispatchMode

    counts: Counter = Counter()

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            counts[func.overloadpacket.__name__] += 1
            return func(*args, **(kwargs or {}))

    with Count():
        runner.step(p)
    return counts


def _stub_triton_launches() -> None:
    """Every `kernel[grid](...)` returns without running (CPU, the triton backend)."""
    from triton.runtime.jit import JITFunction

    def run(self, *args, grid, warmup, **kwargs):
        return None

    JITFunction.run = run  # type: ignore[method-assign]


def _last_sampled() -> int | None:
    try:
        from tokenspeed.worker.plan import LAST_SAMPLED
    except ImportError:
        return None
    return int(LAST_SAMPLED)


def _profiled(runner: ModelRunner, plans: list, sync, top: int, sort: str,
              dump: str | None) -> str:
    prof = cProfile.Profile()
    sync()
    prof.enable()
    for p in plans:
        runner.step(p)
    sync()
    prof.disable()
    if dump:
        prof.dump_stats(dump)
    out = io.StringIO()
    pstats.Stats(prof, stream=out).strip_dirs().sort_stats(sort).print_stats(top)
    return out.getvalue()


def _compare(a: str, b: str, top: int) -> str:
    """Functions whose own time or call count differs most between two dumps, per step."""
    def load(path: str) -> dict[str, tuple[int, float]]:
        """{file(function): (calls, own s)}, without line numbers: they move between versions."""
        out: dict[str, tuple[int, float]] = {}
        for (fn, _, name), (_, nc, tt, _, _) in pstats.Stats(path).strip_dirs().stats.items():  # type: ignore[attr-defined]
            key = f"{fn}({name})" if fn != "~" else name
            calls, own = out.get(key, (0, 0.0))
            out[key] = (calls + nc, own + tt)
        return out

    sa, sb = load(a), load(b)
    rows = []
    for key in set(sa) | set(sb):
        (ca, ta), (cb, tb) = sa.get(key, (0, 0.0)), sb.get(key, (0, 0.0))
        rows.append((tb - ta, ca, cb, ta, tb, key))
    rows.sort(key=lambda r: -abs(r[0]))
    per = 1e3 / PROFILED
    lines = [f"own ms/step A -> B (calls/step A -> B)  function    [A={a}, B={b}]"]
    lines += [f"{ta * per:8.3f} -> {tb * per:8.3f}  ({ca / PROFILED:7.0f} -> {cb / PROFILED:7.0f})  {key}"
              for _, ca, cb, ta, tb, key in rows[:top]]
    ta_all, tb_all = sum(t for _, t in sa.values()), sum(t for _, t in sb.values())
    ca_all, cb_all = sum(c for c, _ in sa.values()), sum(c for c, _ in sb.values())
    lines.append(f"total {ta_all * per:.2f} -> {tb_all * per:.2f} ms/step, calls "
                 f"{ca_all / PROFILED:.0f} -> {cb_all / PROFILED:.0f} per step")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
