"""Paged KV cache: per-layer K and V page pools plus the per-slot page table."""

from __future__ import annotations

import numpy as np
import torch

from tokenspeed.layers.host_copy import to_device_int64


class PagedKVCache:
    """K/V of layer l live in `k[l]`, `v[l]`: [num_pages, page_size, num_kv_heads, head_dim].

    Page p holds positions [j * page_size, (j + 1) * page_size) of any slot whose page-table row
    has p at index j; pages may be shared by several slots (radix prefix cache). The page table is
    kept twice: on the host (numpy, to build per-step metadata without a device sync) and on the
    device (for kernels that walk it themselves).

    An fp8 cache (float8_e4m3fn / float8_e5m2) stores K / k_scale[l] and V / v_scale[l] of layer l
    (layers/quantization/kv_cache.py says where the scales come from); other dtypes store K and V
    as they are and keep the scales at 1.0.

    `v_from_k` (multi-head latent attention, DeepSeek): the cache holds K only, one "head" per
    token of [normed latent (kv_lora_rank) | roped shared key part], and V of each layer is a
    view of K's first `v_from_k` features (the latent), so a token costs one vector per layer
    instead of per-head K and V.
    """

    def __init__(self, *, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str, max_slots: int,
                 max_context_len: int, k_scale: list[float] | None = None,
                 v_scale: list[float] | None = None, v_from_k: int | None = None,
                 layers: set[int] | None = None) -> None:
        """layers: the layers whose K/V this pool holds (None: all); the others get empty
        tensors (the hybrid layout's two pools, worker/swa_layout.py)."""
        self.dtype = dtype
        self.v_from_k = v_from_k
        self.k_scale = list(k_scale) if k_scale is not None else [1.0] * num_layers
        self.v_scale = list(v_scale) if v_scale is not None else [1.0] * num_layers
        if len(self.k_scale) != num_layers or len(self.v_scale) != num_layers:
            raise ValueError(f"need {num_layers} K and V scales, got {len(self.k_scale)} and "
                             f"{len(self.v_scale)}")
        if dtype not in (torch.float8_e4m3fn, torch.float8_e5m2) and any(
                s != 1.0 for s in self.k_scale + self.v_scale):
            raise ValueError(f"KV cache scales other than 1.0 need an fp8 cache, not {dtype}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.max_slots = max_slots
        self.max_pages_per_slot = -(-max_context_len // page_size)
        shapes = [(num_pages if layers is None or i in layers else 0, page_size, num_kv_heads,
                   head_dim) for i in range(num_layers)]
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for shape in shapes]
        self.v = [k[..., :v_from_k] for k in self.k] if v_from_k else \
            [torch.zeros(shape, dtype=dtype, device=device) for shape in shapes]
        self.page_table_host = np.zeros((max_slots, self.max_pages_per_slot), dtype=np.int32)
        # Caches of other layers over the same page ids (a draft head's, worker/draft_chain.py):
        # a page copy copies their pages too.
        self.companions: list[PagedKVCache] = []
        self.page_table = torch.zeros((max_slots, self.max_pages_per_slot), dtype=torch.int32,
                                      device=device)

    @staticmethod
    def bytes_per_page(*, num_layers: int, page_size: int, num_kv_heads: int, head_dim: int,
                       dtype: torch.dtype, v_from_k: bool = False) -> int:
        """v_from_k: V is a view of K (MLA's latent cache), one vector per token and layer."""
        elem = torch.empty(0, dtype=dtype).element_size()
        return (1 if v_from_k else 2) * num_layers * page_size * num_kv_heads * head_dim * elem

    def flat(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of a layer viewed as [num_pages * page_size, num_kv_heads, head_dim] (V of a
        `v_from_k` cache: its first v_from_k features, a strided view of K)."""
        k, v = self.k[layer], self.v[layer]
        return k.view(-1, *k.shape[2:]), v.flatten(0, 1)

    def copy_pages(self, src: np.ndarray, dst: np.ndarray) -> None:
        """KV page `dst[i]` of every layer = page `src[i]` (the plan's copy section), queued on
        the stream before the step's forward."""
        if len(src) != len(dst):
            raise ValueError(f"page copies: {len(src)} sources, {len(dst)} destinations")
        ids = np.concatenate([src, dst]).astype(np.int64)
        if len(ids) and (int(ids.max()) >= self.num_pages or int(ids.min()) < 0):
            raise ValueError(f"page copy: page id out of range (num_pages={self.num_pages})")
        # Through pinned memory: a pageable copy would wait for the step in flight.
        s, d = to_device_int64([src, dst], self.k[0].device)
        for k, v in zip(self.k, self.v):
            k[d] = k[s]
            if not self.v_from_k:  # else V is part of K, copied with it
                v[d] = v[s]
        for companion in self.companions:
            companion.copy_pages(src, dst)

    def update_page_table(self, slots: np.ndarray, first: np.ndarray, count: np.ndarray,
                          pages: np.ndarray) -> None:
        """Row `slots[i]` entries [first[i], first[i] + count[i]) = the next count[i] of `pages`
        (entries written twice keep the later one). Validated before anything is written."""
        if len(slots) == 0:
            return
        slots, first, count = (np.asarray(a, dtype=np.int64) for a in (slots, first, count))
        if len(pages) and int(pages.max()) >= self.num_pages:
            raise ValueError(f"page id {int(pages.max())} out of range (num_pages={self.num_pages})")
        if (bad := np.flatnonzero(slots >= self.max_slots)).size:
            raise ValueError(f"slot {slots[bad[0]]} out of range (max_slots={self.max_slots})")
        if (bad := np.flatnonzero(first + count > self.max_pages_per_slot)).size:
            i = bad[0]
            raise ValueError(f"slot {slots[i]}: page-table entries [{first[i]}, {first[i] + count[i]}) "
                             f"exceed max_context_len ({self.max_pages_per_slot} pages)")
        if int(count.sum()) != len(pages):
            raise ValueError(f"page-table update: counts sum to {int(count.sum())}, got {len(pages)} pages")
        # Flat index of every entry: its slot's row, its run's first column + its place in the run.
        run_start = np.cumsum(count) - count
        flat = (np.repeat(slots * self.max_pages_per_slot + first - run_start, count)
                + np.arange(len(pages), dtype=np.int64))
        values = np.asarray(pages, dtype=np.int64)
        if len(np.unique(slots)) < len(slots):  # a slot listed twice: keep each entry's last write
            _, last = np.unique(flat[::-1], return_index=True)
            keep = len(flat) - 1 - last
            flat, values = flat[keep], values[keep]
        self.page_table_host.reshape(-1)[flat] = values
        # The device copy gets the same entries through one non-blocking transfer (the GPU may
        # still be running the previous step, which reads the old entries of other slots).
        flat_d, values_d = to_device_int64([flat, values], self.page_table.device)
        self.page_table.view(-1)[flat_d] = values_d.to(torch.int32)

    def cache_locs(self, slot: int, start: int, end: int) -> np.ndarray:
        """Flat cache indices (page * page_size + offset) of positions [start, end) of a slot."""
        pos = np.arange(start, end, dtype=np.int64)
        pages = self.page_table_host[slot, pos // self.page_size].astype(np.int64)
        return pages * self.page_size + pos % self.page_size
