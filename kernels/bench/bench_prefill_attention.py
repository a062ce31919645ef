"""Causal prefill attention (fresh prompts, no cached prefix) at Llama-3.1-8B shapes: the paged
extend kernel and `prefill_attention` (K/V read with TMA from contiguous or QKV-strided rows) at
their defaults and other tile configs, against torch's SDPA backends (cuDNN, flash, efficient) on
the same q/k/v, GPU only. Prints TF/s (4 * D * Hq * attended pairs / time) and each
output's relative error against torch's math backend (fp32 softmax of the bf16 inputs).

    python3 bench/bench_prefill_attention.py [--tokens 1024,4096] [--configs 128x64x8x3,...]
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import tokenspeed_kernels as tk
from tokenspeed_kernels.extend_attention import extend_config

HQ, HKV, D, PAGE = 32, 8, 128, 16


def parse_config(spec: str) -> tuple[int, int, int, int]:
    m, n, w, s = (int(x) for x in spec.split("x"))
    return m, n, w, s


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1024,4096")
    ap.add_argument("--requests", type=int, default=1, help="prompts of --tokens each, one launch")
    ap.add_argument("--configs", default="128x64x8x3,128x128x8x3,128x64x4x3,64x64x4x3,128x32x4x3",
                    help="extend (BLOCK_M x BLOCK_N x warps x stages) besides the default")
    ap.add_argument("--prefill-configs", default="128x128x8x2,128x64x8x3,128x64x4x3,64x64x4x3",
                    help="prefill_attention (contiguous K/V, TMA) configs besides its default")
    args = ap.parse_args()
    dev = torch.device("cuda")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, cudnn "
          f"{torch.backends.cudnn.version()}")
    print("| tokens | kernel | us | TF/s | rel err |\n|---|---|---|---|---|")
    configs = [parse_config(c) for c in args.configs.split(",") if c]
    prefill_configs = [parse_config(c) for c in args.prefill_configs.split(",") if c]
    for n in (int(x) for x in args.tokens.split(",")):
        bench(n, args.requests, configs, prefill_configs, dev)


def bench(n: int, b: int, configs: list[tuple[int, int, int, int]],
          prefill_configs: list[tuple[int, int, int, int]], dev: torch.device) -> None:
    """One row per kernel for b prompts of n tokens."""
    total = b * n
    torch.manual_seed(0)
    q = torch.randn(total, HQ, D, device=dev, dtype=torch.bfloat16)
    k = torch.randn(total, HKV, D, device=dev, dtype=torch.bfloat16)
    v = torch.randn(total, HKV, D, device=dev, dtype=torch.bfloat16)
    pages = -(-n // PAGE)
    k_cache = torch.zeros(b * pages, PAGE, HKV, D, device=dev, dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    for r in range(b):  # request r's pages are r*pages..: its tokens in order
        kc = k_cache[r * pages:(r + 1) * pages].view(-1, HKV, D)
        kc[:n] = k[r * n:(r + 1) * n]
        v_cache[r * pages:(r + 1) * pages].view(-1, HKV, D)[:n] = v[r * n:(r + 1) * n]
    page_table = torch.arange(b * pages, device=dev, dtype=torch.int32).view(b, pages)
    starts = torch.arange(0, total + 1, n, device=dev, dtype=torch.int32)
    prefix = torch.zeros(b, device=dev, dtype=torch.int32)
    lens = torch.full((b,), n, device=dev, dtype=torch.int32)
    scale = D ** -0.5
    flops = 4.0 * D * HQ * b * n * (n + 1) / 2
    qb = q.view(b, n, HQ, D).transpose(1, 2)  # [B, H, T, D] views of the [T, H, D] rows
    kb = k.view(b, n, HKV, D).transpose(1, 2)
    vb = v.view(b, n, HKV, D).transpose(1, 2)
    kx = kb.repeat_interleave(HQ // HKV, dim=1)
    vx = vb.repeat_interleave(HQ // HKV, dim=1)

    runs: dict[str, Callable[[], torch.Tensor]] = {}
    for name, backend in (("sdpa math", SDPBackend.MATH),  # the reference: first to run
                          ("sdpa cudnn", SDPBackend.CUDNN_ATTENTION),
                          ("sdpa flash", SDPBackend.FLASH_ATTENTION),
                          ("sdpa efficient", SDPBackend.EFFICIENT_ATTENTION)):
        def gqa(backend: SDPBackend = backend) -> torch.Tensor:
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, scale=scale,
                                                      enable_gqa=True)

        def expanded(backend: SDPBackend = backend) -> torch.Tensor:
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(qb, kx, vx, is_causal=True, scale=scale)

        runs[f"{name} (enable_gqa)"] = gqa
        runs[f"{name} (K/V repeated)"] = expanded
    out = torch.empty_like(q)
    for cfg in [None, *configs]:
        def ours(cfg: tuple[int, int, int, int] | None = cfg) -> torch.Tensor:
            tk.paged_extend_attention(q, k_cache, v_cache, page_table, starts, prefix, lens,
                                      scale, out=out, max_new_tokens=n, config=cfg)
            return out.view(b, n, HQ, D).transpose(1, 2)

        label = "x".join(map(str, cfg)) if cfg else "default " + "x".join(
            map(str, extend_config(torch.bfloat16, D, device=dev)))
        runs[f"paged extend {label}"] = ours
    # The same q/k/v as strided views of one fused QKV row per token, as the model has them.
    qkv = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], dim=1)
    qv, kv, vv = (t.view(total, -1, D) for t in qkv.split([HQ * D, HKV * D, HKV * D], dim=1))
    if tk.prefill_supported(dev, q.dtype, D):
        for cfg in [None, *prefill_configs]:
            def fresh(cfg: tuple[int, int, int, int] | None = cfg, views: bool = False) -> torch.Tensor:
                tk.prefill_attention(*((qv, kv, vv) if views else (q, k, v)), starts, scale, n,
                                     out=out, config=cfg)
                return out.view(b, n, HQ, D).transpose(1, 2)

            label = "x".join(map(str, cfg or tk.prefill_config(D)))
            runs[f"prefill tma {label}"] = fresh
            if cfg is None:
                runs[f"prefill tma {label} (qkv views)"] = functools.partial(fresh, views=True)
    reference = None
    for name, fn in runs.items():
        try:
            res = fn().float()
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001  (a backend that refuses the shape)
            print(f"| {n} x{b} | {name} | - | - | {type(e).__name__}: {str(e)[:80]} |")
            continue
        if reference is None:
            reference = res
        err = rel_err(res, reference)
        ms = do_bench(fn, warmup=10, rep=50, return_mode="median")
        print(f"| {n} x{b} | {name} | {ms * 1e3:.0f} | {flops / ms / 1e9:.0f} | {err:.1e} |",
              flush=True)


if __name__ == "__main__":
    main()
