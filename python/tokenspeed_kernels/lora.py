"""Multi-LoRA kernels: y += (x A_s^T) B_s^T for every token, with s the token's adapter slot.

Two steps, as Punica / S-LoRA name them: *shrink* (x [T, K] → xa [T, nsub*R], through the
adapter's stacked A [S, nsub*R, K]) and *expand* (xa → y [T, OUT] += xa_i B_s,i^T, through the
stacked B [S, OUT, R]; output columns of sub-projection i (q/k/v of a fused qkv, gate/up) read
rank block i of xa). The scaling (alpha / r) is folded into B when an adapter is loaded.

Two launch shapes of each:

* BGMV (per token): one program per (token, column block, K slice), the adapter slot read
  from `token_slot[t]` on the device. Its grid depends only on the token count, so it runs
  inside CUDA graphs (decode and extend graphs write `token_slot` before a replay; padding rows
  and base-model rows hold -1 and return at once). Weight-bandwidth bound, as decode is: the
  shrink's N (nsub * rank) is tiny, so a decode batch would be only T programs each streaming
  a whole [N, K] slab; the K slices (split-K) give the GPU T * slices programs, and the expand
  sums the slices' fp32 partials in a fixed order (deterministic, no atomics, no extra kernel).
* Merge (per token, after a *stacked* GEMM): when the layer keeps the pool's A under its base
  weight ([W; A_0; ..; A_{S-1}], layers/lora.py), one GEMM yields the base output and every
  slot's x A_s^T, and `bgmv_merge` adds each row's xa B^T while copying the base columns out
  contiguously: one launch per projection instead of shrink + expand (what the per-token
  path, i.e. the CUDA graphs, runs for such layers).
* SGMV (per segment): tokens of one request are contiguous and share an adapter, so one
  program multiplies a [BLOCK_M, K] tile of a segment by the adapter's weights with tl.dot:
  each weight tile is read once per BLOCK_M tokens instead of once per token (prefill). The
  grid needs the segment count and the longest segment on the host: eager steps only.

Rows whose slot is -1 (the base model) are neither read nor written by shrink, and left as
they are by expand.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _bgmv_shrink_kernel(x_ptr, a_ptr, out_ptr, slot_ptr, K, N, K_SLICE, stride_xt, stride_as,
                        stride_an, stride_ok, stride_ot, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr):
    t = tl.program_id(0)
    s = tl.load(slot_ptr + t).to(tl.int64)
    if s < 0:
        return
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.program_id(2)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    k_end = tl.minimum(K, (ks + 1) * K_SLICE)
    for k0 in range(ks * K_SLICE, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        xv = tl.load(x_ptr + t * stride_xt + offs_k, mask=offs_k < k_end, other=0.0).to(tl.float32)
        a = tl.load(a_ptr + s * stride_as + offs_n[:, None] * stride_an + offs_k[None, :],
                    mask=(offs_n[:, None] < N) & (offs_k[None, :] < k_end), other=0.0)
        acc += tl.sum(a.to(tl.float32) * xv[None, :], axis=1)
    tl.store(out_ptr + ks * stride_ok + t * stride_ot + offs_n, acc, mask=offs_n < N)


@triton.jit
def _bgmv_expand_kernel(xa_ptr, b_ptr, y_ptr, slot_ptr, R, OUT, off1, off2, SLICES, stride_xak,
                        stride_xat, stride_bs, stride_bn, stride_yt, BLOCK_N: tl.constexpr,
                        BLOCK_R: tl.constexpr):
    t = tl.program_id(0)
    s = tl.load(slot_ptr + t).to(tl.int64)
    if s < 0:
        return
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, BLOCK_R)
    # Column n belongs to sub-projection (n >= off1) + (n >= off2), which reads rank block sub.
    sub = (offs_n >= off1).to(tl.int32) + (offs_n >= off2).to(tl.int32)
    n_ok = offs_n < OUT
    r_ok = offs_r < R
    xa = tl.zeros([BLOCK_N, BLOCK_R], dtype=tl.float32)
    for ks in range(SLICES):  # the shrink's K slices, summed in a fixed order
        xa += tl.load(xa_ptr + ks * stride_xak + t * stride_xat + sub[:, None] * R + offs_r[None, :],
                      mask=n_ok[:, None] & r_ok[None, :], other=0.0)
    # Rounded to the activation dtype between the two matmuls, as the segment path and the
    # torch reference do.
    xa = xa.to(y_ptr.dtype.element_ty).to(tl.float32)
    b = tl.load(b_ptr + s * stride_bs + offs_n[:, None] * stride_bn + offs_r[None, :],
                mask=n_ok[:, None] & r_ok[None, :], other=0.0)
    delta = tl.sum(xa * b.to(tl.float32), axis=1)
    y_ptrs = y_ptr + t * stride_yt + offs_n
    y = tl.load(y_ptrs, mask=n_ok, other=0.0)
    tl.store(y_ptrs, (y.to(tl.float32) + delta).to(y_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def _bgmv_merge_kernel(out_ptr, b_ptr, y_ptr, slot_ptr, R, N, OUT, off1, off2, stride_ot,
                       stride_bs, stride_bn, stride_yt, NSUB: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_R: tl.constexpr):
    t = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < OUT
    row = out_ptr + t * stride_ot
    y = tl.load(row + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    s = tl.load(slot_ptr + t).to(tl.int64)
    if s >= 0:
        offs_r = tl.arange(0, BLOCK_R)
        r_ok = offs_r < R
        # Column n belongs to sub-projection (n >= off1) + (n >= off2) and reads rank block sub
        # of this slot's x A^T, which the stacked GEMM wrote after the OUT base columns.
        sub = (offs_n >= off1).to(tl.int32) + (offs_n >= off2).to(tl.int32)
        xa = tl.zeros([BLOCK_N, BLOCK_R], dtype=tl.float32)
        for i in tl.static_range(NSUB):
            xi = tl.load(row + OUT + s * N + i * R + offs_r, mask=r_ok, other=0.0).to(tl.float32)
            xa = tl.where((sub == i)[:, None], xi[None, :], xa)
        b = tl.load(b_ptr + s * stride_bs + offs_n[:, None] * stride_bn + offs_r[None, :],
                    mask=n_ok[:, None] & r_ok[None, :], other=0.0)
        y += tl.sum(xa * b.to(tl.float32), axis=1)
    tl.store(y_ptr + t * stride_yt + offs_n, y.to(y_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def _segment_tile(seg_start_ptr, seg_len_ptr, seg_slot_ptr, BLOCK_M: tl.constexpr):
    """The SGMV program's tile (program 0: the segment, 1: its block of rows): the segment's
    adapter slot, the tile's token rows and which of them lie in the segment, and whether the
    tile is idle (a segment without an adapter, or rows past its end)."""
    g = tl.program_id(0)
    s = tl.load(seg_slot_ptr + g).to(tl.int64)
    seg_len = tl.load(seg_len_ptr + g)
    m0 = tl.program_id(1) * BLOCK_M
    rows = tl.load(seg_start_ptr + g).to(tl.int64) + m0 + tl.arange(0, BLOCK_M)
    m_ok = m0 + tl.arange(0, BLOCK_M) < seg_len
    return s, rows, m_ok, (s < 0) | (m0 >= seg_len)


@triton.jit
def _sgmv_shrink_kernel(x_ptr, a_ptr, out_ptr, seg_start_ptr, seg_len_ptr, seg_slot_ptr, K, N,
                        stride_xt, stride_as, stride_an, stride_ot, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    s, rows, m_ok, idle = _segment_tile(seg_start_ptr, seg_len_ptr, seg_slot_ptr, BLOCK_M)
    if idle:
        return
    offs_n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        x = tl.load(x_ptr + rows[:, None] * stride_xt + offs_k[None, :],
                    mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        a = tl.load(a_ptr + s * stride_as + offs_n[None, :] * stride_an + offs_k[:, None],
                    mask=(offs_n[None, :] < N) & k_ok[:, None], other=0.0)
        acc += tl.dot(x.to(tl.float32), a.to(tl.float32), input_precision="ieee")
    tl.store(out_ptr + rows[:, None] * stride_ot + offs_n[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & (offs_n[None, :] < N))


@triton.jit
def _sgmv_expand_kernel(xa_ptr, b_ptr, y_ptr, seg_start_ptr, seg_len_ptr, seg_slot_ptr, R, size,
                        col_off, r_off, stride_xat, stride_bs, stride_bn, stride_yt,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    s, rows, m_ok, idle = _segment_tile(seg_start_ptr, seg_len_ptr, seg_slot_ptr, BLOCK_M)
    if idle:
        return
    offs_n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < size
    offs_r = tl.arange(0, BLOCK_R)
    r_ok = offs_r < R
    xa = tl.load(xa_ptr + rows[:, None] * stride_xat + r_off + offs_r[None, :],
                 mask=m_ok[:, None] & r_ok[None, :], other=0.0)
    b = tl.load(b_ptr + s * stride_bs + (col_off + offs_n[None, :]) * stride_bn + offs_r[:, None],
                mask=n_ok[None, :] & r_ok[:, None], other=0.0)
    delta = tl.dot(xa.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    y_ptrs = y_ptr + rows[:, None] * stride_yt + col_off + offs_n[None, :]
    ok = m_ok[:, None] & n_ok[None, :]
    y = tl.load(y_ptrs, mask=ok, other=0.0)
    tl.store(y_ptrs, (y.to(tl.float32) + delta).to(y_ptr.dtype.element_ty), mask=ok)


def _pow2(n: int, lo: int = 16) -> int:
    return max(lo, triton.next_power_of_2(n))


# The shrink's K slices: about this many elements of K each, at most MAX_K_SLICES.
K_SLICE_TARGET = 512
MAX_K_SLICES = 8
BGMV_BLOCK_K = 128


def bgmv_slices(k: int) -> int:
    """How many K slices bgmv_shrink splits a reduction of length k into."""
    return max(1, min(MAX_K_SLICES, k // K_SLICE_TARGET))


def bgmv_shrink(x: torch.Tensor, a: torch.Tensor, token_slot: torch.Tensor,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """Partial products of x[t] @ a[token_slot[t]]^T over `bgmv_slices(K)` slices of K, fp32
    [slices, T, N] (their sum is the product; bgmv_expand sums them). Rows with slot -1 are
    not written. x [T, K], a [S, N, K], token_slot int32 [>= T]."""
    t, k = x.shape
    n = a.shape[1]
    slices = bgmv_slices(k)
    if out is None:
        out = torch.empty(slices, t, n, dtype=torch.float32, device=x.device)
    k_slice = triton.cdiv(triton.cdiv(k, slices), BGMV_BLOCK_K) * BGMV_BLOCK_K
    block_n = min(_pow2(n), 64)
    grid = (t, triton.cdiv(n, block_n), triton.cdiv(k, k_slice))
    _bgmv_shrink_kernel[grid](x, a, out, token_slot, k, n, k_slice, x.stride(0), a.stride(0),
                              a.stride(1), out.stride(0), out.stride(1), BLOCK_N=block_n,
                              BLOCK_K=BGMV_BLOCK_K)
    return out


def bgmv_expand(xa: torch.Tensor, b: torch.Tensor, token_slot: torch.Tensor, y: torch.Tensor,
                sub_offsets: tuple[int, ...], rank: int) -> torch.Tensor:
    """y[t, cols of sub i] += xa[t, i*rank:(i+1)*rank] @ b[slot, cols of sub i]^T, in place.
    xa: bgmv_shrink's partials [slices, T, nsub*rank]; b [S, OUT, rank], y [T, OUT];
    sub_offsets: first column of subs 1.. (at most 2, i.e. up to three sub-projections)."""
    t, out_cols = y.shape
    offs = (*sub_offsets, out_cols, out_cols)[:2]
    block_n = 32
    grid = (t, triton.cdiv(out_cols, block_n))
    _bgmv_expand_kernel[grid](xa, b, y, token_slot, rank, out_cols, offs[0], offs[1],
                              xa.shape[0], xa.stride(0), xa.stride(1), b.stride(0), b.stride(1),
                              y.stride(0), BLOCK_N=block_n, BLOCK_R=_pow2(rank))
    return y


def bgmv_merge(out: torch.Tensor, b: torch.Tensor, token_slot: torch.Tensor,
               sub_offsets: tuple[int, ...], rank: int, y: torch.Tensor | None = None
               ) -> torch.Tensor:
    """The expand of a *stacked* GEMM: `out` [T, OUT + S*N] = x @ [W; A_0; ..; A_{S-1}]^T holds
    the base output (its first OUT columns) and every pool slot's x A_s^T (N = nsub*rank
    columns each, slot s at OUT + s*N). Returns y [T, OUT] (contiguous, new unless given):
    y[t] = out[t, :OUT] + xa_{slot}[t, rank block i] @ b[slot, cols of sub i]^T; rows with
    slot -1 are the base output copied. One launch per projection, no shrink launch."""
    t = out.shape[0]
    out_cols = b.shape[1]
    n = (out.shape[1] - out_cols) // b.shape[0]
    if y is None:
        y = torch.empty(t, out_cols, dtype=out.dtype, device=out.device)
    offs = (*sub_offsets, out_cols, out_cols)[:2]
    block_n = 128
    grid = (t, triton.cdiv(out_cols, block_n))
    _bgmv_merge_kernel[grid](out, b, y, token_slot, rank, n, out_cols, offs[0], offs[1],
                             out.stride(0), b.stride(0), b.stride(1), y.stride(0),
                             NSUB=len(sub_offsets) + 1, BLOCK_N=block_n, BLOCK_R=_pow2(rank))
    return y


def sgmv_shrink(x: torch.Tensor, a: torch.Tensor, seg_start: torch.Tensor, seg_len: torch.Tensor,
                seg_slot: torch.Tensor, max_len: int, out: torch.Tensor) -> torch.Tensor:
    """Per segment g (rows seg_start[g] .. + seg_len[g]): out[rows] = x[rows] @ a[seg_slot[g]]^T.
    The segment arrays are int32 device tensors; max_len is the longest segment (host)."""
    k, n = x.shape[1], a.shape[1]
    block_m, block_n = 16, min(_pow2(n), 64)
    grid = (seg_start.shape[0], triton.cdiv(max_len, block_m), triton.cdiv(n, block_n))
    _sgmv_shrink_kernel[grid](x, a, out, seg_start, seg_len, seg_slot, k, n, x.stride(0),
                              a.stride(0), a.stride(1), out.stride(0), BLOCK_M=block_m,
                              BLOCK_N=block_n, BLOCK_K=64)
    return out


def sgmv_expand(xa: torch.Tensor, b: torch.Tensor, seg_start: torch.Tensor, seg_len: torch.Tensor,
                seg_slot: torch.Tensor, max_len: int, y: torch.Tensor,
                sub_sizes: tuple[int, ...], rank: int) -> torch.Tensor:
    """The segment form of bgmv_expand; sub_sizes: output columns of each sub-projection."""
    block_m, block_n = 16, 64
    col = 0
    for i, size in enumerate(sub_sizes):
        grid = (seg_start.shape[0], triton.cdiv(max_len, block_m), triton.cdiv(size, block_n))
        _sgmv_expand_kernel[grid](xa, b, y, seg_start, seg_len, seg_slot, rank, size, col, i * rank,
                                  xa.stride(0), b.stride(0), b.stride(1), y.stride(0),
                                  BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=_pow2(rank))
        col += size
    return y
