"""Paged decode attention: GQA-grouped split-K (flash-decoding) Triton kernel plus the reduce.

The reduce of the split partials runs either as a second kernel or, with fused_reduce, inside the
split kernel: the last program of each (request, kv head) to finish combines the partials. It
finds out it is last from an int32 counter that every program increments once (release: its
partials are published; acquire: it sees everyone else's) and that the last one resets to 0, so
the counters are zero again after every launch, as a CUDA-graph replay needs them.

paged_decode_attention with an fp8 cache (float8_e4m3fn / float8_e5m2: K / k_scale and V /
v_scale) and 16-bit q: its tiles become fp16 (exact) and both dots run in fp16 (fp8_f16_dots; q
is rounded to fp16, finer than bf16, range 65504) with 3 pipeline stages: on the H100 at S1
sizes (411 requests x 1.5k tokens) 2,160 GB/s of KV against 1,800 for bf16 dots with 2 stages
(kernels/bench/diag_fp8_decode.py; a bf16 cache reads ~2,900 GB/s, 2 or 3 stages alike).
prefetch: look the next tile's pages up one iteration ahead (default: with an fp8 cache).
Triton then double-buffers the K/V copies (tile i+1's async copies in flight while tile i
computes; with the page lookup in the same iteration it keeps one buffer and waits for each
tile) and the fp8 kernel needs 119 registers instead of 162 (4 programs per SM, not 3): on
the H100 at S1 sizes 2,435-2,484 GB/s against 2,209; a bf16 cache is ~2% slower with it.

_decode_split_kernel's constexprs:
FUSED_REDUCE: the last program of the (request, kv head) also writes out [B, Hq, D] (strides
stride_fb/stride_fh) from all splits' partials; sem_ptr: [B * Hkv] int32 zeros (left zero).
KV_CAST: the cache's dtype is not q's (fp8): converted to q's dtype in registers (exact for
fp8); the K scale is in qk_scale and v_scale multiplies each split's output.
Q_F16: q is converted to fp16 and the cache with it (e4m3/e5m2 -> fp16 is one conversion;
-> bf16 goes through fp16 or fp32), so both dots run in fp16.
PREFETCH: the next tile's page-table entries are looked up one iteration ahead, so the K/V
loads' addresses do not wait on a load of their own iteration (see `prefetch` above).
HAS_SINKS: each q head's sink logit (sinks_ptr [Hq], natural-log units) starts split 0's
online softmax (max = the sink, sum = 1, no value), so it joins the denominator once.
SLIDING: only the last `window` (> 0) keys. Without it the first key is the constant 0 and the
compiler sees every split start at a multiple of BLOCK_N: with a runtime `window` of 0 instead
(main until issue 29) the page lookups lost that alignment, +4% SASS at S1's decode step and
~2.8% more kernel time on an H200. kernels/tests/sass_diff.py checks the plain launch's SASS.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenspeed_kernels._utils import dot_precision, num_sms, upcast_dot
from tokenspeed_kernels.fp8 import is_fp8

LOG2E = 1.4426950408889634


@triton.jit
def _combine_group(
    part_ptr,
    lse_ptr,
    out_ptr,
    stride_ph,
    stride_ps,
    stride_lh,
    stride_oh,
    group,
    n_splits,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_CS: tl.constexpr,
):
    """out[g] = log-sum-exp weighted sum of the first n_splits partials of q head g, for the
    `group` heads of one kv head at once (one CTA reduces them all: one load latency per
    BLOCK_CS splits, not one per head). Partials are read through L2 (.cg)."""
    offs_g = tl.arange(0, BLOCK_G)
    offs_s = tl.arange(0, BLOCK_S)
    offs_c = tl.arange(0, BLOCK_CS)
    offs_d = tl.arange(0, BLOCK_D)
    mask_g = offs_g < group
    mask_d = offs_d < HEAD_DIM
    lse_rows = lse_ptr + offs_g[:, None] * stride_lh
    lse = tl.load(lse_rows + offs_s[None, :], mask=mask_g[:, None] & (offs_s[None, :] < n_splits),
                  other=float("-inf"), cache_modifier=".cg")  # fmt: skip
    m = tl.max(lse, 1)
    m = tl.where(m == float("-inf"), 0.0, m)
    denom = tl.sum(tl.exp2(lse - m[:, None]), 1)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    for s0 in range(0, n_splits, BLOCK_CS):
        sc = s0 + offs_c
        mask_c = mask_g[:, None] & (sc[None, :] < n_splits)
        w = tl.exp2(tl.load(lse_rows + sc[None, :], mask=mask_c, other=float("-inf"), cache_modifier=".cg")
                    - m[:, None])  # fmt: skip
        parts = tl.load(
            part_ptr + offs_g[:, None, None] * stride_ph + sc[None, :, None] * stride_ps + offs_d[None, None, :],
            mask=mask_c[:, :, None] & mask_d[None, None, :],
            other=0.0,
            cache_modifier=".cg",
        )
        acc += tl.sum(parts * w[:, :, None], 1)
    out = acc / tl.where(denom > 0, denom, 1.0)[:, None]
    tl.store(out_ptr + offs_g[:, None] * stride_oh + offs_d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=mask_g[:, None] & mask_d[None, :])  # fmt: skip


@triton.jit
def _tile_pages(pt_row, pos, end, PAGE_SIZE: tl.constexpr):
    """The cache page of each context position `pos` (page 0 at and past `end`)."""
    return tl.load(pt_row + pos // PAGE_SIZE, mask=pos < end, other=0).to(tl.int64)


@triton.jit
def _sink_start(sinks_ptr, heads, mask_h, split, BLOCK_H: tl.constexpr, HAS_SINKS: tl.constexpr):
    """The online softmax's running max and sum [BLOCK_H] before the first tile: -inf and 0, or
    with HAS_SINKS on split 0 each q head's sink (sinks_ptr [Hq], natural log) and 1."""
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    if HAS_SINKS:  # split 0 is never empty (seq_len - lo >= 1): it always carries the sink
        sink = tl.load(sinks_ptr + heads, mask=mask_h, other=float("-inf")).to(tl.float32)
        m_i = tl.where(split == 0, sink * 1.4426950408889634, m_i)  # log2 units (LOG2E)
        l_i = tl.where(m_i > float("-inf"), 1.0, 0.0)
    return m_i, l_i


@triton.jit
def _store_split(acc, m_i, l_i, v_scale, part_out_ptr, part_lse_ptr, out_ptr, sem_ptr, b, kvh, split,
                 heads, mask_h, mask_d, seq_len, lo, per_split, num_splits, group, stride_ob, stride_oh,
                 stride_os, stride_lb, stride_lh, stride_fb, stride_fh, HEAD_DIM: tl.constexpr,
                 BLOCK_D: tl.constexpr, KV_CAST: tl.constexpr, FUSED_REDUCE: tl.constexpr,
                 BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_CS: tl.constexpr):
    """A split's output (acc / l_i) and lse; with FUSED_REDUCE out itself where there is one
    split, else the last split of the (request, kv head) to arrive combines them all into out."""
    offs_d = tl.arange(0, BLOCK_D)
    # Empty splits (start >= end) store lse = -inf and zeros; the reduce gives them weight 0.
    has = l_i > 0
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    if KV_CAST:
        out = out * v_scale
    lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
    if FUSED_REDUCE:  # noqa: SIM102  (constexpr test kept apart from the runtime one)
        if num_splits == 1:  # the reduce of one split is the identity
            f_ptrs = out_ptr + b * stride_fb + heads[:, None] * stride_fh + offs_d[None, :]
            tl.store(f_ptrs, out.to(out_ptr.dtype.element_ty), mask=mask_h[:, None] & mask_d[None, :])
            return
    o_ptrs = part_out_ptr + b * stride_ob + heads[:, None] * stride_oh + split * stride_os + offs_d[None, :]
    tl.store(o_ptrs, out, mask=mask_h[:, None] & mask_d[None, :])
    tl.store(part_lse_ptr + b * stride_lb + heads * stride_lh + split, lse, mask=mask_h)
    if FUSED_REDUCE:
        # Release: the CTA barrier orders every thread's partial stores before the one-thread
        # gpu-scope acq_rel atomic (a lone release covers only what its thread has observed).
        tl.debug_barrier()
        sem = sem_ptr + b * tl.num_programs(1) + kvh
        arrived = tl.atomic_add(sem, 1, sem="acq_rel", scope="gpu")
        if arrived == num_splits - 1:
            # Acquire: the atomic's result reaches the other threads through shared memory and a
            # barrier; this barrier makes that explicit. Partials are read through L2 (.cg).
            tl.debug_barrier()
            tl.store(sem, 0)  # every program has arrived: zero for the next launch / graph replay
            n_used = tl.cdiv(seq_len - lo, per_split)  # later splits are empty (lse -inf): not read
            _combine_group(part_out_ptr + b * stride_ob + kvh * group * stride_oh,
                           part_lse_ptr + b * stride_lb + kvh * group * stride_lh,
                           out_ptr + b * stride_fb + kvh * group * stride_fh,
                           stride_oh, stride_os, stride_lh, stride_fh, group, n_used,
                           HEAD_DIM, BLOCK_D, BLOCK_G, BLOCK_S, BLOCK_CS)  # fmt: skip


@triton.jit
def _decode_split_kernel(
    q_ptr, k_ptr, v_ptr, page_table_ptr, seq_lens_ptr, part_out_ptr, part_lse_ptr, out_ptr, sem_ptr,
    qk_scale, v_scale,
    stride_qb, stride_qh, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, stride_pt,
    stride_ob, stride_oh, stride_os, stride_lb, stride_lh, stride_fb, stride_fh,
    num_splits, group, sinks_ptr, window,  # the sinks' and window's last: the others' params as before
    BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr, KV_CAST: tl.constexpr,
    Q_F16: tl.constexpr, FUSED_REDUCE: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr,
    BLOCK_CS: tl.constexpr, PREFETCH: tl.constexpr, HAS_SINKS: tl.constexpr, SLIDING: tl.constexpr,
):
    """One program = one (request, kv head, split): all `group` q heads share each K/V tile.
    Its constexprs: the module docstring. The tile loop is written here, not in a helper: an
    inlined helper's debug-info ranges change ptxas's schedule (fp8: 156 registers, not 150)."""
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    lo = 0  # the first key; with a sliding window the splits share the last `window` keys
    if SLIDING:
        lo = tl.maximum(seq_len - window, 0)
    # Split length is a multiple of BLOCK_N so every split but the last runs full tiles.
    per_split = tl.cdiv(tl.cdiv(seq_len - lo, num_splits), BLOCK_N) * BLOCK_N
    start = lo + split * per_split
    end = tl.minimum(start + per_split, seq_len)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    mask_h = offs_h < group
    mask_d = offs_d < HEAD_DIM
    heads = kvh * group + offs_h

    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=mask_h[:, None] & mask_d[None, :], other=0.0)
    if Q_F16:
        q = q.to(tl.float16)
    if UPCAST:
        q = q.to(tl.float32)
    m_i, l_i = _sink_start(sinks_ptr, heads, mask_h, split, BLOCK_H, HAS_SINKS)
    pt_row = page_table_ptr + b * stride_pt
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    if PREFETCH:  # the first tile's pages; each iteration then looks up the next tile's
        page_next = _tile_pages(pt_row, start + offs_n, end, PAGE_SIZE)
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + offs_n
        mask_n = pos < end
        if PREFETCH:
            page = page_next
            page_next = _tile_pages(pt_row, pos + BLOCK_N, end, PAGE_SIZE)
        else:
            page = _tile_pages(pt_row, pos, end, PAGE_SIZE)
        in_page = pos % PAGE_SIZE
        k_off = page * stride_kp + in_page * stride_ks + kvh * stride_kh
        v_off = page * stride_vp + in_page * stride_vs + kvh * stride_vh
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k = tl.load(k_ptr + k_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + v_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        if KV_CAST:
            k = k.to(q.dtype)
            v = v.to(q.dtype)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale  # [BLOCK_H, BLOCK_N], log2 units
        s = tl.where(mask_n[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
        m_i = m_new

    _store_split(acc, m_i, l_i, v_scale, part_out_ptr, part_lse_ptr, out_ptr, sem_ptr, b, kvh, split, heads,
                 mask_h, mask_d, seq_len, lo, per_split, num_splits, group, stride_ob, stride_oh, stride_os,
                 stride_lb, stride_lh, stride_fb, stride_fh, HEAD_DIM, BLOCK_D, KV_CAST, FUSED_REDUCE, BLOCK_G,
                 BLOCK_S, BLOCK_CS)  # fmt: skip


@triton.jit
def _decode_reduce_kernel(
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    stride_pb,
    stride_ph,
    stride_ps,
    stride_lb,
    stride_lh,
    stride_ob,
    stride_oh,
    num_splits,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    """One program = one (request, q head): log-sum-exp weighted sum of the split partials."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    mask_s = offs_s < num_splits
    mask_d = offs_d < HEAD_DIM
    lse = tl.load(part_lse_ptr + b * stride_lb + h * stride_lh + offs_s, mask=mask_s, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m)
    denom = tl.sum(w, 0)
    parts = tl.load(
        part_out_ptr + b * stride_pb + h * stride_ph + offs_s[:, None] * stride_ps + offs_d[None, :],
        mask=mask_s[:, None] & mask_d[None, :],
        other=0.0,
    )
    out = tl.sum(parts * w[:, None], 0) / tl.where(denom > 0, denom, 1.0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty), mask=mask_d)


def default_num_splits(batch: int, num_kv_heads: int, max_seq_len: int) -> int:
    """Splits per (request, kv head): ~3 programs per SM, >= 64 tokens per split, at most 64.

    Tuned on H200 (B=1/8/32, ctx 1024/8192, Llama-3.1-8B heads): see kernels/bench/NOTES.md.
    """
    by_occupancy = triton.cdiv(3 * num_sms(), max(1, batch * num_kv_heads))
    by_length = triton.cdiv(max(1, max_seq_len), 64)
    return max(1, min(by_occupancy, by_length, 64))


_SEMAPHORES: dict[torch.device, list[torch.Tensor]] = {}


def decode_semaphores(device: torch.device, count: int) -> torch.Tensor:
    """The per-device zeroed int32 counters of the fused reduce (>= count of them).

    Buffers are never freed (a captured CUDA graph keeps using the one it saw) and are grown only
    outside stream capture. One buffer serves one stream at a time: decode launches that may
    overlap in time on different streams must pass their own `semaphores`.
    """
    bufs = _SEMAPHORES.setdefault(device, [])
    if not bufs or bufs[-1].numel() < count:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("paged_decode_attention(fused_reduce=True) first ran inside CUDA-graph "
                               "capture: run it once eagerly at the largest batch first, or pass "
                               "semaphores=")  # fmt: skip
        bufs.append(torch.zeros(max(count, 4096), dtype=torch.int32, device=device))
    return bufs[-1]


def _check_inputs(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: float,
                  v_scale: float, sinks: torch.Tensor | None) -> None:
    assert q.shape[1] % k_cache.shape[2] == 0, "Hq must be a multiple of Hkv"
    assert sinks is None or (sinks.shape == q.shape[1:2] and sinks.is_contiguous()), "sinks: [Hq]"
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    assert v_cache.dtype == k_cache.dtype
    assert is_fp8(k_cache.dtype) or (k_scale == 1.0 and v_scale == 1.0), "scales need an fp8 cache"


def _reduce_tiles(num_splits: int, group: int, block_d: int) -> tuple[int, int]:
    """The fused reduce's (BLOCK_S, BLOCK_CS): tiles [group, BLOCK_CS, D] of <= 16K fp32 (H200
    sweep, kernels/bench/NOTES.md)."""
    block_s = triton.next_power_of_2(num_splits)
    return block_s, max(1, min(block_s, 16384 // (triton.next_power_of_2(group) * block_d)))


def _checked_semaphores(semaphores: torch.Tensor | None, device: torch.device, count: int) -> torch.Tensor:
    """The fused reduce's zeroed int32 counters: those given, else the stream's shared ones."""
    if semaphores is None:
        semaphores = decode_semaphores(device, count)
    assert semaphores.dtype == torch.int32 and semaphores.is_contiguous()
    assert semaphores.numel() >= count
    return semaphores


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    max_seq_len: int | None = None,
    block_n: int | None = None,
    num_warps: int = 4,
    num_stages: int | None = None,
    fused_reduce: bool = True,
    semaphores: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    fp8_f16_dots: bool = True,
    prefetch: bool | None = None,
    window: int | None = None, sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one new token per request over its paged KV cache (window: only the last
    `window` keys, sliding-window attention; sinks: [Hq] per-head sink logits (GPT-OSS), one
    more score per query in the softmax's denominator, with no value).

    q: [B, Hq, D]; k_cache/v_cache: [num_pages, page_size, Hkv, D]; page_table: [B, max_pages] int32;
    seq_lens: [B] int32 (tokens in cache, including the new one, >= 1). Returns out [B, Hq, D] in
    q.dtype. Pass num_splits (fixed) under CUDA graphs; else it is derived from max_seq_len
    (read from seq_lens, a host sync, when not given). block_n/num_warps/num_stages: tuning knobs.
    fused_reduce: one kernel (the last split program per kv head reduces) instead of split kernel
    + reduce kernel; semaphores: its [>= B * Hkv] int32 zero counters, zero again on return
    (default: decode_semaphores(q.device, ...), shared by the launches of one stream).
    An fp8 cache (float8_e4m3fn / float8_e5m2) holds K / k_scale and V / v_scale; fp8_f16_dots
    and prefetch: see the module docstring.
    """
    batch, hq, head_dim = q.shape
    _, page_size, hkv, _ = k_cache.shape
    _check_inputs(q, k_cache, v_cache, k_scale, v_scale, sinks)
    group = hq // hkv
    # fp8 (or any other cache dtype than q's): converted to q's dtype in registers.
    kv_cast = k_cache.dtype != q.dtype
    out = torch.empty_like(q) if out is None else out
    if batch == 0:
        return out
    if num_splits is None:
        if max_seq_len is None:
            max_seq_len = int(seq_lens.max().item())
        num_splits = default_num_splits(batch, hkv, max_seq_len)
    block_d = triton.next_power_of_2(head_dim)
    block_h = max(16, triton.next_power_of_2(group))
    block_n = block_n or (64 if block_d <= 128 else 32)
    num_stages = num_stages or (3 if kv_cast else 2)
    prefetch = kv_cast if prefetch is None else prefetch
    part_out = torch.empty((batch, hq, num_splits, head_dim), dtype=torch.float32, device=q.device)
    part_lse = torch.empty((batch, hq, num_splits), dtype=torch.float32, device=q.device)
    block_s, block_cs = 1, 1  # (unused without the fused reduce: one compiled variant)
    if fused_reduce:
        block_s, block_cs = _reduce_tiles(num_splits, group, block_d)
        semaphores = _checked_semaphores(semaphores, q.device, batch * hkv)
    _decode_split_kernel[(batch, hkv, num_splits)](
        q, k_cache, v_cache, page_table, seq_lens, part_out, part_lse, out,
        semaphores if fused_reduce else part_lse,  # (unused without the fused reduce)
        scale * LOG2E * k_scale, v_scale,
        q.stride(0), q.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3], page_table.stride(0),
        *part_out.stride()[:3], *part_lse.stride()[:2], out.stride(0), out.stride(1),
        num_splits, group, q if sinks is None else sinks, window or 0,
        BLOCK_H=block_h, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_N=block_n, PAGE_SIZE=page_size,
        DOT_PREC=dot_precision(q.dtype), UPCAST=upcast_dot(q.dtype), KV_CAST=kv_cast,
        Q_F16=fp8_f16_dots and kv_cast and q.dtype in (torch.float16, torch.bfloat16),
        FUSED_REDUCE=fused_reduce, BLOCK_G=triton.next_power_of_2(group), BLOCK_S=block_s, BLOCK_CS=block_cs,
        PREFETCH=prefetch, HAS_SINKS=sinks is not None, SLIDING=(window or 0) > 0, num_warps=num_warps,
        num_stages=num_stages)  # fmt: skip
    if fused_reduce:
        return out
    _decode_reduce_kernel[(batch, hq)](
        part_out, part_lse, out, *part_out.stride()[:3], *part_lse.stride()[:2], out.stride(0),
        out.stride(1), num_splits, HEAD_DIM=head_dim, BLOCK_D=block_d,
        BLOCK_S=triton.next_power_of_2(num_splits), num_warps=4 if block_d >= 128 else 2,
    )  # fmt: skip
    return out
