"""The bf16 GEMMs of a Llama-3.1-8B layer at decode batch sizes, launched eagerly and replayed in a
CUDA graph: does cuBLAS pick slower kernels under capture, or for padded row counts? (S1's decode
steps at 820 requests spent 15.5 ms in GEMMs eager and 18.8 ms in an 832-row decode graph.)

    python3 benches/diagnostics/gemm_graph_vs_eager.py [--rows 820,832,896] [--reps 50]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}


def timed(fn: Callable[[], object], reps: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return 1e3 * start.elapsed_time(end) / reps  # us


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="820,832,896")
    ap.add_argument("--reps", type=int, default=50)
    args = ap.parse_args()
    dev = torch.device("cuda")
    print("| rows | GEMM | eager us | graph us | graph/eager |\n|---|---|---|---|---|")
    for rows in [int(r) for r in args.rows.split(",")]:
        for name, (k, n) in SHAPES.items():
            x = torch.randn(rows, k, device=dev, dtype=torch.bfloat16)
            w = torch.randn(n, k, device=dev, dtype=torch.bfloat16)
            out = torch.empty(rows, n, device=dev, dtype=torch.bfloat16)

            def gemm(x: torch.Tensor = x, w: torch.Tensor = w, out: torch.Tensor = out) -> None:
                torch.mm(x, w.t(), out=out)  # F.linear's GEMM (weight transposed)

            eager = timed(gemm, args.reps)
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                gemm()
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                for _ in range(10):
                    gemm()
            replay = timed(graph.replay, max(1, args.reps // 10)) / 10
            print(f"| {rows} | {name} | {eager:.1f} | {replay:.1f} | {replay / eager:.2f} |",
                  flush=True)


if __name__ == "__main__":
    main()
