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


@triton.jit
def _attention_kernel(q_ptr, k_ptr, v_ptr, out_ptr, page_table_ptr, token_row_ptr, token_pos_ptr,
                      scale, k_scale, v_scale, window, stride_qt, stride_qh, stride_ot, stride_oh,
                      stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, stride_pt,
                      PAGE_SIZE: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
                      HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, TILE: tl.constexpr):  # fmt: skip
    t = tl.program_id(0)  # one query token (any request, decode or prefill row) ...
    h = tl.program_id(1)  # ... and one KV head with its GROUP query heads
    row = tl.load(token_row_ptr + t)
    pos = tl.load(token_pos_ptr + t)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, D_PAD)
    q_mask = (g[:, None] < GROUP) & (d[None, :] < HEAD_DIM)
    q = tl.load(q_ptr + t * stride_qt + (h * GROUP + g[:, None]) * stride_qh + d[None, :],
                mask=q_mask, other=0.0)
    m = tl.full((GROUP_PAD,), float("-inf"), tl.float32)
    l = tl.zeros((GROUP_PAD,), tl.float32)
    acc = tl.zeros((GROUP_PAD, D_PAD), tl.float32)
    offs = tl.arange(0, TILE)
    for start in range(0, pos + 1, TILE):  # the row's own keys, tile after tile from 0
        kp = start + offs
        keep = kp <= pos
        if window > 0:
            keep = keep & (kp > pos - window)
        page = tl.load(page_table_ptr + row * stride_pt + kp // PAGE_SIZE, mask=kp <= pos, other=0)
        slot = kp % PAGE_SIZE
        kv_mask = keep[:, None] & (d[None, :] < HEAD_DIM)
        k = tl.load(k_ptr + page[:, None] * stride_kp + slot[:, None] * stride_ks + h * stride_kh
                    + d[None, :], mask=kv_mask, other=0.0).to(tl.float32) * k_scale
        v = tl.load(v_ptr + page[:, None] * stride_vp + slot[:, None] * stride_vs + h * stride_vh
                    + d[None, :], mask=kv_mask, other=0.0).to(tl.float32) * v_scale
        s = tl.dot(q.to(tl.float32), tl.trans(k), input_precision="ieee") * scale
        s = tl.where(keep[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        live = m_new > float("-inf")  # a tile before a sliding window: nothing seen yet
        alpha = tl.where(live, tl.exp(m - m_new), 1.0)
        p = tl.where(live[:, None], tl.exp(s - m_new[:, None]), 0.0)
        l = l * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        m = m_new
    o = acc / tl.maximum(l, 1e-30)[:, None]
    tl.store(out_ptr + t * stride_ot + (h * GROUP + g[:, None]) * stride_oh + d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=q_mask)


def attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              page_table: torch.Tensor, token_row: torch.Tensor, token_pos: torch.Tensor,
              scale: float, out: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0,
              window: int | None = None) -> torch.Tensor:
    """Batch-invariant paged attention: every query token t (decode or prefill row alike) attends
    to keys 0..token_pos[t] of page-table row token_row[t], in KV_TILE tiles from position 0
    with an fp32 online softmax, so its result depends on its own keys only.

    q, out: [T, Hq, D]; k_cache/v_cache: [num_pages, page_size, Hkv, D] (the step's K/V already
    written); page_table: [R, W] int32; token_row/token_pos: [T] int32. One program per
    (token, KV head): no reuse of K/V across a prompt's rows (slower prefill than the extend
    kernels), exact fp32 dots."""
    t, (hq, d) = token_row.shape[0], q.shape[1:]  # q may carry padding rows past the tokens
    hk = k_cache.shape[2]
    group = hq // hk
    if t == 0:
        return out
    _attention_kernel[(t, hk)](
        q, k_cache, v_cache, out, page_table, token_row, token_pos, scale, float(k_scale),
        float(v_scale), int(window or 0), q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0),
        v_cache.stride(1), v_cache.stride(2), page_table.stride(0), PAGE_SIZE=k_cache.shape[1],
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=d,
        D_PAD=max(16, triton.next_power_of_2(d)), TILE=KV_TILE, num_warps=4)  # fmt: skip
    return out
