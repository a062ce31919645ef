"""Multi-LoRA per-token path (the one decode CUDA graphs capture): old vs new, per decoder layer.

Llama-3.1-8B layer (qkv 6144x4096, o 4096x4096, gate_up 28672x4096, down 4096x14336), bf16, a
pool of --slots adapters of rank --rank on all four fused projections, T tokens (batch 1 and
32; token t on slot t % slots, so batch 32 mixes every adapter):

* base:   the base GEMM alone (skinny_linear at T <= 8, cuBLAS above: layers/linear.linear).
* old:    base GEMM + bgmv_shrink + bgmv_expand per projection (2 LoRA launches each).
* new:    one GEMM over the stacked [W; A_0; ..; A_{S-1}] + bgmv_merge (1 LoRA launch each).
* old0 / new0: the same with every token on the base model (slot -1): what a LoRA-enabled
  server costs requests without an adapter inside a graph.

Per row: GPU us per layer (inside one CUDA graph of many back-to-back layers cycling over
weight copies >= COLD_BYTES, so weights come from DRAM), x 32 = the step's LoRA share, kernel
launches per layer (torch.profiler, one eager layer), and new's error vs old.

Run (GPU): cd kernels && PYTHONPATH=. python3 bench/bench_lora.py [--out rows.jsonl]
CPU (TRITON_INTERPRET=1, tiny shapes, correctness of old vs new only): --check
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

LAYERS = 32
# (name, K, sub-projection output sizes): one Llama-3.1-8B decoder layer.
LAYER = [("qkv", 4096, [4096, 1024, 1024]), ("o_proj", 4096, [4096]),
         ("gate_up", 4096, [14336, 14336]), ("down", 14336, [4096])]  # fmt: skip
TINY = [("qkv", 64, [64, 32, 32]), ("o_proj", 64, [64]), ("gate_up", 64, [96, 96]),
        ("down", 96, [64])]  # fmt: skip
COLD_BYTES = 768 << 20
SKINNY_MAX_ROWS = 8  # as tokenspeed.layers.linear: the Triton GEMV up to this many rows


def base_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    if x.is_cuda and x.shape[0] <= SKINNY_MAX_ROWS:
        from tokenspeed_kernels import skinny_linear

        return skinny_linear(x, w)
    return F.linear(x, w)


class Proj:
    """One projection's weights, stacked ([W; A] with W and A views of it) as the pool keeps
    them when stack_base accepts the layer, and B."""

    def __init__(self, k: int, subs: list[int], slots: int, rank: int, dtype: torch.dtype,
                 device: str, gen: torch.Generator) -> None:
        out, n = sum(subs), len(subs) * rank
        self.stacked = (torch.randn(out + slots * n, k, generator=gen) / k**0.5).to(dtype).to(device)
        self.w = self.stacked[:out]
        self.a = self.stacked[out:].view(slots, n, k)
        self.b = (torch.randn(slots, out, rank, generator=gen) / rank**0.5).to(dtype).to(device)
        self.offsets = tuple(int(v) for v in torch.tensor(subs[:-1]).cumsum(0).tolist())
        self.rank = rank


def old_proj(p: Proj, x: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    from tokenspeed_kernels.lora import bgmv_expand, bgmv_shrink

    y = base_linear(x, p.w)
    return bgmv_expand(bgmv_shrink(x, p.a, slots), p.b, slots, y, p.offsets, p.rank)


def new_proj(p: Proj, x: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    from tokenspeed_kernels.lora import bgmv_merge

    return bgmv_merge(base_linear(x, p.stacked), p.b, slots, p.offsets, p.rank)


def layer_fn(mode: str, projs: list[Proj], xs: list[torch.Tensor],
             slots: torch.Tensor) -> Callable[[], list[torch.Tensor]]:
    """The four projections of one layer (independent inputs: the attention and MLP between
    them are not what is measured)."""
    if mode == "base":
        return lambda: [base_linear(x, p.w) for p, x in zip(projs, xs)]
    proj = old_proj if mode.startswith("old") else new_proj
    return lambda: [proj(p, x, slots) for p, x in zip(projs, xs)]


def kernels_per_layer(fn: Callable[[], Any]) -> int | None:
    """CUDA kernels one eager layer launches (memcpy/memset not counted)."""
    try:
        from torch.profiler import ProfilerActivity, profile

        fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        return sum(1 for n in names if "memcpy" not in n.lower() and "memset" not in n.lower())
    except (RuntimeError, AttributeError) as e:  # a nicety: the timing is the result
        print(f"# kernel count unavailable: {e}")
        return None


def setup(shapes: list, t: int, slots: int, rank: int, dtype: torch.dtype, device: str,
          copies: int) -> tuple[list[list[Proj]], list[torch.Tensor], dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    layers = [[Proj(k, subs, slots, rank, dtype, device, gen) for _, k, subs in shapes]
              for _ in range(copies)]
    xs = [torch.randn(t, k, generator=gen).to(dtype).to(device) for _, k, _ in shapes]
    on = torch.full((t + 16,), -1, dtype=torch.int32, device=device)
    on[:t] = torch.arange(t, dtype=torch.int32, device=device) % slots
    off = torch.full((t + 16,), -1, dtype=torch.int32, device=device)
    return layers, xs, {"old": on, "new": on, "old0": off, "new0": off, "base": off}


def check(shapes: list, t: int, slots: int, rank: int, dtype: torch.dtype, device: str) -> float:
    """new vs old, every projection: the largest error relative to the output's scale."""
    layers, xs, tok = setup(shapes, t, slots, rank, dtype, device, 1)
    old = layer_fn("old", layers[0], xs, tok["old"])()
    new = layer_fn("new", layers[0], xs, tok["new"])()
    base = layer_fn("base", layers[0], xs, tok["base"])()
    worst = 0.0
    for o, n, b in zip(old, new, base):
        worst = max(worst, ((n.float() - o.float()).abs().max() / o.float().abs().max()).item())
        assert not torch.allclose(o.float(), b.float()), "the adapters change the output"
    return worst


def run(args: argparse.Namespace, dtype: torch.dtype) -> list[dict[str, Any]]:
    from bench_kernels import graph_ms

    rows = []
    layer_bytes = sum((sum(s) + args.slots * len(s) * args.rank) * k * 2 for _, k, s in LAYER)
    copies = max(2, -(-COLD_BYTES // layer_bytes))
    for t in args.batches:
        layers, xs, tok = setup(LAYER, t, args.slots, args.rank, dtype, "cuda", copies)
        err = check(LAYER, t, args.slots, args.rank, dtype, "cuda")
        base_us = None
        for mode in ("base", "old", "new", "old0", "new0"):
            fns = [layer_fn(mode, projs, xs, tok[mode]) for projs in layers]
            us = graph_ms(fns, calls=4 * copies) * 1e3
            base_us = us if mode == "base" else base_us
            row = {"T": t, "mode": mode, "us_per_layer": round(us, 2),
                   "lora_us_per_step": round((us - base_us) * LAYERS, 1),
                   "kernels_per_layer": kernels_per_layer(fns[0]),
                   "new_vs_old_err": err if mode == "new" else None}
            rows.append(row)
            print(f"T={t:3d} {mode:5s} {us:8.2f} us/layer  LoRA {row['lora_us_per_step']:7.1f} "
                  f"us/step  kernels/layer {row['kernels_per_layer']}")
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="JSON lines output path")
    ap.add_argument("--batches", default="1,32", type=lambda s: [int(v) for v in s.split(",")])
    ap.add_argument("--slots", type=int, default=8, help="--max-loras-per-batch")
    ap.add_argument("--rank", type=int, default=16, help="--max-lora-rank")
    ap.add_argument("--check", action="store_true", help="tiny shapes, old vs new only (CPU ok)")
    args = ap.parse_args()
    if args.check or not torch.cuda.is_available():
        if not torch.cuda.is_available():
            os.environ.setdefault("TRITON_INTERPRET", "1")
        device = "cuda" if torch.cuda.is_available() else "cpu"
        for t in args.batches:
            err = check(TINY, t, args.slots, 4, torch.float32, device)
            print(f"T={t}: new vs old max rel err {err:.2e}")
            assert err < 1e-4, err
        return 0
    torch.manual_seed(0)
    print(f"# {torch.cuda.get_device_name()} torch {torch.__version__}; {args.slots} slots of "
          f"rank {args.rank}; GPU us per layer in a CUDA graph, weights L2-cold")
    rows = run(args, torch.bfloat16)
    if args.out:
        with open(args.out, "a") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
