"""FP8 KV cache in the kernels: the cache writes (plain and fused with RoPE) against
quantize_fp8 of the torch result, and decode/extend attention over an fp8 cache against the fp32
reference run on the dequantised cache (stored * scale), which is what the kernels must compute."""

from __future__ import annotations

import pytest
import torch

from helpers import TOL, make_paged_cache, rel_err
from tokenspeed_kernels import (
    build_cos_sin_cache,
    paged_decode_attention,
    paged_extend_attention,
    rotary_embedding,
    rotary_embedding_write_kv,
    write_kv_to_pages,
)
from tokenspeed_kernels.fp8 import fp8_max, quantize_fp8
from tokenspeed_kernels.reference import ref_paged_decode_attention, ref_paged_extend_attention

FP8 = pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])


def _assert_same_fp8(out: torch.Tensor, ref: torch.Tensor) -> None:
    """Bit-equal: the kernels round to nearest even like torch's cast (the interpreter through
    tokenspeed_kernels.fp8's emulated rounding)."""
    assert out.dtype == ref.dtype
    assert torch.equal(out.view(torch.uint8), ref.view(torch.uint8))


def _fp8_paged_cache(seq_lens: list[int], page_size: int, hkv: int, head_dim: int, kv_dtype: torch.dtype,
                     scales: tuple[float, float], device: str,
                     gen: torch.Generator) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """fp8 caches (NaN pages/tails kept: any read past seq_len poisons the output), their
    dequantised fp32 copies, and the page table."""
    kc, vc, pt = make_paged_cache(seq_lens, page_size, hkv, head_dim, torch.float32, "cpu", gen)
    kc, vc = kc * 3 * scales[0], vc * 3 * scales[1]  # spread over the fp8 range
    kq, vq = quantize_fp8(kc, scales[0], kv_dtype), quantize_fp8(vc, scales[1], kv_dtype)
    kd, vd = kq.float() * scales[0], vq.float() * scales[1]
    return kq.to(device), vq.to(device), kd.to(device), vd.to(device), pt.to(device)


@FP8
@pytest.mark.parametrize("scales", [(1.0, 1.0), (0.05, 3.0)], ids=["unit", "scaled"])
def test_write_kv_to_pages_fp8(kv_dtype: torch.dtype, scales: tuple[float, float], device: str) -> None:
    gen = torch.Generator().manual_seed(1)
    k = torch.randn(9, 2, 64, generator=gen) * 4
    v = torch.randn(9, 2, 64, generator=gen) * 4
    k[0, 0, 0] = 1e6  # out of range: clamped to the format's max, never inf/NaN
    slots = torch.randperm(4 * 16, generator=gen)[:9]
    slots[3] = -1
    kc = torch.zeros(4, 16, 2, 64, dtype=kv_dtype, device=device)
    vc = torch.zeros_like(kc)
    write_kv_to_pages(k.to(device), v.to(device), kc, vc, slots.to(device), k_scale=scales[0], v_scale=scales[1])
    ref_k, ref_v = torch.zeros_like(kc).cpu(), torch.zeros_like(vc).cpu()
    keep = slots >= 0
    ref_k.view(-1, 2, 64)[slots[keep]] = quantize_fp8(k[keep], scales[0], kv_dtype)
    ref_v.view(-1, 2, 64)[slots[keep]] = quantize_fp8(v[keep], scales[1], kv_dtype)
    _assert_same_fp8(kc.cpu(), ref_k)
    _assert_same_fp8(vc.cpu(), ref_v)
    assert kc.float().abs().max().item() == fp8_max(kv_dtype)


@FP8
def test_fp8_rounding_every_binade(kv_dtype: torch.dtype, device: str) -> None:
    """Values across the whole range (subnormals, ties, carries into the next binade, clamping)
    are stored exactly as torch rounds them."""
    m = fp8_max(kv_dtype)
    gen = torch.Generator().manual_seed(5)
    mags = torch.exp2(torch.rand(4096, generator=gen) * (torch.log2(torch.tensor(m)) + 24) - 22)
    x = mags * torch.where(torch.rand(4096, generator=gen) < 0.5, -1.0, 1.0)
    grid = torch.arange(256, dtype=torch.uint8).view(kv_dtype).float()
    grid = grid[torch.isfinite(grid)]
    ties = (grid[:-1] + grid[1:]) / 2  # midpoints between neighbours (sorted within a sign)
    x = torch.cat([x, grid, ties, torch.tensor([2 * m, -3 * m, 0.0])])
    x = torch.cat([x, x.new_zeros(-len(x) % 512)]).view(-1, 1, 512)  # few programs: fast
    kc = torch.zeros(x.shape[0], 1, 1, 512, dtype=kv_dtype, device=device)
    write_kv_to_pages(x.to(device), x.to(device), kc, torch.zeros_like(kc),
                      torch.arange(x.shape[0], device=device))
    _assert_same_fp8(kc.view(x.shape).cpu(), quantize_fp8(x, 1.0, kv_dtype))


@FP8
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_write_kv_fp8(kv_dtype: torch.dtype, dtype: torch.dtype, device: str) -> None:
    """The fused RoPE + write stores quantize_fp8(rotated k) and quantize_fp8(v); q as unfused."""
    hq, hkv, d, total = 8, 2, 64, 11
    gen = torch.Generator().manual_seed(2)
    qkv = (torch.randn(total, (hq + 2 * hkv) * d, generator=gen) * 2).to(dtype=dtype, device=device)
    positions = torch.randint(0, 4096, (total,), generator=gen).to(device)
    slots = torch.randperm(5 * 16, generator=gen)[:total]
    slots[2] = -1
    slots = slots.to(device)
    cos_sin = build_cos_sin_cache(d, 4096, 10000.0, device=device)
    k_scale, v_scale = 0.5, 0.25
    kc = torch.zeros(5, 16, hkv, d, dtype=kv_dtype, device=device)
    vc = torch.zeros_like(kc)
    q, k, v = qkv.clone().split([hq * d, hkv * d, hkv * d], dim=-1)
    rotary_embedding_write_kv(positions, q, k, v, cos_sin, kc, vc, slots, k_scale=k_scale, v_scale=v_scale)
    rq, rk, rv = qkv.clone().split([hq * d, hkv * d, hkv * d], dim=-1)
    rotary_embedding(positions, rq, rk, cos_sin, d)
    ref_kc, ref_vc = torch.zeros_like(kc).cpu(), torch.zeros_like(vc).cpu()
    keep = (slots >= 0).cpu()
    s = slots.cpu()[keep]
    ref_kc.view(-1, hkv, d)[s] = quantize_fp8(rk.cpu()[keep].view(-1, hkv, d), k_scale, kv_dtype)
    ref_vc.view(-1, hkv, d)[s] = quantize_fp8(rv.cpu()[keep].view(-1, hkv, d), v_scale, kv_dtype)
    assert torch.equal(q, rq)
    _assert_same_fp8(kc.cpu(), ref_kc)
    _assert_same_fp8(vc.cpu(), ref_vc)


@FP8
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fused_reduce", [True, False], ids=["fused", "two_kernel"])
def test_decode_attention_fp8(kv_dtype: torch.dtype, dtype: torch.dtype, fused_reduce: bool,
                              device: str) -> None:  # fmt: skip
    seq_lens, hkv, group, d = [1, 9, 70], 2, 4, 64
    scales = (0.3, 2.0)
    gen = torch.Generator().manual_seed(3)
    kq, vq, kd, vd, pt = _fp8_paged_cache(seq_lens, 16, hkv, d, kv_dtype, scales, device, gen)
    q = torch.randn(len(seq_lens), hkv * group, d, generator=gen).to(dtype=dtype, device=device)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    out = torch.full_like(q, float("nan"))
    paged_decode_attention(q, kq, vq, pt, lens, d**-0.5, out=out, num_splits=3, fused_reduce=fused_reduce,
                           k_scale=scales[0], v_scale=scales[1])  # fmt: skip
    ref = ref_paged_decode_attention(q, kd, vd, pt, lens, d**-0.5)
    assert rel_err(out, ref) < TOL[dtype]


@FP8
@pytest.mark.parametrize("prefetch", [False, True], ids=["lookup_in_step", "prefetch"])
def test_decode_attention_fp8_page_prefetch(kv_dtype: torch.dtype, prefetch: bool, device: str) -> None:
    """Both page-lookup orders (the default for an fp8 cache looks one tile ahead) on an fp8 cache
    with scales and fp16 dots: the reference's output, over splits that end mid-tile."""
    seq_lens, hkv, group, d = [1, 9, 70, 131], 2, 4, 64
    scales = (0.3, 2.0)
    gen = torch.Generator().manual_seed(7)
    kq, vq, kd, vd, pt = _fp8_paged_cache(seq_lens, 16, hkv, d, kv_dtype, scales, device, gen)
    q = torch.randn(len(seq_lens), hkv * group, d, generator=gen).to(dtype=torch.bfloat16, device=device)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    out = torch.full_like(q, float("nan"))
    paged_decode_attention(q, kq, vq, pt, lens, d**-0.5, out=out, num_splits=3, block_n=16,
                           k_scale=scales[0], v_scale=scales[1], prefetch=prefetch)  # fmt: skip
    ref = ref_paged_decode_attention(q, kd, vd, pt, lens, d**-0.5)
    assert rel_err(out, ref) < TOL[torch.bfloat16]


@FP8
def test_decode_attention_fp8_f16_dots(kv_dtype: torch.dtype, device: str) -> None:
    """The fp16-dot variant (bf16 q converted to fp16 with the cache) matches the reference; on a
    GPU it is a different path from the bf16 dots (its output differs in the last bits; Triton's
    interpreter computes both alike)."""
    seq_lens, hkv, group, d = [1, 9, 70], 2, 4, 64
    scales = (0.3, 2.0)
    gen = torch.Generator().manual_seed(5)
    kq, vq, kd, vd, pt = _fp8_paged_cache(seq_lens, 16, hkv, d, kv_dtype, scales, device, gen)
    q = torch.randn(len(seq_lens), hkv * group, d, generator=gen).to(dtype=torch.bfloat16, device=device)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    outs = {}
    for f16 in (False, True):
        outs[f16] = torch.full_like(q, float("nan"))
        paged_decode_attention(q, kq, vq, pt, lens, d**-0.5, out=outs[f16], num_splits=3,
                               k_scale=scales[0], v_scale=scales[1], fp8_f16_dots=f16)
    ref = ref_paged_decode_attention(q, kd, vd, pt, lens, d**-0.5)
    assert rel_err(outs[True], ref) < TOL[torch.bfloat16]
    if device == "cuda":
        assert not torch.equal(outs[True], outs[False])


@FP8
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_extend_attention_fp8(kv_dtype: torch.dtype, dtype: torch.dtype, device: str) -> None:
    prefix, new, hkv, group, d = [0, 21], [13, 5], 2, 2, 64
    scales = (2.0, 0.1)
    seq_lens = [p + n for p, n in zip(prefix, new)]
    gen = torch.Generator().manual_seed(4)
    kq, vq, kd, vd, pt = _fp8_paged_cache(seq_lens, 16, hkv, d, kv_dtype, scales, device, gen)
    q = torch.randn(sum(new), hkv * group, d, generator=gen).to(dtype=dtype, device=device)

    def i32(xs: list[int]) -> torch.Tensor:
        return torch.tensor(xs, dtype=torch.int32, device=device)

    args = (pt, i32([0, new[0], sum(new)]), i32(prefix), i32(seq_lens), d**-0.5)
    out = torch.full_like(q, float("nan"))
    paged_extend_attention(q, kq, vq, *args, out=out, k_scale=scales[0], v_scale=scales[1])
    ref = ref_paged_extend_attention(q, kd, vd, *args)
    assert rel_err(out, ref) < (3e-4 if dtype == torch.float32 else TOL[dtype])


def test_scales_need_an_fp8_cache(device: str) -> None:
    """A bf16/fp32 cache stores values unscaled: a scale other than 1 there is a caller bug."""
    q = torch.zeros(1, 2, 64, device=device)
    kc = torch.zeros(1, 16, 1, 64, device=device)
    pt = torch.zeros(1, 1, dtype=torch.int32, device=device)
    lens = torch.ones(1, dtype=torch.int32, device=device)
    with pytest.raises(AssertionError):
        paged_decode_attention(q, kc, kc, pt, lens, 1.0, k_scale=2.0)
