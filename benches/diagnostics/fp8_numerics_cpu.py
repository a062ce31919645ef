#!/usr/bin/env python3
"""FP8 numerics of the dummy Llama-3.1-8B-shaped model, simulated on the CPU in fp32 (no kernels).

Builds a Llama with TokenSpeed's dummy-weight statistics (weights N(0, 0.02), norms 1: see
weights.init_dummy_weights; not the same draws) and runs it teacher-forced in fp32 on random
tokens, once exactly and once per variant, where a variant rounds the K/V that a cache would hold
(after RoPE) and/or the linear weights through torch's float8 dtypes (quantise -> dequantise):

  bf16 KV / bf16 weights    the bf16 rounding, for scale
  fp8 KV (scale 1)          e4m3, what `--kv-cache-dtype fp8` stores without calibrated scales
  fp8 KV (dynamic scale)    e4m3 with a per-layer per-tensor scale amax/448 (vLLM's
                            --calculate-kv-scales): if the K/V sat in e4m3's subnormal range this
                            would be far better than scale 1
  fp8_e5m2 KV               2 mantissa bits, 8x e4m3's range: worse if rounding is the cause,
                            better if range (subnormals) is
  fp8 weights               e4m3, one scale per output channel (what --quantization fp8 does)

Per layer it prints the K/V magnitudes and the share below e4m3's smallest normal (2^-6) and below
half its smallest subnormal (2^-10, flushed to 0 at scale 1). Per variant: greedy agreement with
the exact model, logits cosine, error std, and the margin analysis that says whether the model is
degenerate: the reference's top-1 minus top-2 logit gap, and agreement restricted to positions whose
gap exceeds 3x the variant's error std ("non-tie positions").

Run: python3 benches/diagnostics/fp8_numerics_cpu.py [--layers 4] [--seqs 2 --seq-len 128] [--small]
(the full 8B shapes take ~2 min on 2 cores and ~3 GB; --init vllm: uniform(-1e-3, 1e-3) everywhere,
norms included, as vLLM/SGLang's dummy loader does.)
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FULL = {"hidden": 4096, "heads": 32, "kv_heads": 8, "head_dim": 128, "ffn": 14336, "vocab": 128256}
SMALL = {"hidden": 512, "heads": 8, "kv_heads": 2, "head_dim": 64, "ffn": 1536, "vocab": 16000}


def fp8_round(x: torch.Tensor, dtype: torch.dtype, scale: float | torch.Tensor = 1.0) -> torch.Tensor:
    """Quantise x / scale to dtype (clamped to its finite range), dequantise."""
    m = torch.finfo(dtype).max
    return (x / scale).clamp(-m, m).to(dtype).float() * scale


def per_channel_fp8(w: torch.Tensor) -> torch.Tensor:
    s = w.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / torch.finfo(E4M3).max
    return fp8_round(w, E4M3, s)


KV_ROUND: dict[str, Callable[[torch.Tensor], torch.Tensor] | None] = {
    "exact": None,
    "bf16 KV": lambda t: t.bfloat16().float(),
    "fp8 KV (scale 1)": lambda t: fp8_round(t, E4M3),
    "fp8 KV (dynamic scale)": lambda t: fp8_round(t, E4M3, t.abs().amax().clamp_min(1e-12) / 448.0),
    "fp8_e5m2 KV (scale 1)": lambda t: fp8_round(t, E5M2),
}
W_ROUND: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "bf16 weights": lambda w: w.bfloat16().float(),
    "fp8 weights": per_channel_fp8,
}
VARIANTS = [*KV_ROUND, *W_ROUND, "fp8 weights + fp8 KV"]


class Init:
    def __init__(self, kind: str, seed: int) -> None:
        self.kind, self.seed, self.count = kind, seed, 0

    def __call__(self, *shape: int, norm: bool = False) -> torch.Tensor:
        self.count += 1
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + self.count)
        if self.kind == "vllm":  # vLLM/SGLang dummy: every float parameter uniform(-1e-3, 1e-3)
            return torch.empty(shape).uniform_(-1e-3, 1e-3, generator=gen)
        if norm:
            return torch.ones(shape)
        return torch.empty(shape).normal_(0.0, 0.02, generator=gen)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope(x: torch.Tensor, theta: float = 500000.0) -> torch.Tensor:
    """x [seqs, heads, T, D], rotate-half RoPE."""
    t, d = x.shape[-2], x.shape[-1]
    inv = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = torch.arange(t, dtype=torch.float64)[:, None] * inv[None, :]
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1).float(), torch.cat([ang.sin(), ang.sin()], -1).float()
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def kv_stats(name: str, t: torch.Tensor) -> str:
    a = t.abs()
    return (f"{name} std {t.std().item():.3g} amax {a.max().item():.3g} <2^-6 {(a < 2**-6).float().mean().item():.1%}"
            f" <2^-10 {(a < 2**-10).float().mean().item():.1%}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seqs", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--small", action="store_true", help="a small model (seconds)")
    p.add_argument("--init", choices=["tokenspeed", "vllm"], default="tokenspeed")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    torch.manual_seed(a.seed)
    c = SMALL if a.small else FULL
    hid, nh, nkv, hd, ffn, vocab = (c[k] for k in ("hidden", "heads", "kv_heads", "head_dim", "ffn", "vocab"))
    init = Init(a.init, a.seed)
    t0 = time.monotonic()
    tokens = torch.randint(0, vocab, (a.seqs, a.seq_len), generator=torch.Generator().manual_seed(a.seed))
    chunk = 16384
    emb_rows = []
    for lo in range(0, vocab, chunk):  # the embedding, drawn in chunks: only used rows kept
        e = init(min(chunk, vocab - lo), hid)
        sel = (tokens >= lo) & (tokens < lo + chunk)
        emb_rows.append((sel, e[(tokens[sel] - lo)]))
    x0 = torch.zeros(a.seqs, a.seq_len, hid)
    for sel, rows in emb_rows:
        x0[sel] = rows
    xs = {v: x0.clone() for v in VARIANTS}
    mask = torch.full((a.seq_len, a.seq_len), float("-inf")).triu(1)
    print(f"model: {a.layers} layers, hidden {hid}, heads {nh}/{nkv}x{hd}, ffn {ffn}, vocab {vocab}, "
          f"init {a.init}; {a.seqs} x {a.seq_len} random tokens, fp32 on CPU")
    for layer in range(a.layers):
        wq, wk, wv, wo = init(nh * hd, hid), init(nkv * hd, hid), init(nkv * hd, hid), init(hid, nh * hd)
        wg, wu, wd = init(ffn, hid), init(ffn, hid), init(hid, ffn)
        n1, n2 = init(hid, norm=True), init(hid, norm=True)
        exact_w = (wq, wk, wv, wo, wg, wu, wd)
        rounded = {name: tuple(fn(w) for w in exact_w) for name, fn in W_ROUND.items()}
        for v in VARIANTS:
            w = rounded.get(v.split(" + ")[0], exact_w) if "weights" in v else exact_w
            kv_fn = KV_ROUND.get(v, KV_ROUND["fp8 KV (scale 1)"] if "KV" in v else None)
            x = xs[v]
            h = rms_norm(x, n1)
            q = rope((h @ w[0].T).view(a.seqs, a.seq_len, nh, hd).transpose(1, 2))
            k = rope((h @ w[1].T).view(a.seqs, a.seq_len, nkv, hd).transpose(1, 2))
            val = (h @ w[2].T).view(a.seqs, a.seq_len, nkv, hd).transpose(1, 2)
            if v == "exact":
                print(f"layer {layer}: {kv_stats('K', k)}; {kv_stats('V', val)}; residual std "
                      f"{x.std().item():.3g}", flush=True)
            if kv_fn is not None:
                k, val = kv_fn(k), kv_fn(val)
            k = k.repeat_interleave(nh // nkv, dim=1)
            val = val.repeat_interleave(nh // nkv, dim=1)
            att = torch.softmax(q @ k.transpose(-1, -2) / hd**0.5 + mask, dim=-1) @ val
            x = x + att.transpose(1, 2).reshape(a.seqs, a.seq_len, nh * hd) @ w[3].T
            h = rms_norm(x, n2)
            xs[v] = x + (torch.nn.functional.silu(h @ w[4].T) * (h @ w[5].T)) @ w[6].T
        del exact_w, rounded
    nf = init(hid, norm=True)
    hs = {v: rms_norm(x, nf).reshape(-1, hid) for v, x in xs.items()}
    logits = {v: torch.empty(h.shape[0], vocab) for v, h in hs.items()}
    for lo in range(0, vocab, chunk):  # lm_head (untied), drawn in chunks
        head = init(min(chunk, vocab - lo), hid)
        for v in VARIANTS:
            logits[v][:, lo : lo + head.shape[0]] = hs[v] @ head.T  # lm_head stays high precision
    ref = logits["exact"]
    top2 = ref.topk(2, dim=-1).values
    gap = top2[:, 0] - top2[:, 1]
    want = ref.argmax(-1)
    print(f"\nreference logits: std {ref.std().item():.3f}; top-1 - top-2 gap median {gap.median().item():.3f}, "
          f"p10 {gap.quantile(0.1).item():.3f}, p90 {gap.quantile(0.9).item():.3f}  ({gap.numel()} positions)")
    print("\n| variant | agreement | cosine min / mean | error std | agreement where gap > 3 x error std "
          "(positions) |")
    print("|---|---|---|---|---|")
    for v in VARIANTS[1:]:
        got = logits[v]
        err = (got - ref).std().item()
        cos = torch.nn.functional.cosine_similarity(got, ref, dim=-1)
        agree = got.argmax(-1) == want
        sure = gap > 3 * err
        print(f"| {v} | {agree.float().mean().item():.3f} | {cos.min().item():.4f} / {cos.mean().item():.4f} | "
              f"{err:.4f} | {agree[sure].float().mean().item() if sure.any() else float('nan'):.3f} "
              f"({int(sure.sum())}) |")
    print(f"({time.monotonic() - t0:.0f} s)")


if __name__ == "__main__":
    main()
