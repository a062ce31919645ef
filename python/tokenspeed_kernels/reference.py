"""Pure-torch reference implementations (fp32 by default) of every kernel in tokenspeed_kernels."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _gather_kv(
    cache: torch.Tensor, page_table: torch.Tensor, b: int, length: int, dtype: torch.dtype
) -> torch.Tensor:
    """Tokens [0, length) of request b from a paged cache as [length, Hkv, D]."""
    page_size = cache.shape[1]
    n_pages = (length + page_size - 1) // page_size
    pages = page_table[b, :n_pages].long()
    return cache[pages].reshape(-1, cache.shape[2], cache.shape[3])[:length].to(dtype)


def softmax_with_sinks(s: torch.Tensor, sinks: torch.Tensor | None, head_dim: int) -> torch.Tensor:
    """Softmax over the last axis of scores s (fp32); with sinks (one logit per head, axis
    `head_dim` of s), one more score per row that joins the denominator and carries no value."""
    if sinks is None:
        return torch.softmax(s.float(), dim=-1)
    shape = [1] * s.dim()
    shape[head_dim] = -1
    sink = sinks.float().view(shape).expand(*s.shape[:-1], 1)
    return torch.softmax(torch.cat([s.float(), sink], dim=-1), dim=-1)[..., :-1]


def ref_paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    dtype: torch.dtype = torch.float32,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode attention of q [B, Hq, D] over the paged cache (window: its last `window` keys;
    sinks: [Hq] sink logits); returns [B, Hq, D] in `dtype`."""
    batch, hq, _ = q.shape
    group = hq // k_cache.shape[2]
    lens = seq_lens.tolist()
    out = torch.empty(q.shape, dtype=dtype, device=q.device)
    for b in range(batch):
        length = int(lens[b])
        k = _gather_kv(k_cache, page_table, b, length, dtype).repeat_interleave(group, dim=1)
        v = _gather_kv(v_cache, page_table, b, length, dtype).repeat_interleave(group, dim=1)
        s = torch.einsum("hd,thd->ht", q[b].to(dtype), k) * scale
        if window:
            s[:, : max(0, length - window)] = float("-inf")
        p = softmax_with_sinks(s, sinks, 0).to(dtype)
        out[b] = torch.einsum("ht,thd->hd", p, v)
    return out


def ref_paged_decode_attention_batched(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    dtype: torch.dtype = torch.float32,
    chunk: int = 16,
) -> torch.Tensor:
    """Vectorised (gather + masked softmax) version of ref_paged_decode_attention, for big batches."""
    batch, hq, d = q.shape
    _, page_size, hkv, _ = k_cache.shape
    group = hq // hkv
    out = torch.empty(q.shape, dtype=dtype, device=q.device)
    max_len = int(seq_lens.max().item())
    n_pages = (max_len + page_size - 1) // page_size
    for s0 in range(0, batch, chunk):
        s1 = min(batch, s0 + chunk)
        pages = page_table[s0:s1, :n_pages].long()
        k = k_cache[pages].reshape(s1 - s0, -1, hkv, d)[:, :max_len].to(dtype)
        v = v_cache[pages].reshape(s1 - s0, -1, hkv, d)[:, :max_len].to(dtype)
        qg = q[s0:s1].to(dtype).view(s1 - s0, hkv, group, d)
        s = torch.einsum("bhgd,bthd->bhgt", qg, k).float() * scale
        pos = torch.arange(max_len, device=q.device)
        valid = pos[None, :] < seq_lens[s0:s1, None].to(q.device)
        s = s.masked_fill(~valid[:, None, None, :], float("-inf"))
        p = torch.softmax(s, dim=-1).to(dtype)
        out[s0:s1] = torch.einsum("bhgt,bthd->bhgd", p, v).reshape(s1 - s0, hq, d)
    return out


def ref_paged_extend_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    q_start_loc: torch.Tensor,
    prefix_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    dtype: torch.dtype = torch.float32,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Extend attention (causal over new tokens, full over the cached prefix; window: only keys
    within `window` positions of each query; sinks: [Hq] sink logits); returns [T, Hq, D]."""
    hq = q.shape[1]
    group = hq // k_cache.shape[2]
    starts = q_start_loc.tolist()
    prefixes = prefix_lens.tolist()
    lens = seq_lens.tolist()
    out = torch.empty(q.shape, dtype=dtype, device=q.device)
    for b in range(len(lens)):
        s0, s1, prefix, length = int(starts[b]), int(starts[b + 1]), int(prefixes[b]), int(lens[b])
        if s1 == s0:
            continue
        k = _gather_kv(k_cache, page_table, b, length, dtype).repeat_interleave(group, dim=1)
        v = _gather_kv(v_cache, page_table, b, length, dtype).repeat_interleave(group, dim=1)
        s = torch.einsum("qhd,thd->hqt", q[s0:s1].to(dtype), k).float() * scale
        qpos = prefix + torch.arange(s1 - s0, device=q.device)
        kpos = torch.arange(length, device=q.device)
        s = s.masked_fill(kpos[None, None, :] > qpos[None, :, None], float("-inf"))
        if window:
            s = s.masked_fill(kpos[None, None, :] <= qpos[None, :, None] - window, float("-inf"))
        p = softmax_with_sinks(s, sinks, 0).to(dtype)
        out[s0:s1] = torch.einsum("hqt,thd->qhd", p, v)
    return out


def ref_rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in fp32: x * rsqrt(mean(x^2) + eps) * weight."""
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()


def ref_fused_add_rmsnorm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rmsnorm(residual + x) * weight in fp32, residual + x rounded to residual's dtype)."""
    new_residual = (residual.float() + x.float()).to(residual.dtype)
    return ref_rmsnorm(new_residual, weight, eps), new_residual


def ref_silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(x[..., :I]) * x[..., I:] in fp32."""
    half = x.shape[-1] // 2
    xf = x.float()
    return F.silu(xf[..., :half]) * xf[..., half:]


def ref_rotary_embedding(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    head_dim: int,
    is_neox: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Out-of-place rotary of q [T, Hq*head_dim or Hq, head_dim] and k; returns fp32 copies."""
    rot = cos_sin_cache.shape[1]
    cos, sin = cos_sin_cache[positions.long()].float().chunk(2, dim=-1)  # [T, rot/2]
    cos, sin = cos[:, None, :], sin[:, None, :]

    def apply(x: torch.Tensor) -> torch.Tensor:
        xf = x.float().reshape(x.shape[0], -1, head_dim).clone()
        xr = xf[..., :rot]
        if is_neox:
            x1, x2 = xr[..., : rot // 2], xr[..., rot // 2 :]
            xf[..., :rot] = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
        else:
            x1, x2 = xr[..., 0::2], xr[..., 1::2]
            xf[..., :rot] = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)
        return xf.reshape(x.shape)

    return apply(q), apply(k)


def ref_write_kv_to_pages(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter k/v [T, Hkv, D] into the flattened caches at slot_mapping (negative slots skipped)."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    hkv, d = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, hkv, d)[slots] = k[keep].to(k_cache.dtype)
    v_cache.view(-1, hkv, d)[slots] = v[keep].to(v_cache.dtype)


def ref_rotary_embedding_write_kv(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    is_neox: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary then KV write: rotated k (fp32, cast to the cache dtype) and v go into the caches
    (updated in place); returns the fp32 rotated (q, k), shaped like the inputs."""
    head_dim = k_cache.shape[-1]
    ref_q, ref_k = ref_rotary_embedding(positions, q, k, cos_sin_cache, head_dim, is_neox)
    t = k.shape[0]
    ref_write_kv_to_pages(ref_k.reshape(t, -1, head_dim), v.reshape(t, -1, head_dim), k_cache, v_cache,
                          slot_mapping)  # fmt: skip
    return ref_q, ref_k


def ref_moe_route(router_logits: torch.Tensor, top_k: int,
                  renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax (fp32) → top-k → optional renormalisation: (weights [T, k] fp32, ids [T, k] int64)."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def ref_swiglu_oai(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """GPT-OSS's clamped SwiGLU (HF GptOssExperts): gate <= limit, |up| <= limit, then
    (up + 1) * gate * sigmoid(alpha * gate)."""
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * gate * torch.sigmoid(gate * alpha)


def ref_fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, expert_start: int = 0,
                  dtype: torch.dtype = torch.float32, b13: torch.Tensor | None = None,
                  b2: torch.Tensor | None = None,
                  swiglu_oai: tuple[float, float] | None = None) -> torch.Tensor:
    """sum_j w[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t)) over the experts e = ids[t, j] held
    here ([expert_start, expert_start + w13.shape[0])), computed in `dtype`; returns [T, H] in `dtype`.
    b13 [E, 2I] / b2 [E, H]: expert biases; swiglu_oai: (alpha, limit) of GPT-OSS's activation
    in place of SiLU."""
    inter = w13.shape[1] // 2
    out = torch.zeros(x.shape, dtype=dtype, device=x.device)
    for e in range(w13.shape[0]):
        tok, slot = torch.nonzero(topk_ids == e + expert_start, as_tuple=True)
        if tok.numel() == 0:
            continue
        h = x[tok].to(dtype) @ w13[e].to(dtype).T
        if b13 is not None:
            h = h + b13[e].to(dtype)
        if swiglu_oai is None:
            h = F.silu(h[:, :inter]) * h[:, inter:]
        else:
            h = ref_swiglu_oai(h[:, :inter], h[:, inter:], *swiglu_oai)
        d = h @ w2[e].to(dtype).T
        if b2 is not None:
            d = d + b2[e].to(dtype)
        out.index_add_(0, tok, d * topk_weights[tok, slot, None].to(dtype))
    return out


def ref_mla_attention(q: torch.Tensor, kv_cache: torch.Tensor, page_table: torch.Tensor,
                      kv_lens: torch.Tensor, scale: float, latent_dim: int,
                      rows: torch.Tensor | None = None) -> torch.Tensor:
    """Absorbed MLA (mla_decode_attention) in fp32: row t's heads q [T, H, W] over the first
    kv_lens[t] tokens of page-table row rows[t] (default t) of the one-head latent cache,
    V = each token's first latent_dim features; returns [T, H, latent_dim]."""
    out = torch.empty(*q.shape[:2], latent_dim, dtype=torch.float32, device=q.device)
    for t in range(q.shape[0]):
        row = t if rows is None else int(rows[t])
        kv = _gather_kv(kv_cache, page_table, row, int(kv_lens[t]), torch.float32)[:, 0]  # [L, W]
        p = torch.softmax((q[t].float() @ kv.T) * scale, dim=-1)
        out[t] = p @ kv[:, :latent_dim]
    return out
