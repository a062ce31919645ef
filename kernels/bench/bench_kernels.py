"""Micro-benchmarks of tokenspeed_kernels at Llama-3.1-8B shapes vs torch references (GPU only)."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import tokenspeed_kernels as tk
from tokenspeed_kernels import reference as ref

# Ceilings: measured at start on the device in hand (H100 reference: copy 2.99 TB/s, bf16 GEMM 795 TF/s).
CEIL = {"copy_tbps": 2.99, "bf16_tflops": 795.0}
KV_DTYPE: torch.dtype | None = None  # --kv-dtype fp8*: paged caches stored in fp8 (scale 1)
HQ, HKV, D, PAGE = 32, 8, 128, 16
HIDDEN, INTER = 4096, 14336
TOL = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}
COLD_BYTES = 160 << 20  # rotate input sets until one graph pass touches this much (> 3x the 50 MB L2)
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}  # fmt: skip

Inputs = dict[str, Any]


def rel_err(out: torch.Tensor, r: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| (inf when out has non-finite values)."""
    o, rr = out.double(), r.double()
    if not torch.isfinite(o).all():
        return float("inf")
    return ((o - rr).norm() / rr.norm().clamp_min(1e-30)).item()


def eager_ms(fn: Callable[[], Any]) -> float:
    """Median eager time in ms (do_bench: L2 flushed before every call; CPU launch cost can show)."""
    return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))


def graph_ms(fns: list[Callable[[], Any]], calls: int = 64, replays: int = 15) -> float:
    """GPU time per call: `calls` back-to-back calls in one CUDA graph, cycling over input sets
    (so data comes from DRAM, not L2); median over replays."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(side)
    calls = max(calls, 2 * len(fns))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fns[i % len(fns)]()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    del graph
    return statistics.median(times)


class Table:
    """Collects rows, prints them aligned, writes JSON lines."""

    def __init__(self, out_path: str | None) -> None:
        self.rows: list[dict[str, Any]] = []
        self.out_path = out_path
        self.failed = 0
        print(f"{'kernel':18s} {'shape':30s} {'graph us':>9s} {'rate':>10s} {'% ceil':>6s} "
              f"{'eager us':>9s} {'torch us':>9s} {'speedup':>7s}  rel err")  # fmt: skip

    def add(self, row: dict[str, Any]) -> None:
        self.failed += not row["ok"]
        self.rows.append(row)
        if "tflops" in row:
            rate, pct = f"{row['tflops']:6.1f} TF/s", row["pct_mma_ceiling"]
        else:
            rate, pct = f"{row['gbps']:6.0f} GB/s", row["pct_copy_ceiling"]
        torch_us, speedup = row["torch_us"] or float("nan"), row["speedup"] or float("nan")
        print(f"{row['kernel']:18s} {row['shape']:30s} {row['graph_us']:9.1f} {rate:>10s} {pct:5.1f}% "
              f"{row['eager_us']:9.1f} {torch_us:9.1f} {speedup:6.1f}x  {row['rel_err']:.1e}"
              f"{'' if row['ok'] else '  FAIL'}", flush=True)  # fmt: skip

    def write(self, meta: dict[str, Any]) -> None:
        if self.out_path:
            with open(self.out_path, "w") as f:
                f.writelines(json.dumps({**meta, **row}) + "\n" for row in self.rows)


def measure(
    tab: Table,
    kernel: str,
    shape: str,
    build: Callable[[], Inputs],
    run: Callable[[Inputs], Any],
    baseline: Callable[[Inputs], Any] | None,
    check: Callable[[Inputs], float],
    tol: float,
    footprint: int,
    nbytes: float = 0.0,
    flops: float = 0.0,
    **extra: Any,
) -> None:
    """Check vs the fp32 reference, then time: CUDA graph (GPU time), eager kernel, eager torch."""
    first = build()
    err = check(first)
    sets = [first] + [build() for _ in range(min(31, COLD_BYTES // max(footprint, 1)))]
    g_ms = graph_ms([lambda s=s: run(s) for s in sets])
    e_ms = eager_ms(lambda: run(first))
    t_ms = eager_ms(lambda: baseline(first)) if baseline is not None else None
    row: dict[str, Any] = {"kernel": kernel, "shape": shape, "graph_us": g_ms * 1e3, "eager_us": e_ms * 1e3,
                           "torch_us": t_ms and t_ms * 1e3, "speedup": t_ms and t_ms / e_ms, "rel_err": err, "ok": err < tol,
                           "input_sets": len(sets), **extra}  # fmt: skip
    if nbytes:
        row["gbps"] = nbytes / g_ms / 1e6
        row["pct_copy_ceiling"] = 100 * row["gbps"] / (CEIL["copy_tbps"] * 1e3)
    if flops:
        row["tflops"] = flops / g_ms / 1e9
        row["pct_mma_ceiling"] = 100 * row["tflops"] / CEIL["bf16_tflops"]
    tab.add(row)
    sets.clear()
    torch.cuda.empty_cache()


def paged_inputs(seq_lens: list[int], dtype: torch.dtype) -> Inputs:
    """Random caches with a shuffled page table (pages scattered as after churn)."""
    pages_per = [triton.cdiv(n, PAGE) for n in seq_lens]
    total = sum(pages_per)
    k_cache = torch.randn(total, PAGE, HKV, D, device="cuda", dtype=dtype).to(KV_DTYPE or dtype)
    v_cache = torch.randn(total, PAGE, HKV, D, device="cuda", dtype=dtype).to(KV_DTYPE or dtype)
    perm = torch.randperm(total).to(torch.int32)
    page_table = torch.zeros(len(seq_lens), max(pages_per), dtype=torch.int32)
    used = 0
    for b, n in enumerate(pages_per):
        page_table[b, :n] = perm[used : used + n]
        used += n
    lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    return {"k": k_cache, "v": v_cache, "pt": page_table.cuda(), "lens": lens}


def bench_decode(tab: Table, dtype: torch.dtype, splits_override: int | None = None, fused: bool = True) -> None:
    """fused: the split kernel's last program per kv head reduces (one launch); else the
    two-kernel path (split kernel + reduce kernel), reported as paged_decode_2k."""
    scale = D**-0.5
    es = torch.tensor([], dtype=dtype).element_size()
    kernel = "paged_decode" if fused else "paged_decode_2k"
    for batch in (1, 8, 64, 256) if splits_override is None else (1, 8, 32):
        for ctx in (1024, 4096, 8192) if splits_override is None else (1024, 8192):
            splits = splits_override or tk.default_num_splits(batch, HKV, ctx)

            def build(batch: int = batch, ctx: int = ctx) -> Inputs:
                inp = paged_inputs([ctx] * batch, dtype)
                inp["q"] = torch.randn(batch, HQ, D, device="cuda", dtype=dtype)
                inp["out"] = torch.full_like(inp["q"], float("nan"))
                return inp

            def run(s: Inputs, splits: int = splits) -> torch.Tensor:
                return tk.paged_decode_attention(s["q"], s["k"], s["v"], s["pt"], s["lens"], scale,
                                                 out=s["out"], num_splits=splits, fused_reduce=fused)  # fmt: skip

            def base(s: Inputs) -> torch.Tensor:
                return ref.ref_paged_decode_attention_batched(
                    s["q"], s["k"], s["v"], s["pt"], s["lens"], scale, dtype=dtype, chunk=64
                )

            def check(s: Inputs) -> float:
                out = run(s)
                r = ref.ref_paged_decode_attention_batched(s["q"], s["k"], s["v"], s["pt"], s["lens"], scale,
                                                           chunk=8)  # fmt: skip
                return rel_err(out, r)

            kv_bytes = 2 * batch * ctx * HKV * D * torch.tensor([], dtype=KV_DTYPE or dtype).element_size()
            nbytes = kv_bytes + 2 * batch * HQ * D * es
            measure(tab, kernel, f"B={batch} ctx={ctx} splits={splits}", build, run,
                    None if splits_override else base, check,
                    TOL[dtype], footprint=kv_bytes, nbytes=nbytes, batch=batch, ctx=ctx,
                    num_splits=splits)  # fmt: skip


def bench_extend(tab: Table, dtype: torch.dtype, config: tuple[int, int, int, int] | None = None) -> None:
    cases = [
        ("1x4096 new, no prefix", [0], [4096]),
        ("4x1024 new, no prefix", [0] * 4, [1024] * 4),
        ("2x2048 new, prefix 2048", [2048] * 2, [2048] * 2),
        ("1x4096 new, prefix 8192", [8192], [4096]),
    ]
    scale = D**-0.5
    for name, prefixes, news in cases:
        seq_lens = [p + n for p, n in zip(prefixes, news)]
        starts = [0]
        for n in news:
            starts.append(starts[-1] + n)
        max_new = max(news)

        def build(
            seq_lens: list[int] = seq_lens, starts: list[int] = starts, prefixes: list[int] = prefixes
        ) -> Inputs:
            inp = paged_inputs(seq_lens, dtype)
            inp["q"] = torch.randn(starts[-1], HQ, D, device="cuda", dtype=dtype)
            inp["out"] = torch.full_like(inp["q"], float("nan"))
            inp["args"] = (inp["pt"], torch.tensor(starts, dtype=torch.int32, device="cuda"),
                           torch.tensor(prefixes, dtype=torch.int32, device="cuda"), inp["lens"], scale)  # fmt: skip
            return inp

        def run(s: Inputs, max_new: int = max_new) -> torch.Tensor:
            return tk.paged_extend_attention(s["q"], s["k"], s["v"], *s["args"], out=s["out"],
                                             max_new_tokens=max_new, config=config)  # fmt: skip

        def base(s: Inputs) -> torch.Tensor:
            return ref.ref_paged_extend_attention(s["q"], s["k"], s["v"], *s["args"], dtype=dtype)

        def check(s: Inputs) -> float:
            return rel_err(run(s), ref.ref_paged_extend_attention(s["q"], s["k"], s["v"], *s["args"]))

        attended = sum(n * p + n * (n + 1) // 2 for p, n in zip(prefixes, news))
        footprint = 2 * sum(seq_lens) * HKV * D * 2 + 2 * starts[-1] * HQ * D * 2
        measure(tab, "paged_extend", name + (f" cfg={config}" if config else ""), build, run,
                None if config else base, check,
                TOL[dtype], footprint=footprint, flops=4.0 * D * HQ * attended, tokens=starts[-1])  # fmt: skip


def bench_elementwise(tab: Table, dtype: torch.dtype) -> None:
    es = torch.tensor([], dtype=dtype).element_size()
    cos_sin = tk.build_cos_sin_cache(D, 131072, 500000.0, LLAMA3, device="cuda")
    w = torch.randn(HIDDEN, device="cuda", dtype=dtype)
    for tokens in (1, 16, 128, 1024, 8192):
        hid = tokens * HIDDEN * es

        def b_norm(t: int = tokens) -> Inputs:
            x = torch.randn(t, HIDDEN, device="cuda", dtype=dtype)
            return {"x": x, "r": torch.randn_like(x), "out": torch.full_like(x, float("nan"))}

        measure(tab, "rmsnorm", f"T={tokens} H={HIDDEN}", b_norm,
                lambda s: tk.rmsnorm(s["x"], w, 1e-5, out=s["out"]),
                lambda s: ref.ref_rmsnorm(s["x"], w, 1e-5).to(dtype),
                lambda s: rel_err(tk.rmsnorm(s["x"], w, 1e-5, out=s["out"]), ref.ref_rmsnorm(s["x"], w, 1e-5)),
                TOL[dtype], footprint=2 * hid, nbytes=2 * hid, tokens=tokens)  # fmt: skip

        def c_fused(s: Inputs) -> float:
            ref_out, ref_res = ref.ref_fused_add_rmsnorm(s["x"], s["r"], w, 1e-5)
            tk.fused_add_rmsnorm(s["x"], s["r"], w, 1e-5)
            return max(rel_err(s["x"], ref_out), rel_err(s["r"], ref_res))

        measure(tab, "fused_add_rmsnorm", f"T={tokens} H={HIDDEN}", b_norm,
                lambda s: tk.fused_add_rmsnorm(s["x"], s["r"], w, 1e-5),
                lambda s: ref.ref_fused_add_rmsnorm(s["x"], s["r"], w, 1e-5), c_fused,
                TOL[dtype], footprint=2 * hid, nbytes=4 * hid, tokens=tokens)  # fmt: skip

        def b_silu(t: int = tokens) -> Inputs:
            g = torch.randn(t, 2 * INTER, device="cuda", dtype=dtype)
            return {"g": g, "out": torch.full((t, INTER), float("nan"), device="cuda", dtype=dtype)}

        measure(tab, "silu_and_mul", f"T={tokens} I={INTER}", b_silu,
                lambda s: tk.silu_and_mul(s["g"], out=s["out"]),
                lambda s: F.silu(s["g"][:, :INTER]) * s["g"][:, INTER:],
                lambda s: rel_err(tk.silu_and_mul(s["g"], out=s["out"]), ref.ref_silu_and_mul(s["g"])),
                TOL[dtype], footprint=3 * tokens * INTER * es, nbytes=3 * tokens * INTER * es,
                tokens=tokens)  # fmt: skip

        def b_rope(t: int = tokens) -> Inputs:
            qkv = torch.randn(t, (HQ + 2 * HKV) * D, device="cuda", dtype=dtype)
            q, k, v = qkv.split([HQ * D, HKV * D, HKV * D], dim=-1)
            pos = torch.randint(0, 131072, (t,), device="cuda")
            slots = torch.randperm(max(4096, t) * 4, device="cuda")[:t]
            kc = torch.zeros(max(4096, t) * 4 // PAGE, PAGE, HKV, D, device="cuda", dtype=dtype)
            return {"q": q, "k": k, "v": v, "pos": pos, "slots": slots, "kc": kc, "vc": torch.zeros_like(kc)}

        def c_rope(s: Inputs) -> float:
            ref_q, ref_k = ref.ref_rotary_embedding(s["pos"], s["q"], s["k"], cos_sin, D)
            tk.rotary_embedding(s["pos"], s["q"], s["k"], cos_sin, D)
            return max(rel_err(s["q"], ref_q), rel_err(s["k"], ref_k))

        qk_bytes = tokens * (HQ + HKV) * D * es
        measure(tab, "rotary_embedding", f"T={tokens} Hq={HQ} Hkv={HKV}", b_rope,
                lambda s: tk.rotary_embedding(s["pos"], s["q"], s["k"], cos_sin, D),
                lambda s: ref.ref_rotary_embedding(s["pos"], s["q"], s["k"], cos_sin, D), c_rope,
                TOL[dtype], footprint=qk_bytes, nbytes=2 * qk_bytes + tokens * D * 4, tokens=tokens)  # fmt: skip

        def kv_args(s: Inputs) -> tuple[torch.Tensor, ...]:
            return s["k"].unflatten(1, (HKV, D)), s["v"].unflatten(1, (HKV, D)), s["kc"], s["vc"], s["slots"]

        def c_kv(s: Inputs) -> float:
            k3, v3, kc, vc, slots = kv_args(s)
            tk.write_kv_to_pages(k3, v3, kc, vc, slots)
            same = torch.equal(kc.view(-1, HKV, D)[slots], k3) and torch.equal(vc.view(-1, HKV, D)[slots], v3)
            return 0.0 if same else 1.0

        kv_bytes = 2 * tokens * HKV * D * es
        measure(tab, "write_kv_to_pages", f"T={tokens} Hkv={HKV}", b_rope,
                lambda s: tk.write_kv_to_pages(*kv_args(s)),
                lambda s: ref.ref_write_kv_to_pages(*kv_args(s)), c_kv,
                0.5, footprint=2 * kv_bytes, nbytes=2 * kv_bytes, tokens=tokens)  # fmt: skip

        def rope_kv(s: Inputs) -> None:
            tk.rotary_embedding_write_kv(s["pos"], s["q"], s["k"], s["v"], cos_sin, s["kc"], s["vc"], s["slots"])

        def rope_then_kv(s: Inputs) -> None:  # the two-kernel path it replaces
            tk.rotary_embedding(s["pos"], s["q"], s["k"], cos_sin, D)
            tk.write_kv_to_pages(*kv_args(s))

        def c_rope_kv(s: Inputs) -> float:
            ref_kc, ref_vc = s["kc"].clone(), s["vc"].clone()
            ref_q, _ = ref.ref_rotary_embedding_write_kv(s["pos"], s["q"], s["k"], s["v"], cos_sin, ref_kc, ref_vc,
                                                         s["slots"])  # fmt: skip
            rope_kv(s)
            v_ok = torch.equal(s["vc"], ref_vc)
            return max(rel_err(s["q"], ref_q), rel_err(s["kc"], ref_kc), 0.0 if v_ok else 1.0)

        rope_kv_bytes = 2 * tokens * HQ * D * es + 2 * kv_bytes + tokens * D * 4  # q r+w, k/v r+w, cos/sin
        measure(tab, "rotary_write_kv", f"T={tokens} Hq={HQ} Hkv={HKV}", b_rope, rope_kv, rope_then_kv, c_rope_kv,
                TOL[dtype], footprint=rope_kv_bytes, nbytes=rope_kv_bytes, tokens=tokens)  # fmt: skip
        measure(tab, "rotary+write_kv", f"T={tokens} Hq={HQ} Hkv={HKV} (2 kernels)", b_rope, rope_then_kv, None,
                lambda s: 0.0, 1.0, footprint=rope_kv_bytes, nbytes=rope_kv_bytes, tokens=tokens)  # fmt: skip


def measure_ceilings() -> None:
    """Device-to-device copy (1 GiB, read + write counted) and an 8192^3 bf16 matmul, medians."""
    src = torch.randn(1 << 28, device="cuda")
    dst = torch.empty_like(src)
    ms = eager_ms(lambda: dst.copy_(src))
    CEIL["copy_tbps"] = 2 * src.numel() * 4 / ms / 1e9
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = eager_ms(lambda: a @ b)
    CEIL["bf16_tflops"] = 2 * 8192**3 / ms / 1e9


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=None, help="JSON lines output path")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    ap.add_argument("--only", default="decode,extend,elementwise", help="comma list of groups")
    ap.add_argument("--sweep", action="store_true", help="also sweep decode splits and extend tile configs")
    ap.add_argument("--kv-dtype", default="auto", choices=["auto", "fp8", "fp8_e5m2"],
                    help="paged decode/extend over an fp8 KV cache (the references read it dequantised)")
    args = ap.parse_args()
    global KV_DTYPE
    KV_DTYPE = {"auto": None, "fp8": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}[args.kv_dtype]
    assert torch.cuda.is_available(), "benchmarks need a CUDA GPU"
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    tab = Table(args.out)
    groups = args.only.split(",")
    measure_ceilings()
    torch.cuda.empty_cache()
    print(f"# {torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__} {args.dtype}"
          f"; graph us = GPU time per call in a CUDA graph (inputs rotated, L2-cold); speedup = eager torch"
          f" reference / eager kernel (do_bench medians)")  # fmt: skip
    print(f"# measured ceilings: copy {CEIL['copy_tbps']:.2f} TB/s (read+write), bf16 matmul "
          f"{CEIL['bf16_tflops']:.0f} TF/s; % ceil columns use these")  # fmt: skip
    if "decode" in groups:
        bench_decode(tab, dtype)
        bench_decode(tab, dtype, fused=False)
        if args.sweep:
            for splits in (1, 2, 4, 8, 16, 32, 64):
                bench_decode(tab, dtype, splits_override=splits)
    if "extend" in groups:
        bench_extend(tab, dtype)
        if args.sweep:
            for cfg in ((128, 64, 8, 3), (128, 128, 8, 2), (128, 128, 8, 3), (64, 64, 4, 3),
                        (128, 64, 4, 3), (64, 128, 4, 2), (128, 32, 4, 3), (256, 64, 8, 2)):  # fmt: skip
                bench_extend(tab, dtype, config=cfg)
    if "elementwise" in groups:
        bench_elementwise(tab, dtype)
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": triton.__version__, "dtype": args.dtype, "kv_dtype": args.kv_dtype, **CEIL}  # fmt: skip
    tab.write(meta)
    print(f"{len(tab.rows)} rows, {tab.failed} correctness failures")
    return 1 if tab.failed else 0


if __name__ == "__main__":
    sys.exit(main())
