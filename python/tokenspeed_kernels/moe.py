"""Fused mixture-of-experts MLP: route → align tokens by expert → grouped GEMMs → weighted combine.

    weights, ids = moe_route(router_logits, top_k, renormalize)      softmax, top-k (, renormalise)
    align        = moe_align(ids, num_local_experts, expert_start, BLOCK_M)
    inter[a]     = silu(x[a // k] @ gate[e]^T) * (x[a // k] @ up[e]^T)   one grouped GEMM, SiLU fused
                   (or GPT-OSS's clamped SwiGLU, activation.gated_act; + expert biases if any)
    down[a]      = inter[a] @ down[e]^T (+ b2[e])                        a second grouped GEMM
    out[t]       = sum_j weights[t, j] * down[t * k + j]                  combine, fp32

FP8 experts with block scales (DeepSeek-V3's checkpoints): w13 / w2 fp8 with one fp32 scale per
[block_n, block_k] tile; x and the intermediate are quantised per token per block_k group first
(tokenspeed_kernels.fp8_block) and each K-block's fp8 partial product is scaled by the row's
group scale times the weight tile's scale (BLOCK_K = block_k), as the dense block GEMM does.

An "assignment" a = t * top_k + j is token t's j-th expert. `moe_align` sorts the assignments by
expert and pads each expert's run to a multiple of BLOCK_M, so that one program of a grouped GEMM
multiplies BLOCK_M rows that all use the same expert's weights (the vLLM/SGLang fused_moe layout).

Expert parallelism: only the experts [expert_start, expert_start + num_local) have weights here;
assignments to other experts are left out of the sort and out of the combine (their share of the
output comes from the ranks that hold them).

CUDA graphs: nothing here reads a device value on the host. Every shape is a function of the
static (tokens, top_k, experts, hidden, intermediate) of the call: the sorted-id buffer has room
for the worst case (`max_padded`), the GEMM grids cover it, and a program whose block lies past
the real padded length (a device scalar) returns at once. Routing, sorting and the block → expert
map are torch ops without host syncs (scatter_add instead of bincount, searchsorted instead of
nonzero), so a decode step at a captured batch size replays without re-planning.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tokenspeed_kernels._utils import dot_precision, interpreting, upcast_dot
from tokenspeed_kernels.activation import ACTIVATIONS, gated_act


def moe_route(router_logits: torch.Tensor, top_k: int,
              renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over experts (fp32), top-k, optionally renormalised to sum to 1 per token.
    Returns (weights [T, k] float32, expert ids [T, k] int32)."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)


@dataclass
class MoeAlignment:
    """Assignments grouped by local expert, each group padded to a multiple of `block_m`.

    sorted_ids[p]: the assignment at padded row p, or `num_assignments` for a padding row.
    block_expert[b]: the local expert of rows [b * block_m, (b + 1) * block_m), -1 past the end.
    num_padded: [1] int32 on the device, the padded length actually used."""

    sorted_ids: torch.Tensor
    block_expert: torch.Tensor
    num_padded: torch.Tensor
    num_assignments: int
    block_m: int


def max_padded(num_assignments: int, num_local: int, block_m: int) -> int:
    """Worst-case padded length: at most min(assignments, experts) experts are non-empty and each
    adds fewer than block_m padding rows."""
    worst = num_assignments + min(num_assignments, num_local) * (block_m - 1)
    return triton.cdiv(worst, block_m) * block_m


def moe_align(topk_ids: torch.Tensor, num_local: int, expert_start: int,
              block_m: int) -> MoeAlignment:
    """Sort the assignments by local expert (stable: token order inside an expert) and pad."""
    n = topk_ids.numel()
    dev = topk_ids.device
    cap = max_padded(n, num_local, block_m)
    local = topk_ids.reshape(-1).to(torch.int64) - expert_start
    # Experts held by other EP ranks go to an extra bucket `num_local` that is never computed.
    key = torch.where((local >= 0) & (local < num_local), local, num_local)
    counts = torch.zeros(num_local + 1, dtype=torch.int64, device=dev)
    counts.scatter_add_(0, key, torch.ones_like(key))
    padded = (counts[:num_local] + block_m - 1) // block_m * block_m
    pad_end = torch.cumsum(padded, 0)
    pad_start = pad_end - padded
    count_start = torch.cumsum(counts, 0) - counts
    order = torch.sort(key, stable=True).indices
    skey = key[order]
    rank_in_expert = torch.arange(n, device=dev) - count_start[skey]
    is_local = skey < num_local
    # Dropped assignments land in one spare slot past the end (then cut off).
    dest = torch.where(is_local, pad_start[skey.clamp(max=num_local - 1)] + rank_in_expert, cap)
    sorted_ids = torch.full((cap + 1,), n, dtype=torch.int32, device=dev)
    sorted_ids.scatter_(0, dest, order.to(torch.int32))
    block_start = torch.arange(0, cap, block_m, device=dev)
    expert = torch.searchsorted(pad_end, block_start, right=True)
    block_expert = torch.where(expert < num_local, expert, -1).to(torch.int32)
    return MoeAlignment(sorted_ids[:cap], block_expert, pad_end[-1:].to(torch.int32), n, block_m)


@triton.jit
def _scaled_dot(a, w, acc, as_ptrs, ws_ptrs, kb, mask_m, mask_n, SCALED: tl.constexpr,
                DOT_PREC: tl.constexpr):
    """acc + a . w; SCALED: one K-block of fp8 operands, its fp32 product times the rows' group
    scales and the columns' tile scales (a fresh partial sum per block: promoted every block)."""
    if SCALED:
        a_s = tl.load(as_ptrs + kb, mask=mask_m, other=0.0)
        w_s = tl.load(ws_ptrs + kb, mask=mask_n, other=0.0)
        return acc + tl.dot(a, w) * a_s[:, None] * w_s[None, :]
    else:
        return tl.dot(a, w, acc, input_precision=DOT_PREC)


@triton.jit
def _moe_gemm_kernel(
    a_ptr, w_ptr, out_ptr, sorted_ids_ptr, block_expert_ptr, num_padded_ptr, as_ptr, ws_ptr, bias_ptr,
    num_assignments, n_out, k_in, a_row_div,
    stride_am, stride_we, stride_wn, stride_om, stride_asm, stride_wse, stride_wsn, stride_be,
    alpha, limit,
    GATED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PREC: tl.constexpr, UPCAST: tl.constexpr, SCALED: tl.constexpr, SCALE_N: tl.constexpr,
    HAS_BIAS: tl.constexpr, ACT: tl.constexpr,
):
    """out[a, n] for BLOCK_M assignments a of one expert e and BLOCK_N outputs n:
    GATED: act(A[a // div] . W[e, n], A[a // div] . W[e, n_out + n])  (W = [gate; up]; act:
    gated_act's ACT with alpha / limit)
    else : A[a // div] . W[e, n].
    HAS_BIAS: bias [E, N] (N = 2 * n_out gated: gate then up) added before the activation.
    SCALED: fp8 A and W with block scales (A: [rows, K / BLOCK_K], W: [E, N / SCALE_N,
    K / BLOCK_K]), applied per K-block (_scaled_dot)."""
    pid = tl.program_id(0)
    num_n = tl.cdiv(n_out, BLOCK_N)
    pid_m = pid // num_n
    pid_n = pid % num_n
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if expert < 0:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    ids = tl.load(sorted_ids_ptr + offs_m)
    mask_m = ids < num_assignments
    rows = (ids // a_row_div).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < n_out
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows[:, None] * stride_am + offs_k[None, :]
    # W[e] is [rows n, cols k] with unit column stride; read it as the [BLOCK_K, BLOCK_N] B operand.
    w_ptrs = w_ptr + expert * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
    as_ptrs = as_ptr + rows * stride_asm  # the block scales' rows and columns (SCALED only)
    ws_ptrs = ws_ptr + expert * stride_wse + (offs_n // SCALE_N) * stride_wsn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k_in, BLOCK_K):
        mask_k = offs_k < k_in - k0
        a = tl.load(a_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        acc = _scaled_dot(a, w, acc, as_ptrs, ws_ptrs, k0 // BLOCK_K, mask_m, mask_n, SCALED, DOT_PREC)
        if GATED:  # the up rows' scales: n_out further down the grid (a multiple of SCALE_N)
            u = tl.load(w_ptrs + n_out * stride_wn, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
            if UPCAST:
                u = u.to(tl.float32)
            acc_up = _scaled_dot(a, u, acc_up, as_ptrs, ws_ptrs + (n_out // SCALE_N) * stride_wsn,
                                 k0 // BLOCK_K, mask_m, mask_n, SCALED, DOT_PREC)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if HAS_BIAS:
        b_ptrs = bias_ptr + expert * stride_be + offs_n
        acc += tl.load(b_ptrs, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        if GATED:
            acc_up += tl.load(b_ptrs + n_out, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    if GATED:
        acc = gated_act(acc, acc_up, ACT, alpha, limit)
    out_ptrs = out_ptr + ids[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _moe_combine_kernel(
    down_ptr,
    weights_ptr,
    ids_ptr,
    out_ptr,
    hidden,
    expert_start,
    num_local,
    stride_dm,
    stride_om,
    TOP_K: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """out[t, h] = sum_j w[t, j] * down[t * k + j, h] over the local experts j, in fp32."""
    t = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = offs_h < hidden
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        a = t * TOP_K + j
        local = tl.load(ids_ptr + a) - expert_start
        if (local >= 0) & (local < num_local):
            w = tl.load(weights_ptr + a)
            d = tl.load(down_ptr + a * stride_dm + offs_h, mask=mask_h, other=0.0)
            acc += w * d.to(tl.float32)
    tl.store(out_ptr + t * stride_om + offs_h, acc.to(out_ptr.dtype.element_ty), mask=mask_h)


@dataclass(frozen=True)
class MoeGemmConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def pick_config(num_assignments: int, num_local: int) -> MoeGemmConfig:
    """Tile sizes from the static shape. Few rows per expert (decode): the GEMMs stream expert
    weights, so the smallest BLOCK_M tensor cores take (16) wastes least; many rows: larger tiles
    reuse each weight tile across more rows. (Starting points; kernels/bench/bench_moe.py times them.)"""
    if interpreting():  # each program costs Python time per op: few, large programs
        return MoeGemmConfig(16, 128, 128, 4, 1)
    rows_per_expert = num_assignments / max(1, num_local)
    if rows_per_expert <= 16:
        return MoeGemmConfig(16, 64, 128, 4, 3)
    if rows_per_expert <= 64:
        return MoeGemmConfig(32, 64, 64, 4, 3)
    return MoeGemmConfig(64, 128, 64, 8, 3)


@dataclass(frozen=True)
class BlockScales:
    """FP8 block scales of one grouped GEMM: the activations' [rows, K / bk] and the experts'
    [E, N / bn, K / bk] (bn, bk = block)."""

    a: torch.Tensor
    w: torch.Tensor
    block: tuple[int, int]


def _gemm(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, align: MoeAlignment, a_row_div: int,
          gated: bool, cfg: MoeGemmConfig, scales: BlockScales | None = None,
          bias: torch.Tensor | None = None, act: tuple[str, float, float] = ("silu", 0.0, 0.0)) -> None:
    """One grouped GEMM; act: (kind, alpha, limit) of the gated activation (`gated_act`)."""
    n_out = w.shape[1] // 2 if gated else w.shape[1]
    k_in = w.shape[2]
    assert a.stride(1) == 1 and w.stride(2) == 1 and out.stride(1) == 1 and a.shape[1] == k_in
    block_k, scale_n, a_s, w_s = cfg.block_k, 1, w, w  # (the scale pointers are unused without)
    if scales is not None:
        (scale_n, block_k), a_s, w_s = scales.block, scales.a, scales.w
        assert a_s.stride(1) == 1 and w_s.stride(2) == 1 and not (gated and n_out % scale_n)
    assert bias is None or (bias.shape == w.shape[:2] and bias.stride(1) == 1), "bias: [E, N]"
    blocks = align.sorted_ids.numel() // cfg.block_m
    grid = (blocks * triton.cdiv(n_out, cfg.block_n),)
    _moe_gemm_kernel[grid](
        a, w, out, align.sorted_ids, align.block_expert, align.num_padded, a_s, w_s,
        w if bias is None else bias,  # (unread without HAS_BIAS)
        align.num_assignments, n_out, k_in, a_row_div, a.stride(0), w.stride(0), w.stride(1),
        out.stride(0), a_s.stride(0), w_s.stride(0), w_s.stride(1) if w_s.dim() > 1 else 0,
        0 if bias is None else bias.stride(0), act[1], act[2],
        GATED=gated, HAS_BIAS=bias is not None, ACT=ACTIVATIONS.index(act[0]),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=block_k,
        DOT_PREC=dot_precision(a.dtype), SCALED=scales is not None, SCALE_N=scale_n,
        UPCAST=upcast_dot(a.dtype) or (scales is not None and interpreting()),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, expert_start: int = 0,
              config: MoeGemmConfig | None = None, w13_scale: torch.Tensor | None = None,
              w2_scale: torch.Tensor | None = None, block: tuple[int, int] = (128, 128),
              w13_bias: torch.Tensor | None = None, w2_bias: torch.Tensor | None = None,
              activation: str = "silu", alpha: float = 1.702, limit: float = 7.0) -> torch.Tensor:
    """Experts' weighted output for every token.

    x [T, H]; w13 [E_local, 2 * I, H] (gate rows then up rows, as HF's fused gate_up_proj);
    w2 [E_local, H, I]; topk_weights [T, k] (float32), topk_ids [T, k] global expert ids.
    Experts outside [expert_start, expert_start + E_local) contribute nothing. Returns [T, H]
    in x.dtype; intermediates are x.dtype, accumulation fp32. w13_scale [E, 2I / bn, H / bk] and
    w2_scale [E, H / bn, I / bk]: fp8 w13 / w2 with `block` scales (W8A8, see the docstring).
    w13_bias [E_local, 2 * I] / w2_bias [E_local, H]: per-expert biases (GPT-OSS; not with fp8),
    added in fp32 before the activation / to each expert's output before its routing weight;
    activation: the gate's, one of ACTIVATIONS: "silu", or "swiglu_oai" (GPT-OSS's clamped
    SwiGLU with `alpha` and `limit`, see activation.gated_act)."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"fused_moe: activation {activation!r} is not one of {ACTIVATIONS}")
    tokens, hidden = x.shape
    num_local, two_inter, _ = w13.shape
    top_k = topk_ids.shape[1]
    out = torch.empty_like(x)
    if tokens == 0:
        return out
    n = tokens * top_k
    cfg = config or pick_config(n, num_local)
    align = moe_align(topk_ids, num_local, expert_start, cfg.block_m)
    inter = torch.empty((n, two_inter // 2), dtype=x.dtype, device=x.device)
    down = torch.empty((n, hidden), dtype=x.dtype, device=x.device)
    if w13_scale is None or w2_scale is None:
        _gemm(x, w13, inter, align, top_k, True, cfg, bias=w13_bias, act=(activation, alpha, limit))
        _gemm(inter, w2, down, align, 1, False, cfg, bias=w2_bias)
    else:
        assert w13_bias is None and w2_bias is None and activation == "silu", "fp8 experts: SiLU, no biases"
        from tokenspeed_kernels.fp8_block import per_token_group_quant_fp8

        xq, xs = per_token_group_quant_fp8(x.contiguous(), block[1])
        _gemm(xq, w13, inter, align, top_k, True, cfg, BlockScales(xs, w13_scale, block))
        iq, is_ = per_token_group_quant_fp8(inter, block[1])
        _gemm(iq, w2, down, align, 1, False, cfg, BlockScales(is_, w2_scale, block))
    weights = topk_weights.contiguous().float()
    ids = topk_ids.contiguous().to(torch.int32)
    block_h = min(1024, triton.next_power_of_2(hidden))
    _moe_combine_kernel[(tokens, triton.cdiv(hidden, block_h))](
        down, weights, ids, out, hidden, expert_start, num_local, down.stride(0), out.stride(0),
        TOP_K=top_k, BLOCK_H=block_h, num_warps=4)
    return out
