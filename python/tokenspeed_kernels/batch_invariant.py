"""Batch-invariant matmul: out[M, N] = a[M, K] @ b[K, N], each row's result independent of M.

cuBLAS picks its kernel (tile shape, split-K) by the problem size, so a row's dot products are
summed in an order that moves with the number of rows in the batch. This kernel has one tile
config for every M and no split-K: each program owns a BLOCK_M x BLOCK_N output tile and walks K
from 0 in BLOCK_K steps, accumulating in fp32, so the reduction order of an output element
depends on K alone. `M` is not specialised (do_not_specialize), so M = 1 and M = 4096 run the
same compiled kernel. Used by `--enable-deterministic-inference` (tokenspeed.layers.batch_invariant).
Slower than cuBLAS for large M (one config tuned for nothing in particular); the cost is measured
by the scoreboard (docs/deterministic.md).
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

BLOCK_M, BLOCK_N, BLOCK_K = 64, 128, 64
NUM_WARPS, NUM_STAGES = 4, 3


@triton.jit(do_not_specialize=["M"])
def _matmul_kernel(a_ptr, b_ptr, c_ptr, M, N, K, stride_am, stride_ak, stride_bk, stride_bn,
                   stride_cm, stride_cn, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        a = tl.load(a_ptr + rm[:, None] * stride_am + kk[None, :] * stride_ak,
                    mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
        b = tl.load(b_ptr + kk[:, None] * stride_bk + rn[None, :] * stride_bn,
                    mask=(kk[:, None] < K) & (rn[None, :] < N), other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    c = acc.to(c_ptr.dtype.element_ty)
    tl.store(c_ptr + rm[:, None] * stride_cm + rn[None, :] * stride_cn, c,
             mask=(rm[:, None] < M) & (rn[None, :] < N))


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [M, K] @ b [K, N] (b may be a transposed view, e.g. weight.t()), in a's dtype."""
    assert a.dim() == 2 and b.dim() == 2 and a.shape[1] == b.shape[0], (a.shape, b.shape)
    m, k = a.shape
    n = b.shape[1]
    out = torch.empty((m, n), dtype=a.dtype, device=a.device)
    if m == 0:
        return out
    grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N))
    _matmul_kernel[grid](a, b, out, m, n, k, a.stride(0), a.stride(1), b.stride(0), b.stride(1),
                         out.stride(0), out.stride(1), BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
                         BLOCK_K=BLOCK_K, PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
                         num_warps=NUM_WARPS, num_stages=NUM_STAGES)  # fmt: skip
    return out


KV_TILE = 64  # keys per step of the attention loop, aligned at position 0 (as the CPU path)
Q_ROWS = 64  # dot rows per program: (query token, query head of the KV head) pairs


def tokens_per_block(group: int) -> int:
    """Query tokens of one request per program (a decode: one, the rest masked)."""
    return max(1, Q_ROWS // triton.next_power_of_2(group))


@triton.jit
def _attention_kernel(q_ptr, k_ptr, v_ptr, out_ptr, page_table_ptr, blk_row_ptr, blk_tok_ptr,
                      blk_len_ptr, blk_pos_ptr, sinks_ptr, scale, k_scale, v_scale, window, stride_qt,
                      stride_qh, stride_ot, stride_oh, stride_kp, stride_ks, stride_kh, stride_vp,
                      stride_vs, stride_vh, stride_pt, PAGE_SIZE: tl.constexpr,
                      BM: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
                      HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, TILE: tl.constexpr,
                      PRECISION: tl.constexpr, HAS_SINKS: tl.constexpr):  # fmt: skip
    b = tl.program_id(0)  # up to BM consecutive query tokens of one request ...
    h = tl.program_id(1)  # ... and one KV head with its GROUP query heads
    row = tl.load(blk_row_ptr + b)
    tok0 = tl.load(blk_tok_ptr + b)
    count = tl.load(blk_len_ptr + b)
    pos0 = tl.load(blk_pos_ptr + b)
    r = tl.arange(0, BM * GROUP_PAD)  # one dot row per (token, query head): rows are independent
    ti = r // GROUP_PAD
    gi = r % GROUP_PAD
    valid = (ti < count) & (gi < GROUP)
    q_pos = pos0 + ti
    d = tl.arange(0, D_PAD)
    q_off = (tok0 + ti[:, None]) * stride_qt + (h * GROUP + gi[:, None]) * stride_qh + d[None, :]
    q_mask = valid[:, None] & (d[None, :] < HEAD_DIM)
    q = tl.load(q_ptr + q_off, mask=q_mask, other=0.0)
    m = tl.full((BM * GROUP_PAD,), float("-inf"), tl.float32)
    l = tl.zeros((BM * GROUP_PAD,), tl.float32)
    if HAS_SINKS:  # each query head's sink logit starts its softmax: max = sink, sum = 1
        m = tl.load(sinks_ptr + h * GROUP + gi, mask=gi < GROUP, other=float("-inf")).to(tl.float32)
        l = tl.where(m > float("-inf"), 1.0, 0.0)
    acc = tl.zeros((BM * GROUP_PAD, D_PAD), tl.float32)
    offs = tl.arange(0, TILE)
    last = pos0 + count - 1
    # Tiles from position 0 up to the block's last key; past a row's own last key a tile is all
    # masked for that row and adds exact zeros (alpha 1, p 0), so a row's result does not depend
    # on the other rows of its block.
    for start in range(0, last + 1, TILE):
        kp = start + offs
        cached = kp <= last
        page = tl.load(page_table_ptr + row * stride_pt + kp // PAGE_SIZE, mask=cached, other=0)
        slot = kp % PAGE_SIZE
        kv_mask = cached[:, None] & (d[None, :] < HEAD_DIM)
        k = tl.load(k_ptr + page[:, None] * stride_kp + slot[:, None] * stride_ks + h * stride_kh
                    + d[None, :], mask=kv_mask, other=0.0).to(q.dtype)
        v = tl.load(v_ptr + page[:, None] * stride_vp + slot[:, None] * stride_vs + h * stride_vh
                    + d[None, :], mask=kv_mask, other=0.0).to(q.dtype)
        # The model dtype's tensor-core dot (exact fp32 for fp32), fp32 accumulation; fp8 caches
        # hold K / k_scale: the scale multiplies the scores (V's the output).
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * (scale * k_scale)
        keep = kp[None, :] <= q_pos[:, None]
        if window > 0:
            keep = keep & (kp[None, :] > q_pos[:, None] - window)
        s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        live = m_new > float("-inf")  # a tile before a sliding window: nothing seen yet
        alpha = tl.where(live, tl.exp(m - m_new), 1.0)
        p = tl.where(live[:, None], tl.exp(s - m_new[:, None]), 0.0)
        l = l * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m = m_new
    o = acc * v_scale / tl.maximum(l, 1e-30)[:, None]
    o_off = (tok0 + ti[:, None]) * stride_ot + (h * GROUP + gi[:, None]) * stride_oh + d[None, :]
    tl.store(out_ptr + o_off, o.to(out_ptr.dtype.element_ty), mask=q_mask)


def attention_blocks(num_tokens: np.ndarray, start_pos: np.ndarray, query_start: np.ndarray,
                     group: int) -> np.ndarray:
    """The launch's blocks for a step: [4, n] int32 rows (request row, first query token, token
    count <= tokens_per_block(group), first position), each request's new tokens cut from its
    first one. Which tokens share a block does not change any token's result."""
    per = tokens_per_block(group)
    out = []
    for i, (n, pos, q0) in enumerate(zip(num_tokens.tolist(), start_pos.tolist(),
                                         query_start.tolist())):
        for off in range(0, n, per):
            out.append((i, q0 + off, min(per, n - off), pos + off))
    return np.asarray(out, dtype=np.int32).reshape(-1, 4).T.copy()


def attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              page_table: torch.Tensor, blocks: torch.Tensor, scale: float, out: torch.Tensor,
              k_scale: float = 1.0, v_scale: float = 1.0,
              window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Batch-invariant paged attention: every query token (decode or prefill row alike) attends
    to its request's keys 0..its position in KV_TILE tiles from position 0, with an fp32 online
    softmax, so its result depends on its own keys only, not on the step's other tokens or on
    how its prompt was chunked.

    q, out: [T, Hq, D]; k_cache/v_cache: [num_pages, page_size, Hkv, D] (the step's K/V already
    written); page_table: [R, W] int32; blocks: `attention_blocks` (same group) on the device.
    One program per (block of tokens, KV head), K/V tiles shared by the block's tokens; dots in
    the model dtype (exact fp32 for fp32) with fp32 accumulation. sinks: [Hq] per-head sink
    logits (GPT-OSS), one more score per query in the softmax's denominator, with no value."""
    hq, d = q.shape[1:]
    hk = k_cache.shape[2]
    group = hq // hk
    if blocks.shape[1] == 0:
        return out
    row, tok, count, pos = blocks
    group_pad = triton.next_power_of_2(group)
    _attention_kernel[(blocks.shape[1], hk)](
        q, k_cache, v_cache, out, page_table, row, tok, count, pos, q if sinks is None else sinks, scale, float(k_scale),
        float(v_scale), int(window or 0), q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0),
        v_cache.stride(1), v_cache.stride(2), page_table.stride(0), PAGE_SIZE=k_cache.shape[1],
        BM=tokens_per_block(group), GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=d,
        D_PAD=max(16, triton.next_power_of_2(d)), TILE=KV_TILE,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", HAS_SINKS=sinks is not None,
        num_warps=4,
        num_stages=2)  # fmt: skip
    return out
