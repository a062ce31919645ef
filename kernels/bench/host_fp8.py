"""Host launch time per call of the FP8 linear's pieces (GPU only): what an eager step (S1's mixed
steps are eager, > 64 requests) pays on the CPU for each GEMM, as opposed to the GPU time
bench_fp8.py measures inside CUDA graphs. Session 21: with fast accumulation the served mixed
step became host-bound (launch 52.8 vs 29.5 ms median), and this tells which piece costs it.

Each piece is launched CALLS times back to back without synchronising (fewer than the launch
queue holds), timed on the host, median of REPS.

Run: cd kernels && PYTHONPATH=.:../python python3 bench/host_fp8.py [--m 454]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from tokenspeed_kernels import per_token_quant_fp8
from tokenspeed_kernels.fp8_gemm import ref_per_token_quant_fp8

CALLS = 64
REPS = 7


def host_us(fn: Callable[[], object]) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(REPS):
        t0 = time.perf_counter()
        for _ in range(CALLS):
            fn()
        times.append((time.perf_counter() - t0) / CALLS * 1e6)
        torch.cuda.synchronize()
    return statistics.median(times)


def pieces(m: int, n: int, k: int) -> dict[str, Callable[[], object]]:
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    wq, ws = ref_per_token_quant_fp8(torch.randn(n, k, device="cuda") * k**-0.5)
    wb = wq.to(torch.bfloat16)
    xq, xs = per_token_quant_fp8(x)

    def mm(fast: bool) -> torch.Tensor:
        return torch._scaled_mm(xq, wq.t(), scale_a=xs.view(-1, 1), scale_b=ws.view(1, -1),
                                out_dtype=torch.bfloat16, use_fast_accum=fast)

    return {"quant": lambda: per_token_quant_fp8(x), "mm_promote": lambda: mm(False),
            "mm_fast": lambda: mm(True), "bf16_linear": lambda: torch.nn.functional.linear(x, wb)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--m", type=int, default=454)
    args = ap.parse_args()
    m = args.m
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, M={m}, host us per call")
    for n, k in ((6144, 4096), (4096, 14336)):
        print(f"| {n}x{k} | " + " | ".join(f"{name} {host_us(fn):.1f}" for name, fn in pieces(m, n, k).items())
              + " |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
