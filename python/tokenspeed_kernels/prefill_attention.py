"""Causal attention of fresh prompts (no cached prefix) over their own contiguous K/V: the
`paged_extend_attention` of a step whose requests all start at position 0, reading keys and
values straight from the QKV projection's output with TMA (tensor-descriptor) loads instead of
gathering them page by page from the cache. Hopper and newer (TMA); the paged kernel elsewhere.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from tokenspeed_kernels.extend_attention import LOG2E, wide_head_config


@triton.jit
def _prefill_tile(q, acc, m_i, l_i, k_desc, v_desc, row0, kv_col, n0, offs_m, offs_n, qk_scale,
                  MASKED: tl.constexpr):
    """One online-softmax step over keys [n0, n0 + BLOCK_N) of the request starting at row0."""
    k = k_desc.load([row0 + n0, kv_col])
    v = v_desc.load([row0 + n0, kv_col])
    s = tl.dot(q, tl.trans(k))
    if MASKED:  # keys past a row's position (the request's end included) are hidden
        s = tl.where(n0 + offs_n[None, :] <= offs_m[:, None], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
    else:
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        p = tl.exp2(s * qk_scale - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
    return acc, m_new, l_i


@triton.jit
def _prefill_kernel(q_desc, k_desc, v_desc, out_ptr, q_start_loc_ptr, sinks_ptr, qk_scale, stride_ot,
                    stride_oh, group, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, HAS_SINKS: tl.constexpr):
    """One program = one (request, q head, BLOCK_M new tokens); the last blocks launch first.
    HAS_SINKS: the online softmax starts from the head's sink logit (sinks_ptr [Hq], natural-log
    units): max = the sink, sum = 1, no value."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    mblk = tl.num_programs(2) - 1 - tl.program_id(2)
    row0 = tl.load(q_start_loc_ptr + b)
    n_new = tl.load(q_start_loc_ptr + b + 1) - row0
    m0 = mblk * BLOCK_M
    if m0 >= n_new:
        return
    kv_col = (h // group) * HEAD_DIM
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    # Rows past the request (the next request's, or zeros past the last) are computed, not stored;
    # every row sees key 0, so no row's maximum stays -inf.
    q = q_desc.load([row0 + m0, h * HEAD_DIM])
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + h).to(tl.float32) * 1.4426950408889634  # log2 units (LOG2E)
        m_i = tl.full([BLOCK_M], 0.0, dtype=tl.float32) + sink
        l_i = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    full_end = m0 // BLOCK_N * BLOCK_N
    for n0 in range(0, full_end, BLOCK_N):
        acc, m_i, l_i = _prefill_tile(q, acc, m_i, l_i, k_desc, v_desc, row0, kv_col, n0, offs_m,
                                      offs_n, qk_scale, False)
    for n0 in range(full_end, tl.minimum(n_new, m0 + BLOCK_M), BLOCK_N):
        acc, m_i, l_i = _prefill_tile(q, acc, m_i, l_i, k_desc, v_desc, row0, kv_col, n0, offs_m,
                                      offs_n, qk_scale, True)
    out = acc / l_i[:, None]
    offs_d = tl.arange(0, HEAD_DIM)
    rows = (row0 + offs_m).to(tl.int64)
    tl.store(out_ptr + rows[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=(offs_m < n_new)[:, None])


@functools.cache
def prefill_supported(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether `prefill_attention` runs here: TMA (compute capability 9+), bf16/fp16, and a head
    size its GPU tests cover (64, 128)."""
    return (device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9
            and dtype in (torch.bfloat16, torch.float16) and head_dim in (64, 128))


def prefill_layout_ok(*tensors: torch.Tensor) -> bool:
    """Whether q, k and v can back its tensor descriptors: each token's heads adjacent, rows
    starting 16-byte aligned (views of a fused QKV row are)."""
    return all(t.stride(-1) == 1 and t.stride(-2) == t.shape[-1] and t.data_ptr() % 16 == 0
               and t.stride(0) * t.element_size() % 16 == 0 for t in tensors)


def prefill_config(head_dim: int, device: torch.device | None = None) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages). D=128 on the H100 (bench_prefill_attention.py,
    session 14): 128x128x8x3 is fastest at 4096 tokens (454 TF/s; 2 stages 388, 128x64 397,
    64x64x4x3 437); a warp-specialized main loop (tl.range(warp_specialize=True)) gained nothing.
    D=64 takes the same tiles (tested, not tuned); wider heads smaller ones (`wide_head_config`)."""
    if head_dim > 128:
        return wide_head_config(device)
    return 128, 128, 8, 3


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_start_loc: torch.Tensor,
                      scale: float, max_new_tokens: int, out: torch.Tensor | None = None,
                      config: tuple[int, int, int, int] | None = None,
                      sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of each request's tokens over its own earlier tokens (sinks: [Hq]
    per-head sink logits, GPT-OSS: one more score per query in the softmax's denominator).

    q: [T, Hq, D]; k, v: [T, Hkv, D] (rotated k), requests' tokens concatenated, each possibly a
    strided view of a fused QKV output (a token's heads adjacent); q_start_loc: [B+1] int32
    cumulative offsets; max_new_tokens: the longest request (sizes the grid). Returns [T, Hq, D].
    """
    from triton.tools.tensor_descriptor import TensorDescriptor

    total, hq, head_dim = q.shape
    hkv = k.shape[1]
    assert hq % hkv == 0, "Hq must be a multiple of Hkv"
    assert prefill_layout_ok(q, k, v), "heads must be adjacent in a row, rows 16-byte aligned"
    assert sinks is None or (sinks.shape == (hq,) and sinks.is_contiguous()), "sinks: [Hq]"
    if out is None:
        out = torch.empty_like(q)
    batch = q_start_loc.shape[0] - 1
    if total == 0 or batch == 0:
        return out
    block_m, block_n, warps, stages = config or prefill_config(head_dim, q.device)

    def desc(t: torch.Tensor, heads: int, rows: int) -> TensorDescriptor:
        return TensorDescriptor(t, [total, heads * head_dim], [t.stride(0), 1], [rows, head_dim])

    grid = (batch, hq, triton.cdiv(max_new_tokens, block_m))
    _prefill_kernel[grid](
        desc(q, hq, block_m), desc(k, hkv, block_n), desc(v, hkv, block_n), out, q_start_loc,
        q if sinks is None else sinks, scale * LOG2E, out.stride(0), out.stride(1), hq // hkv,
        HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n, HAS_SINKS=sinks is not None,
        num_warps=warps, num_stages=stages)
    return out
