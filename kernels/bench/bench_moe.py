"""fused_moe (route → align → grouped gate_up GEMM with SiLU-and-mul → grouped down GEMM → combine) at
the Qwen3-30B-A3B expert shape (hidden 2048, 128 experts, top-8, moe_intermediate 768; 48 MoE layers),
bf16, against its roofline, and its error against the fp32 torch reference at the same shapes (GPU only).

Roofline per call = max(bytes / copy bandwidth, FLOPs / bf16 matmul peak), both ceilings measured at
start on the device in hand (copy counts read + write, so a read-mostly kernel can exceed 100%):
  bytes = (experts that receive a token) x (gate_up + down weights of one expert) + activations
          (x read, intermediate written and read, per-assignment down output written and read, out)
  FLOPs = 6 x tokens x top_k x hidden x intermediate   (2 GEMMs of 2 * I and I columns, 2 flop / MAC)
Decode (1..64 tokens) is weight-bandwidth bound: 8 tokens x top-8 touch ~50 of 128 experts.

Timing: GPU time per call inside a CUDA graph of back-to-back calls (the way decode steps run),
cycling over 2 weight copies (2 x 1.2 GB >> 50 MB L2) and 4 routings, so weights come from DRAM.
"48 layers" = the per-call time x 48: the MoE share of one Qwen3-30B-A3B forward step.

Run: cd kernels && PYTHONPATH=.:../python python3 bench/bench_moe.py [--out rows.jsonl]
Prints one row per token count as it goes, the table last. About 1 minute on an H100.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench_gemv import copy_tbps
from bench_kernels import eager_ms, graph_ms, rel_err

from tokenspeed_kernels.moe import fused_moe, moe_route, pick_config
from tokenspeed_kernels.reference import ref_fused_moe

HIDDEN, EXPERTS, TOP_K, INTER, LAYERS = 2048, 128, 8, 768, 48
TOKENS = (1, 8, 64, 256, 2048)
TOL_BF16 = 2e-2


def bf16_tflops() -> float:
    """cuBLAS bf16 GEMM rate at 8192^3: the practical tensor-core ceiling."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    return 2 * 8192**3 / eager_ms(lambda: a @ b) / 1e9


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None, help="write the rows as JSON lines here")
    a = p.parse_args()
    t_start = time.monotonic()
    torch.manual_seed(0)
    dev = torch.device("cuda")
    copy, mma = copy_tbps(), bf16_tflops()
    print(f"{torch.cuda.get_device_name()}: copy {copy:.2f} TB/s, bf16 GEMM {mma:.0f} TF/s", flush=True)
    dt = torch.bfloat16
    es = 2
    # Two weight copies so back-to-back calls never find the experts in L2.
    weights = [(torch.randn(EXPERTS, 2 * INTER, HIDDEN, device=dev, dtype=dt) * HIDDEN**-0.5,
                torch.randn(EXPERTS, HIDDEN, INTER, device=dev, dtype=dt) * INTER**-0.5) for _ in range(2)]
    expert_bytes = 3 * INTER * HIDDEN * es
    rows = []
    for tokens in TOKENS:
        xs = [torch.randn(tokens, HIDDEN, device=dev, dtype=dt) for _ in range(4)]
        logits = [torch.randn(tokens, EXPERTS, device=dev, dtype=dt) for _ in range(4)]
        # Correctness: bf16 kernel vs the fp32 reference on the same bf16 inputs.
        w13, w2 = weights[0]
        route = moe_route(logits[0], TOP_K, True)
        out = fused_moe(xs[0], w13, w2, *route)
        err = rel_err(out, ref_fused_moe(xs[0], w13, w2, *route, dtype=torch.float32))

        def call(i: int, xs: list[torch.Tensor] = xs, logits: list[torch.Tensor] = logits) -> None:
            """One MoE layer as the model runs it: route, then the fused experts."""
            w13, w2 = weights[i % 2]
            fused_moe(xs[i % 4], w13, w2, *moe_route(logits[i % 4], TOP_K, True))

        ms = graph_ms([lambda i=i: call(i) for i in range(8)], calls=32 if tokens >= 256 else 64)
        del out
        touched = sum(len(torch.unique(moe_route(lg, TOP_K, True)[1])) for lg in logits) / 4
        n = tokens * TOP_K
        act_bytes = (tokens * HIDDEN + 2 * n * INTER + 2 * n * HIDDEN + tokens * HIDDEN) * es
        nbytes = touched * expert_bytes + act_bytes
        flops = 6 * n * HIDDEN * INTER
        t_bw, t_mma = nbytes / (copy * 1e9), flops / (mma * 1e9)
        roof = max(t_bw, t_mma)
        cfg = pick_config(n, EXPERTS)
        row = {"tokens": tokens, "graph_us": ms * 1e3, "experts_touched": touched, "GB": nbytes / 1e9,
               "TB_s": nbytes / ms / 1e9, "TF_s": flops / ms / 1e9, "roofline_us": roof * 1e3,
               "bound": "memory" if t_bw >= t_mma else "compute", "pct_roofline": 100 * roof / ms,
               "layers48_ms": ms * LAYERS, "rel_err": err, "ok": err < TOL_BF16,
               "config": f"BM{cfg.block_m} BN{cfg.block_n} BK{cfg.block_k} w{cfg.num_warps} s{cfg.num_stages}"}
        rows.append(row)
        print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    print(f"\nfused_moe, Qwen3-30B-A3B experts (H {HIDDEN}, E {EXPERTS}, top-{TOP_K}, I {INTER}), bf16, "
          f"{torch.cuda.get_device_name()}; ceilings: copy {copy:.2f} TB/s, bf16 {mma:.0f} TF/s; "
          f"{time.monotonic() - t_start:.0f} s")
    print("| tokens | experts hit | us/call (graph) | roofline us | % roofline | TB/s | TF/s | x48 layers ms "
          "| rel err vs fp32 | config |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['tokens']} | {r['experts_touched']:.0f} | {r['graph_us']:.1f} | {r['roofline_us']:.1f} "
              f"({r['bound']}) | {r['pct_roofline']:.0f}% | {r['TB_s']:.2f} | {r['TF_s']:.0f} | "
              f"{r['layers48_ms']:.2f} | {r['rel_err']:.1e}{'' if r['ok'] else ' FAIL'} | {r['config']} |")
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
