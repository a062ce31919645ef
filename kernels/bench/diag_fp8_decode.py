"""GPU diagnostic: what holds the fp8-KV decode attention kernel below the bf16 kernel's GB/s.

On the H100 (session 11, benches/diagnostics/profile_decode_kernels.py) the decode attention kernel reads a
bf16 cache at ~2,950 GB/s but an fp8 cache at ~1,850 (2,100-2,190 with its dots in fp16): the
bytes halve, the time per request only falls by a quarter. This times variants of the kernel's
inner loop on one layer's S1-sized cache (--batch requests x --context tokens, Llama-3.1-8B
heads, page size 16, one split), each a single program per (request, kv head):

  prod / prod_h   paged_decode_attention itself with bf16 dots / fp16 dots (fp8_f16_dots, now
                  its default for an fp8 cache)
  loads           K and V tiles loaded and summed, no dots: the gather's bandwidth ceiling
  qk              the QK dot and the softmax, V summed instead of the PV dot
  *_hnd           prod, prod_h and loads on a cache stored head-major ([pages, Hkv, page, D],
                  FlashInfer's HND: each (page, kv head) one contiguous block of page x D) and
                  passed as the [pages, page, Hkv, D] view the kernels take (strides only)
  vt_h            the full loop with V stored transposed ([pages, Hkv, D, page]: tokens
                  contiguous, so the PV dot's B operand is k-major as an 8-bit MMA operand must
                  be) and fp16 dots; its output is checked against prod_h on the same values
Prints us per call and GB/s for an fp8 (e4m3) cache and, for reference, a bf16 cache.
A config's trailing p / n turns paged_decode_attention's `prefetch` (the page lookup one tile
ahead, which lets Triton double-buffer the K/V copies) on / off; --variants and --caches
narrow the table. Session 12, H100: fp8 prod_h 64x4x3 2,209 GB/s -> 64x4x3p 2,435-2,484.

Run (GPU): cd kernels && PYTHONPATH=.:../python python3 bench/diag_fp8_decode.py
CPU (Triton interpreter, a check of the variants' outputs only):
    TRITON_INTERPRET=1 python3 bench/diag_fp8_decode.py --batch 2 --context 40 --reps 1
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from collections.abc import Callable

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from tokenspeed_kernels import paged_decode_attention

LOG2E = 1.4426950408889634
MODES = {"loads": 1, "qk": 2, "vt_h": 3}


@triton.jit
def _diag_kernel(q_ptr, k_ptr, v_ptr, pt_ptr, seq_lens_ptr, out_ptr, qk_scale,
                 stride_qb, stride_qh, stride_kp, stride_ks, stride_kh,
                 stride_vp, stride_vh, stride_vd, stride_vs, stride_pt, group,
                 MODE: tl.constexpr, BLOCK_H: tl.constexpr, D: tl.constexpr,
                 BLOCK_N: tl.constexpr, PAGE: tl.constexpr):  # fmt: skip
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + b)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, D)
    offs_n = tl.arange(0, BLOCK_N)
    mask_h = offs_h < group
    heads = kvh * group + offs_h
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=mask_h[:, None], other=0.0).to(tl.float16)  # fmt: skip
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, D], dtype=tl.float32)
    for n0 in range(0, seq_len, BLOCK_N):
        pos = n0 + offs_n
        mask_n = pos < seq_len
        page = tl.load(pt_ptr + b * stride_pt + pos // PAGE, mask=mask_n, other=0).to(tl.int64)
        in_page = pos % PAGE
        k = tl.load(k_ptr + (page * stride_kp + in_page * stride_ks + kvh * stride_kh)[:, None]
                    + offs_d[None, :], mask=mask_n[:, None], other=0.0)  # fmt: skip
        if MODE == 3:  # V^T tile [D, BLOCK_N], tokens contiguous within a page
            vt = tl.load(v_ptr + (page * stride_vp + kvh * stride_vh + in_page * stride_vs)[None, :]
                         + offs_d[:, None] * stride_vd, mask=mask_n[None, :], other=0.0)  # fmt: skip
        else:
            v = tl.load(v_ptr + (page * stride_vp + in_page * stride_vs + kvh * stride_vh)[:, None]
                        + offs_d[None, :], mask=mask_n[:, None], other=0.0)  # fmt: skip
        if MODE == 1:
            acc += tl.sum(k.to(tl.float32) + v.to(tl.float32), 0)[None, :]
        else:
            s = tl.dot(q, tl.trans(k.to(tl.float16))) * qk_scale
            s = tl.where(mask_n[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            if MODE == 2:
                acc = acc * alpha[:, None] + tl.sum(v.to(tl.float32), 0)[None, :]
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(tl.float16), tl.trans(vt.to(tl.float16)))
            m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=mask_h[:, None])  # fmt: skip


def diag(mode: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, vt: torch.Tensor,
         pt: torch.Tensor, lens: torch.Tensor, out: torch.Tensor, block_n: int, warps: int,
         stages: int) -> None:  # fmt: skip
    batch, hq, d = q.shape
    _, page, hkv, _ = k.shape
    vv = vt if mode == "vt_h" else v
    # strides of V as (page, head, dim, slot) whatever its layout
    sv = (vt.stride(0), vt.stride(1), vt.stride(2), vt.stride(3)) if mode == "vt_h" else \
        (v.stride(0), v.stride(2), v.stride(3), v.stride(1))
    _diag_kernel[(batch, hkv)](q, k, vv, pt, lens, out, d**-0.5 * LOG2E, q.stride(0), q.stride(1),
                               k.stride(0), k.stride(1), k.stride(2), *sv, pt.stride(0), hq // hkv,
                               MODE=MODES[mode], BLOCK_H=16, D=d, BLOCK_N=block_n, PAGE=page,
                               num_warps=warps, num_stages=stages)  # fmt: skip


def time_us(fn: Callable[[], object], reps: int, cuda: bool) -> float:
    fn()
    if cuda:
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(reps):
            fn()
        b.record()
        b.synchronize()
        return a.elapsed_time(b) * 1e3 / reps
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) * 1e6 / reps


def make_variants(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kh: torch.Tensor,
                  vh: torch.Tensor, vt: torch.Tensor, pt: torch.Tensor, lens: torch.Tensor,
                  bn: int, w: int, st: int, extra: dict[str, object]) -> dict[str, Callable[[], object]]:  # fmt: skip
    """Each variant of the module docstring as a call on this cache at this launch config
    (extra: paged_decode_attention's other knobs, for prod and prod_h)."""
    scale = q.shape[-1] ** -0.5

    def prod(kc: torch.Tensor, vc: torch.Tensor, f16: bool) -> Callable[[], object]:
        return lambda: paged_decode_attention(q, kc, vc, pt, lens, scale, out=torch.empty_like(q), num_splits=1,
                                              block_n=bn, num_warps=w, num_stages=st, fp8_f16_dots=f16,
                                              **extra)  # fmt: skip

    def variant(mode: str, kc: torch.Tensor, vc: torch.Tensor) -> Callable[[], object]:
        return lambda: diag(mode, q, kc, vc, vt, pt, lens, torch.empty_like(q), bn, w, st)

    return {"prod": prod(k, v, False), "prod_h": prod(k, v, True),
            **{m: variant(m, k, v) for m in MODES},
            "prod_hnd": prod(kh, vh, False), "prod_h_hnd": prod(kh, vh, True),
            "loads_hnd": variant("loads", kh, vh)}  # fmt: skip


def parse_config(cfg: str) -> tuple[int, int, int, dict[str, object]]:
    """'64x4x3p' -> (64, 4, 3, {"prefetch": True}); 'n': prefetch off; neither: the default."""
    m = re.fullmatch(r"(\d+)x(\d+)x(\d+)([pn]?)", cfg)
    assert m, f"bad config {cfg}"
    extra: dict[str, object] = {"prefetch": m[4] == "p"} if m[4] else {}
    return int(m[1]), int(m[2]), int(m[3]), extra


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=411)
    p.add_argument("--context", type=int, default=1537)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--configs", default="64x4x2,64x4x3,128x4x3,128x8x2",
                   help="BLOCKNxWARPSxSTAGES list for the diagnostic variants, each optionally "
                        "followed by p (prefetch on) or n (off), e.g. 64x4x3p")
    p.add_argument("--variants", default=None,
                   help="comma-separated variants to time (default: all; e.g. prod_h)")
    p.add_argument("--caches", default="fp8,bf16", help="cache dtypes to time: fp8, bf16")
    a = p.parse_args()
    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    hq, hkv, d, page = 32, 8, 128, 16
    pages_per = -(-a.context // page)
    gen = torch.Generator(device="cpu").manual_seed(0)
    pt = torch.randperm(a.batch * pages_per, generator=gen).view(a.batch, pages_per).to(torch.int32).to(dev)
    lens = torch.full((a.batch,), a.context, dtype=torch.int32, device=dev)
    q = torch.randn(a.batch, hq, d, generator=gen).to(torch.bfloat16).to(dev)
    shape = (a.batch * pages_per, page, hkv, d)
    print(f"device {torch.cuda.get_device_name() if cuda else 'cpu'}; {a.batch} requests x {a.context} "
          f"tokens, Hq {hq} Hkv {hkv} D {d}, page {page}")  # fmt: skip
    print("| cache | variant | config | us | GB/s |\n|---|---|---|---|---|")
    dtypes = {"fp8": torch.float8_e4m3fn, "bf16": torch.bfloat16}
    for kv_dtype in (dtypes[c] for c in a.caches.split(",")):
        k = (torch.randn(shape, generator=gen) * 0.5).to(kv_dtype).to(dev)
        v = (torch.randn(shape, generator=gen) * 0.5).to(kv_dtype).to(dev)
        vt = v.permute(0, 2, 3, 1).contiguous()  # [pages, Hkv, D, page]
        # head-major storage, seen through the [pages, page, Hkv, D] view
        kh = k.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)
        vh = v.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)
        gb = 2 * a.batch * a.context * hkv * d * k.element_size() / 1e9
        name = "fp8" if kv_dtype != torch.bfloat16 else "bf16"
        ref = torch.empty_like(q)
        paged_decode_attention(q, k, v, pt, lens, d**-0.5, out=ref, num_splits=1, fp8_f16_dots=True)
        for cfg in a.configs.split(","):
            bn, w, st, extra = parse_config(cfg)
            variants = make_variants(q, k, v, kh, vh, vt, pt, lens, bn, w, st, extra)
            if a.variants:
                variants = {n: f for n, f in variants.items() if n in a.variants.split(",")}
            for vname, fn in variants.items():
                try:
                    us = time_us(fn, a.reps, cuda)
                except Exception as e:  # noqa: BLE001  (a config that does not compile: next)
                    print(f"| {name} | {vname} | {cfg} | failed: {type(e).__name__} {str(e)[:80]} | |")
                    continue
                print(f"| {name} | {vname} | {cfg} | {us:.1f} | {gb / us * 1e6:,.0f} |", flush=True)
            if extra:  # the knobs give the default's output
                got = torch.empty_like(q)
                paged_decode_attention(q, k, v, pt, lens, d**-0.5, out=got, num_splits=1, block_n=bn,
                                       num_warps=w, num_stages=st, **extra)  # fmt: skip
                err = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
                print(f"| {name} | prod_h{cfg} vs default rel err | | {err:.2e} | |", flush=True)
                assert err < 1e-2, f"{cfg} output differs: {err}"
            if a.variants and "vt_h" not in a.variants:
                continue
            check = torch.empty_like(q)
            diag("vt_h", q, k, v, vt, pt, lens, check, bn, w, st)
            err = ((check.float() - ref.float()).norm() / ref.float().norm()).item()
            print(f"| {name} | vt_h vs prod_h rel err | {cfg} | {err:.2e} | |", flush=True)
            assert err < 1e-2, f"vt_h output differs from prod_h: {err}"
            hnd = torch.empty_like(q)
            paged_decode_attention(q, kh, vh, pt, lens, d**-0.5, out=hnd, num_splits=1, fp8_f16_dots=True,
                                   block_n=bn, num_warps=w, num_stages=st)  # fmt: skip
            err = ((hnd.float() - ref.float()).norm() / ref.float().norm()).item()
            assert err < 1e-2, f"the head-major cache gives another output: {err}"


if __name__ == "__main__":
    main()
