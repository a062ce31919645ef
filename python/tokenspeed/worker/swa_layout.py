"""The hybrid KV layout (`--swa-full-tokens-ratio`; docs/models.md, "Sliding-window KV pool"):
the sliding-window layers' K/V live in a pool of their own, with their own page table, which
the scheduler fills with `PageTableUpdate.pool == 1` rows and empties as requests move past
their window. The full layers keep the runner's `kv_cache` (sliding layers get no pages there).
A step's batch gets a view for the sliding layers (`ForwardBatch.swa`): their write locations
and their backend's metadata; `Attention` picks it for layers with a window."""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any

import numpy as np

from tokenspeed.layers.attention import ForwardBatch
from tokenspeed.layers.kv_cache import PagedKVCache
from tokenspeed.worker.plan import StepPlan

logger = logging.getLogger(__name__)

SWA_POOL = 1  # PageTableUpdate.pool of the sliding-window layers' table (rust: scheduler/swa.rs)


def sliding_layers(runner: Any, ratio: float | None, disabled: bool) -> list[int]:
    """The layers that get the sliding pool: every layer with a window when the model mixes
    them with full layers and the user asked for the hybrid layout; else none (one pool)."""
    windows = runner.config.sliding_windows
    swa = [i for i, w in enumerate(windows) if w is not None]
    if ratio is None or disabled or not swa or len(swa) == len(windows):
        if ratio is not None and not disabled:
            logger.info("--swa-full-tokens-ratio: the model has no mix of sliding-window and "
                        "full layers; one KV pool for every layer")
        return []
    if runner.device.type == "cuda" and runner.cuda_graph_max_bs:
        raise ValueError("--swa-full-tokens-ratio (hybrid sliding-window KV pool) does not run "
                         "under CUDA graphs yet: add --disable-cuda-graph")
    if runner.drafter is not None:
        raise ValueError("--swa-full-tokens-ratio does not support speculative decoding yet")
    return swa


def split_pages(runner: Any, ratio: float | None, profiled: bool) -> None:
    """Sets `runner.num_pages` (full layers) and `runner.num_swa_pages` (0: single layout).
    `profiled` on a GPU: `num_pages` is what fits with every layer's pages in one pool; the
    same bytes then hold F full-layer pages and ratio * F sliding ones. Otherwise
    (`--max-total-tokens`, CPU) `num_pages` stays the full pool and the sliding one is ratio
    times it."""
    runner.num_swa_pages = 0
    if not runner.swa_layers or ratio is None:
        return
    layers, num_swa = runner.config.num_hidden_layers, len(runner.swa_layers)
    if profiled and runner.device.type == "cuda":
        runner.num_pages = int(runner.num_pages * layers / (layers - num_swa + ratio * num_swa))
    runner.num_swa_pages = max(1, math.ceil(runner.num_pages * ratio))


def full_layers(runner: Any) -> set[int] | None:
    """The layers of the runner's main pool: all (None) but the sliding ones when hybrid."""
    if not runner.swa_layers:
        return None
    return set(range(runner.config.num_hidden_layers)) - set(runner.swa_layers)


class SwaLayout:
    """The sliding layers' cache, its backend, and the per-step view."""

    @classmethod
    def build(cls, runner: Any) -> SwaLayout | None:
        return cls(runner, runner.swa_layers, runner.num_swa_pages) if runner.swa_layers else None

    def __init__(self, runner: Any, layers: list[int], num_pages: int) -> None:
        c = runner.config
        self.layers = layers
        self.window = max(c.sliding_windows[i] for i in layers)
        self.kv_cache = PagedKVCache(
            num_layers=c.num_hidden_layers, num_pages=num_pages, page_size=runner.page_size,
            num_kv_heads=runner.num_kv_heads, head_dim=c.head_dim, dtype=runner.kv_dtype,
            device=runner.device, max_slots=runner.max_slots,
            max_context_len=runner.max_context_len, k_scale=runner.kv_scales[0],
            v_scale=runner.kv_scales[1], layers=set(layers))
        self.backend = runner._make_backend(self.kv_cache)
        logger.info("hybrid KV layout: %d full-layer pages, %d sliding-window pages (layers %s, "
                    "window %d) of %d tokens; prefix caching off (docs/models.md)",
                    runner.num_pages, num_pages, layers, self.window, runner.page_size)

    def view(self, batch: ForwardBatch, positions: np.ndarray) -> ForwardBatch:
        """The batch as the sliding layers see it: their write locations and metadata."""
        pages = self.kv_cache.page_table_host[np.repeat(batch.slots, batch.num_tokens),
                                              positions // self.kv_cache.page_size]
        loc = pages.astype(np.int64) * self.kv_cache.page_size + positions % self.kv_cache.page_size
        view = dataclasses.replace(batch, out_cache_loc=_like(batch.out_cache_loc, loc),
                                   kv_cache=self.kv_cache, backend=self.backend, metadata=None)
        self.backend.prepare(view)
        return view


def _like(t: Any, values: np.ndarray) -> Any:
    import torch

    return torch.from_numpy(values).to(t.device)


def apply_page_tables(runner: Any, plan: StepPlan) -> None:
    """The plan's page-table rows, each into the table its `pool` names."""
    swa = getattr(runner, "swa", None)
    if swa is None:  # single layout: every row is the one table's (same path as before)
        runner.kv_cache.update_page_table(plan.pt_slot, plan.pt_first, plan.pt_pages_len,
                                          plan.pt_pages)
        return
    ends = np.cumsum(plan.pt_pages_len.astype(np.int64))
    runs = np.split(plan.pt_pages, ends[:-1]) if len(ends) else []
    for cache, pick in ((runner.kv_cache, plan.pt_pool != SWA_POOL),
                        (swa.kv_cache, plan.pt_pool == SWA_POOL)):
        rows = np.flatnonzero(pick)
        pages = np.concatenate([runs[i] for i in rows]) if len(rows) else plan.pt_pages[:0]
        cache.update_page_table(plan.pt_slot[rows], plan.pt_first[rows],
                                plan.pt_pages_len[rows], pages)
