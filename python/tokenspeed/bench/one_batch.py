"""`tokenspeed bench one-batch`: a static batch straight through ModelRunner (no server): prefill and decode latency."""

from __future__ import annotations

import argparse
import datetime
import json
import math
import statistics
import sys
import time
from collections.abc import Callable

import numpy as np

from tokenspeed.worker.plan import StepPlan


def median_wall_ms(fn: Callable[[], object], reps: int, sync: Callable[[], None]) -> float:
    """Median wall time of `fn` over `reps` runs, in ms, each between two `sync`s (a device's
    synchronize, so queued GPU work counts)."""
    times = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tokenspeed bench one-batch",
                                description="Static batch through tokenspeed.worker.model_runner.ModelRunner: one "
                                            "prefill of batch x input-len tokens, then output-len - 1 decode "
                                            "steps, greedy. Reports the median over --num-runs after a "
                                            "warm-up run of the same shape.")
    p.add_argument("--model-path", required=True, help="HF model dir (config.json [+ weights])")
    p.add_argument("--load-format", default="auto", help="auto, safetensors, gguf, dummy (default auto)")
    p.add_argument("--dtype", default="auto", help="auto, bfloat16, float16, float32 (default auto)")
    p.add_argument("--device", default="auto", help="auto (cuda if available), cuda, cpu")
    p.add_argument("--batch-size", type=int, nargs="+", default=[1, 8, 64], help="(default 1 8 64)")
    p.add_argument("--input-len", type=int, default=1024, help="(default 1024)")
    p.add_argument("--output-len", type=int, default=16, help="tokens per request, >= 1 (default 16)")
    p.add_argument("--page-size", type=int, default=16, help="(default 16)")
    p.add_argument("--num-runs", type=int, default=3, help="timed runs per batch size (default 3)")
    p.add_argument("--attention-backend", default=None, help="(default: ModelRunner's)")
    p.add_argument("--quantization", default=None, help="fp8: FP8 weights (default: as the checkpoint)")
    p.add_argument("--kv-cache-dtype", default="auto", help="auto, fp8, fp8_e4m3, fp8_e5m2 (default auto)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-file", help="append one JSON line per batch size")
    return p


def prefill_plan(step_id: int, prompts: list[list[int]], pages_per_slot: int,
                 finished: list[int]) -> StepPlan:
    """New greedy requests in slots 0..n-1, each with pages [slot*pps, (slot+1)*pps), whole
    prompts, sampled."""
    n = len(prompts)
    return StepPlan.build(
        step_id, finished=finished, new=[{"slot": i, "temperature": 0.0} for i in range(n)],
        page_tables=[(i, 0, range(i * pages_per_slot, (i + 1) * pages_per_slot)) for i in range(n)],
        scheduled=[(i, 0, p, True) for i, p in enumerate(prompts)])


def decode_plan(step_id: int, last_tokens: np.ndarray, pos: int) -> StepPlan:
    """One token for every slot 0..n-1 at position `pos`."""
    return StepPlan.build(step_id, scheduled=[(i, pos, [int(t)], True)
                                              for i, t in enumerate(last_tokens)])


class BatchRun:
    """Runs static batches on one runner; `sync` waits for the device (torch.cuda.synchronize)."""

    def __init__(self, runner: object, sync: Callable[[], None], pages_per_slot: int) -> None:
        self.runner = runner
        self.sync = sync
        self.pages_per_slot = pages_per_slot
        self.step_id = 0
        self.live: list[int] = []  # slots to finish in the next prefill

    def _timed(self, plan: StepPlan) -> tuple[float, np.ndarray]:
        self.sync()
        t0 = time.perf_counter()
        out = self.runner.step(plan)  # type: ignore[attr-defined]
        self.sync()
        self.step_id += 1
        return time.perf_counter() - t0, np.asarray(out.tokens)

    def run(self, prompts: list[list[int]], output_len: int) -> tuple[float, list[float], np.ndarray]:
        """(prefill seconds, decode step seconds, generated tokens [batch, output_len])."""
        plan = prefill_plan(self.step_id, prompts, self.pages_per_slot, self.live)
        self.live = list(range(len(prompts)))
        prefill_s, tokens = self._timed(plan)
        generated = [tokens]
        steps = []
        for t in range(output_len - 1):
            dt, tokens = self._timed(decode_plan(self.step_id, tokens, len(prompts[0]) + t))
            steps.append(dt)
            generated.append(tokens)
        return prefill_s, steps, np.stack(generated, axis=1)


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if args.output_len < 1 or args.input_len < 1:
        raise SystemExit("tokenspeed bench one-batch: --input-len and --output-len must be >= 1")
    import torch

    from tokenspeed.worker.model_runner import ModelRunner

    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    on_cuda = device.startswith("cuda")
    context = args.input_len + args.output_len
    pages_per_slot = -(-context // args.page_size)
    max_bs = max(args.batch_size)
    kwargs: dict = {}
    if args.attention_backend:
        kwargs["attention_backend"] = args.attention_backend
    kwargs["quantization"], kwargs["kv_cache_dtype"] = args.quantization, args.kv_cache_dtype
    t0 = time.perf_counter()
    runner = ModelRunner(args.model_path, dtype=args.dtype, device=device, load_format=args.load_format,
                         page_size=args.page_size, num_pages=max_bs * pages_per_slot, max_slots=max_bs,
                         max_context_len=context, seed=args.seed, **kwargs)
    load_s = time.perf_counter() - t0
    gpu = torch.cuda.get_device_name(runner.device) if on_cuda else None
    print(f"model {args.model_path} ({args.load_format}) on {device}{f' ({gpu})' if gpu else ''}, "
          f"dtype {runner.dtype}, loaded in {load_s:.1f} s; input {args.input_len}, output {args.output_len}, "
          f"page size {args.page_size}")
    sync = torch.cuda.synchronize if on_cuda else (lambda: None)
    bench = BatchRun(runner, sync, pages_per_slot)
    rng = np.random.default_rng(args.seed)
    vocab = int(runner.config.vocab_size)
    header = (f"{'batch':>6} {'prefill ms':>11} {'prefill tok/s':>14} {'decode ms/step':>15} "
              f"{'p90 ms/step':>12} {'decode tok/s':>13}")
    print(header)
    for bs in args.batch_size:
        prompts = [rng.integers(0, vocab, size=args.input_len).tolist() for _ in range(bs)]
        bench.run(prompts, args.output_len)  # warm-up: same shapes
        prefills: list[float] = []
        steps: list[float] = []
        for _ in range(max(1, args.num_runs)):
            p, s, _tokens = bench.run(prompts, args.output_len)
            prefills.append(p)
            steps.extend(s)
        pre, dec = _median(prefills), _median(steps)
        p90 = float(np.percentile(steps, 90)) if steps else float("nan")
        row = {"batch_size": bs, "prefill_ms": pre * 1e3, "prefill_tok_s": bs * args.input_len / pre,
               "decode_step_ms": dec * 1e3, "decode_step_p90_ms": p90 * 1e3,
               "decode_tok_s": bs / dec if steps else float("nan"), "num_runs": args.num_runs,
               "decode_steps_timed": len(steps)}
        print(f"{bs:>6} {row['prefill_ms']:>11.2f} {row['prefill_tok_s']:>14.1f} {row['decode_step_ms']:>15.3f} "
              f"{row['decode_step_p90_ms']:>12.3f} {row['decode_tok_s']:>13.1f}")
        sys.stdout.flush()
        if args.output_file:
            record = {"bench": "one-batch",
                      "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                      "argv": ["tokenspeed", "bench", "one-batch", *argv], "model_path": args.model_path,
                      "load_format": args.load_format, "dtype": str(runner.dtype), "device": device, "gpu": gpu,
                      "input_len": args.input_len, "output_len": args.output_len, "page_size": args.page_size,
                      **{k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in row.items()}}
            with open(args.output_file, "a") as f:
                f.write(json.dumps(record) + "\n")
    return 0
