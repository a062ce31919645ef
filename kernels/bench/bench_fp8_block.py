"""Block-scaled FP8 GEMM (DeepSeek-V3's 128x128 weight scales) vs bf16 and per-channel FP8 at
DeepSeek-V3's per-GPU dense shapes under TP 8 (GPU only), plus the fused MoE with block-scaled
experts at a decode and a prefill token count.

Implementations (GPU us per call, weights cycled over copies > 5x L2, timed inside CUDA graphs
with bench_kernels.graph_ms as bench_fp8.py does):
  bf16        F.linear (cuBLAS) on the dequantised weight
  chan_fp8    per_token_quant_fp8 + torch._scaled_mm row-wise, fast accumulation (the runtime's
              per-channel W8A8; a different format, for scale)
  block_fp8   per_token_group_quant_fp8 + w8a8_block_matmul (the runtime's block path)
Each block result is checked against the fp32 reference (fp8_block.ref_w8a8_block_matmul).

Run: cd kernels && PYTHONPATH=.:../python python3 bench/bench_fp8_block.py [--ms 1,8,64,512,4096]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench_kernels import graph_ms, rel_err

from tokenspeed_kernels import per_token_quant_fp8
from tokenspeed_kernels.fp8_block import (
    per_token_group_quant_fp8,
    ref_per_token_group_quant_fp8,
    ref_w8a8_block_matmul,
    w8a8_block_matmul,
)
from tokenspeed_kernels.moe import fused_moe, moe_route

FP8 = torch.float8_e4m3fn
BLOCK = (128, 128)
# (name, N, K) per GPU at TP 8: q_a / kv_a replicated, q_b / kv_b / o / dense MLP split.
SHAPES = [("q_a_proj", 1536, 7168), ("kv_a_proj_with_mqa", 576, 7168), ("q_b_proj", 3072, 1536),
          ("o_proj", 7168, 2048), ("dense gate_up", 4608, 7168), ("dense down", 7168, 2304)]  # fmt: skip
COLD_BYTES = 256 << 20


def quantize_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    n, k = w.shape
    rows, cols = -(-n // 128), -(-k // 128)
    padded = F.pad(w.float(), (0, cols * 128 - k, 0, rows * 128 - n))
    scale = padded.view(rows, 128, cols, 128).abs().amax(dim=(1, 3)).clamp_min(1e-12) / 448.0
    full = scale.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
    return (w.float() / full).clamp(-448, 448).to(FP8), scale


def bench_dense(name: str, n: int, k: int, ms: list[int]) -> None:
    copies = max(2, COLD_BYTES // (n * k) + 1)
    ws = [quantize_blocks(torch.randn(n, k, device="cuda") * 0.02) for _ in range(copies)]
    bf = [(q.float() * s.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]).bfloat16()
          for q, s in ws]
    chan = [(b.float().abs().amax(1) / 448.0) for b in bf]
    chan = [((b.float() / c[:, None]).to(FP8), c) for b, c in zip(bf, chan)]
    for m in ms:
        _bench_m(name, torch.randn(m, k, device="cuda").bfloat16(), ws, bf, chan)


def _bench_m(name: str, x: torch.Tensor, ws: list, bf: list, chan: list) -> None:
    copies = len(ws)
    xq, xs = ref_per_token_group_quant_fp8(x)
    err = rel_err(w8a8_block_matmul(xq, xs, *ws[0], BLOCK, torch.float32),
                  ref_w8a8_block_matmul(xq, xs, *ws[0], BLOCK, torch.float32))

    def block(i: int) -> object:
        return lambda: w8a8_block_matmul(*per_token_group_quant_fp8(x), *ws[i], BLOCK, torch.bfloat16)

    def scaled(i: int) -> object:
        def f() -> torch.Tensor:
            q, s = per_token_quant_fp8(x)
            return torch._scaled_mm(q, chan[i][0].t(), scale_a=s.view(-1, 1), scale_b=chan[i][1].view(1, -1),
                                    out_dtype=torch.bfloat16, use_fast_accum=True)  # fmt: skip
        return f

    t = {"bf16": graph_ms([(lambda i=i: F.linear(x, bf[i])) for i in range(copies)]),
         "chan_fp8": graph_ms([scaled(i) for i in range(copies)]),
         "block_fp8": graph_ms([block(i) for i in range(copies)])}
    print(f"{name:20s} M={x.shape[0]:5d}  " + "  ".join(f"{a} {v * 1e3:8.1f} us" for a, v in t.items())
          + f"  block rel err {err:.1e}")


def bench_moe(tokens: int, experts: int = 32, top_k: int = 8, hidden: int = 7168, inter: int = 2048) -> None:
    """32 of V3's 256 experts (EP 8's share), top-8 routing over them."""
    w13 = [quantize_blocks(torch.randn(2 * inter, hidden, device="cuda") * 0.02) for _ in range(experts)]
    w2 = [quantize_blocks(torch.randn(hidden, inter, device="cuda") * 0.02) for _ in range(experts)]
    w13q, w13s = (torch.stack(t) for t in zip(*w13))
    w2q, w2s = (torch.stack(t) for t in zip(*w2))
    x = torch.randn(tokens, hidden, device="cuda").bfloat16()
    weights, ids = moe_route(torch.randn(tokens, experts, device="cuda"), top_k, True)
    ms = graph_ms([lambda: fused_moe(x, w13q, w2q, weights, ids, w13_scale=w13s, w2_scale=w2s)])
    print(f"fused_moe block fp8  T={tokens:5d}  {ms * 1e3:8.1f} us ({experts} experts, top-{top_k})")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", default="1,8,64,512,4096")
    args = ap.parse_args()
    ms = [int(m) for m in args.ms.split(",")]
    for name, n, k in SHAPES:
        bench_dense(name, n, k, ms)
    for tokens in (8, 512):
        bench_moe(tokens)


if __name__ == "__main__":
    main()
