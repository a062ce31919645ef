"""torch_native attention backend: gather K/V through the page table, then SDPA. CPU and reference."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch.nn import functional as F

from tokenspeed.layers import batch_invariant
from tokenspeed.layers.attention import Attention, AttentionBackend, ForwardBatch
from tokenspeed.layers.kv_cache import PagedKVCache
from tokenspeed.layers.quantization.kv_cache import is_fp8, quantize_fp8


@dataclass
class _Decode:
    """All single-token requests, padded to the longest context and attended in one call."""

    q_rows: torch.Tensor  # [B] token index of each request's query
    kv_locs: torch.Tensor  # [B, L] flat cache indices, padding points at index 0
    q_pos: torch.Tensor  # [B, 1] position of each query
    valid: torch.Tensor  # [B, L] key index < seq_len


@dataclass
class _Extend:
    """One multi-token request (prefill chunk), attended on its own."""

    q_start: int
    q_end: int
    kv_locs: torch.Tensor  # [L]
    q_pos: torch.Tensor  # [n, 1]


@dataclass
class _Metadata:
    decode: _Decode | None
    extends: list[_Extend]


class TorchNativeBackend(AttentionBackend):
    """Exact rather than fast: the reference the Triton/FlashInfer backends are tested against.

    GQA without copying K/V: the `group` query heads sharing a KV head are folded into the query
    length, so SDPA sees [Hk, group * n, D] queries against [Hk, L, D] keys.
    """

    name = "torch_native"
    supports_sinks = True
    supports_mla = True  # V = the first v_head_dim features of the one latent K head

    def __init__(self, kv_cache: PagedKVCache) -> None:
        self.kv_cache = kv_cache

    def prepare(self, batch: ForwardBatch) -> None:
        device = batch.input_ids.device
        # Batch-invariant mode: decode rows go through the same per-request path as prompts.
        is_decode = (batch.num_tokens == 1) & (not batch_invariant.enabled())
        decode = None
        if is_decode.any():
            idx = np.flatnonzero(is_decode)
            seq_lens = batch.seq_lens[idx]
            width = int(seq_lens.max())
            locs = np.zeros((len(idx), width), dtype=np.int64)
            for row, i in enumerate(idx.tolist()):
                locs[row, :seq_lens[row]] = self.kv_cache.cache_locs(int(batch.slots[i]), 0,
                                                                     int(seq_lens[row]))
            decode = _Decode(
                q_rows=torch.from_numpy(batch.query_start[idx]).to(device),
                kv_locs=torch.from_numpy(locs).to(device),
                q_pos=torch.from_numpy(seq_lens - 1).to(device)[:, None],
                valid=torch.from_numpy(np.arange(width)[None, :] < seq_lens[:, None]).to(device))
        extends = []
        for i in np.flatnonzero(~is_decode).tolist():
            start, n = int(batch.start_pos[i]), int(batch.num_tokens[i])
            locs = self.kv_cache.cache_locs(int(batch.slots[i]), 0, start + n)
            extends.append(_Extend(
                q_start=int(batch.query_start[i]), q_end=int(batch.query_start[i + 1]),
                kv_locs=torch.from_numpy(locs).to(device),
                q_pos=torch.arange(start, start + n, device=device)[:, None]))
        batch.metadata = _Metadata(decode, extends)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: Attention,
                batch: ForwardBatch, sinks: torch.Tensor | None = None) -> torch.Tensor:
        k_cache, v_cache = self.kv_cache.flat(layer.layer_id)
        ks, vs = self.kv_cache.k_scale[layer.layer_id], self.kv_cache.v_scale[layer.layer_id]
        fp8 = is_fp8(k_cache.dtype)
        loc = batch.out_cache_loc
        if bool((loc < 0).any()):  # padding rows (a padded decode batch): no K/V, as in triton
            keep = loc >= 0
            loc, k, v = loc[keep], k[keep], v[keep]
        if fp8:  # quantise on the way in; torch has no fp8 index_copy_ on the CPU: copy bytes
            k_cache.view(torch.uint8).index_copy_(
                0, loc, quantize_fp8(k, ks, k_cache.dtype).view(torch.uint8))
            v_cache.view(torch.uint8).index_copy_(
                0, loc, quantize_fp8(v, vs, v_cache.dtype).view(torch.uint8))
        else:
            k_cache.index_copy_(0, loc, k.to(k_cache.dtype))
            if not self.kv_cache.v_from_k:  # else V is K's first features: written with it
                v_cache.index_copy_(0, loc, v.to(v_cache.dtype))

        def gather(cache: torch.Tensor, locs: torch.Tensor, scale: float) -> torch.Tensor:
            """Cached rows in q's dtype (fp8: dequantised, stored * scale, in fp32 first)."""
            if not fp8:
                return cache[locs].to(q.dtype)
            return (cache.view(torch.uint8)[locs].view(cache.dtype).float() * scale).to(q.dtype)

        hk, group, d = layer.num_kv_heads, layer.num_heads // layer.num_kv_heads, layer.head_dim
        dv = layer.v_head_dim
        window = layer.sliding_window
        meta: _Metadata = batch.metadata
        out = q.new_empty(*q.shape[:2], dv)

        if meta.decode is not None:
            m = meta.decode
            qd = q[m.q_rows].view(-1, hk, group, d)  # [B, Hk, group, D]
            kd = gather(k_cache, m.kv_locs, ks).transpose(1, 2)  # [B, Hk, L, D]
            vd = gather(v_cache, m.kv_locs, vs).transpose(1, 2)
            mask = m.valid
            if window is not None:
                mask = mask & (torch.arange(mask.shape[1], device=q.device) > m.q_pos - window)
            o = _attend(qd, kd, vd, mask[:, None, None, :], layer.scaling,
                        None if sinks is None else sinks.view(hk, group))
            out[m.q_rows] = o.reshape(-1, hk * group, dv)

        for r in meta.extends:
            n = r.q_end - r.q_start
            if batch_invariant.enabled():
                ke, ve = gather(k_cache, r.kv_locs, ks), gather(v_cache, r.kv_locs, vs)
                out[r.q_start:r.q_end] = batch_invariant.attend(
                    q[r.q_start:r.q_end].view(n, hk, group, d), ke, ve, layer.scaling, window,
                    None if sinks is None else sinks.view(hk, group)).reshape(n, -1, dv)
                continue
            # [n, Hk * group, D] → [Hk, group * n, D]: query heads of one KV head side by side.
            qe = q[r.q_start:r.q_end].view(n, hk, group, d).permute(1, 2, 0, 3).reshape(hk, -1, d)
            ke = gather(k_cache, r.kv_locs, ks).transpose(0, 1)  # [Hk, L, D]
            ve = gather(v_cache, r.kv_locs, vs).transpose(0, 1)
            k_pos = torch.arange(ke.shape[1], device=q.device)[None, :]
            mask = k_pos <= r.q_pos
            if window is not None:
                mask = mask & (k_pos > r.q_pos - window)
            o = _attend(qe, ke, ve, mask.repeat(group, 1), layer.scaling,
                        None if sinks is None else sinks.view(hk, group).repeat_interleave(n, 1))
            out[r.q_start:r.q_end] = o.view(hk, group, n, dv).permute(2, 0, 1, 3).reshape(n, -1, dv)
        return out.flatten(1)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
            sinks: torch.Tensor | None) -> torch.Tensor:
    """SDPA; with sinks (logits broadcastable to the scores without their key axis), the
    softmax also counts one sink score per query, which carries no value (HF GPT-OSS)."""
    if sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    scores = (q.float() @ k.float().transpose(-1, -2)) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    both = torch.cat([scores, sinks.float().unsqueeze(-1).expand(*scores.shape[:-1], 1)], dim=-1)
    probs = torch.softmax(both - both.amax(-1, keepdim=True), dim=-1)[..., :-1]
    return (probs @ v.float()).to(q.dtype)
