"""Batch-invariant mode (`--enable-deterministic-inference`): the one switch the layers consult.

A row's result must not depend on what else the step carries. Three ops reduce in an order that
can depend on the batch, and this module gives each an invariant form:

- matmul (linear layers, LM head): BLAS and cuBLAS pick kernels by M (a GEMV for one row, other
  blockings or split-K for more), so the sum over K runs in another order. On the CPU x is cut
  into fixed blocks of `ROW_BLOCK` rows (the last one zero-padded): every GEMM has the same
  shape, so every row reduces K the same way (tests/test_batch_invariant.py checks a row's
  result does not move with its block position or neighbours). On CUDA a Triton matmul with one
  tile config for every M and no split-K (tokenspeed_kernels.batch_invariant).
- attention: keys are reduced in tiles of `KV_TILE` keys aligned at position 0, each tile a
  fixed-shape matmul, the tiles summed one after another; a query row's result then depends on
  its own keys only, not on how its prompt was chunked, how many rows share its block, or whether
  it is a decode or a prefill row (`attend`, the torch_native backend). Extra tiles past a
  row's last key are all masked: they add exact zeros. The triton backend runs the same scheme
  in one kernel for every query row (tokenspeed_kernels.batch_invariant.attention).
- logprobs: a per-row log_softmax (one row per program on CUDA, per-row loops on the CPU)
  instead of a logsumexp whose reduction a small batch may split across threads or blocks.

RMSNorm, RoPE, activations and the sampler's argmax are per-row or elementwise already. Set once
at worker start (`enable`), before the model is built; the layers read `enabled()`.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

ROW_BLOCK = 16  # CPU GEMM rows per call: padding a decode row to 16 costs ~nothing (memory-bound)
KV_TILE = 64  # keys per attention tile, aligned at absolute position 0
Q_BLOCK = {"cpu": 16, "cuda": 64}  # query rows per attention call (the last block zero-padded)

_enabled = False


def enable(on: bool = True) -> None:
    global _enabled
    _enabled = on


def enabled() -> bool:
    return _enabled


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x W^T (+ b), each row computed the same way whatever the number of rows."""
    if x.is_cuda:
        from tokenspeed_kernels.batch_invariant import matmul

        flat = x.reshape(-1, x.shape[-1])
        out = matmul(flat, weight.t())
        if bias is not None:
            out = out + bias
        return out.view(*x.shape[:-1], weight.shape[0])
    flat = x.reshape(-1, x.shape[-1])
    m = flat.shape[0]
    out = flat.new_empty(m, weight.shape[0])
    block = flat.new_zeros(ROW_BLOCK, flat.shape[1])
    for start in range(0, m, ROW_BLOCK):
        n = min(ROW_BLOCK, m - start)
        block[:n] = flat[start:start + n]
        if n < ROW_BLOCK:
            block[n:] = 0
        out[start:start + n] = F.linear(block, weight)[:n]
    if bias is not None:
        out = out + bias
    return out.view(*x.shape[:-1], weight.shape[0])


def chosen_logprobs(raw: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(log_softmax(raw) at `tokens`, the whole log_softmax), row by row."""
    logp = torch.log_softmax(raw.float(), dim=-1)
    return logp.gather(1, tokens[:, None]).squeeze(1), logp


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
           window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of one request's n newest tokens over its keys, batch-invariant.

    q [n, Hk, G, D]: the queries of positions L - n .. L - 1; k, v [L, Hk, D]: keys 0..L-1 of the
    request; sinks [Hk, G] or None. Returns [n, Hk, G, D]. Query rows go in blocks of `Q_BLOCK`
    (per device type), keys in tiles of `KV_TILE` from position 0; a row's max is exact whatever
    the tiling, and its exp-sums and value sums are added tile after tile in position order."""
    n, hk, g, d = q.shape
    out = torch.empty_like(q)
    length = k.shape[0]
    first = length - n
    tiles = -(-length // KV_TILE)
    pad = tiles * KV_TILE - length
    # [Hk, tiles, T, D], padded keys/values zero (the cache may hold anything there).
    kt = F.pad(k.float(), (0, 0, 0, 0, 0, pad)).view(tiles, KV_TILE, hk, d).permute(2, 0, 1, 3)
    vt = F.pad(v.float(), (0, 0, 0, 0, 0, pad)).view(tiles, KV_TILE, hk, d).permute(2, 0, 1, 3)
    k_pos = torch.arange(tiles * KV_TILE, device=q.device).view(tiles, 1, KV_TILE)
    block = Q_BLOCK.get(q.device.type, 16)
    for start in range(0, n, block):
        rows = min(block, n - start)
        qb = q.new_zeros(block, hk, g, d, dtype=torch.float32)
        qb[:rows] = q[start:start + rows]
        pos = torch.full((block,), -1, dtype=torch.long, device=q.device)
        pos[:rows] = torch.arange(first + start, first + start + rows, device=q.device)
        # Tiles this block needs: up to its last row's position (the rest are masked anyway).
        need = (first + start + rows - 1) // KV_TILE + 1
        out[start:start + rows] = _attend_block(
            qb, kt[:, :need], vt[:, :need], pos, k_pos[:need], scale, window, sinks)[:rows]
    return out


def _attend_block(qb: torch.Tensor, kt: torch.Tensor, vt: torch.Tensor, pos: torch.Tensor,
                  k_pos: torch.Tensor, scale: float, window: int | None,
                  sinks: torch.Tensor | None) -> torch.Tensor:
    """One block of Q_BLOCK rows [B, Hk, G, D] (pos -1: padding) over tiles [Hk, t, T, D]."""
    b, hk, g, d = qb.shape
    qh = (qb * scale).permute(1, 2, 0, 3).reshape(hk, 1, g * b, d)  # rows: (head in group, row)
    scores = qh @ kt.transpose(-1, -2)  # [Hk, t, G*B, T], one fixed-shape GEMM per tile
    row_pos = pos.repeat(g)[None, :, None]  # [1, G*B, 1]
    mask = k_pos <= row_pos  # [t, G*B, T]
    if window is not None:
        mask = mask & (k_pos > row_pos - window)
    scores = scores.masked_fill(~mask, float("-inf"))
    m = scores.amax(dim=(1, 3))  # [Hk, G*B]: exact, whatever the tiling
    sink = None
    if sinks is not None:
        sink = sinks.float().repeat_interleave(b, dim=1)  # [Hk, G*B]
        m = torch.maximum(m, sink)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)  # padding rows: no keys
    p = torch.exp(scores - m[:, None, :, None])
    sums = p.sum(dim=-1)  # [Hk, t, G*B]
    parts = p @ vt  # [Hk, t, G*B, D]
    acc, total = parts[:, 0], sums[:, 0]
    for t in range(1, parts.shape[1]):  # in position order, one tile at a time
        acc = acc + parts[:, t]
        total = total + sums[:, t]
    if sink is not None:
        total = total + torch.exp(sink - m)
    o = acc / total.clamp_min(torch.finfo(torch.float32).tiny)[..., None]
    return o.view(hk, g, b, d).permute(2, 0, 1, 3).to(qb.dtype)
