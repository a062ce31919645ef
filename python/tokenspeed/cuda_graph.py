"""CUDA graphs for pure-decode steps: one graph per captured batch size over static buffers.

A decode batch of B requests is padded to the smallest captured size >= B: padding rows read
token 0 at position 0 with a one-token context, and write no K/V (out_cache_loc -1, which
write_kv_to_pages skips). The graph runs the whole model plus the LM head; the logits land in a
static buffer and sampling runs outside the graph.
"""

from __future__ import annotations

import bisect
import logging
import time
from typing import Any

import numpy as np
import torch

from tokenspeed.kv_cache import PagedKVCache
from tokenspeed.layers.attention import ForwardBatch
from tokenspeed.layers.triton_attention import TritonBackend, TritonMetadata

logger = logging.getLogger(__name__)

DEFAULT_CUDA_GRAPH_MAX_BS = 256


def capture_sizes(max_bs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 from 16, up to and including max_bs."""
    sizes = [s for s in (1, 2, 4, 8) if s <= max_bs] + list(range(16, max_bs + 1, 8))
    if sizes[-1] != max_bs:
        sizes.append(max_bs)
    return sizes


def graph_memory_estimate(max_bs: int, vocab_size: int) -> int:
    """Bytes the graphs need beyond the model: the static logits buffer, the graph pool's
    intermediates (led by a float32 and a bf16 copy of the logits) and some slack."""
    return 3 * max_bs * vocab_size * 4 + (256 << 20)


class DecodeGraphRunner:
    def __init__(self, model: torch.nn.Module, kv_cache: PagedKVCache, backend: TritonBackend,
                 max_bs: int, vocab_size: int, device: torch.device) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.backend = backend
        self.device = device
        self.sizes = capture_sizes(max_bs)
        self.max_bs = self.sizes[-1]
        n, width = self.max_bs, kv_cache.max_pages_per_slot
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.out_cache_loc = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.page_table = torch.zeros((n, width), dtype=torch.int32, device=device)
        self.logits = torch.zeros((n, vocab_size), dtype=torch.float32, device=device)
        # Pinned staging for the per-step int64 inputs: ids, positions, cache locations.
        self._staging = torch.zeros(3 * n, dtype=torch.int64, pin_memory=True)
        self._staging_np = self._staging.numpy()
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.replays = 0

    def _batch(self, bs: int) -> ForwardBatch:
        empty = np.zeros(0, dtype=np.int64)
        meta = TritonMetadata(page_table=self.page_table[:bs], seq_lens=self.seq_lens[:bs],
                              decode=True, num_splits=self.backend.decode_num_splits(bs))
        return ForwardBatch(input_ids=self.input_ids[:bs], positions=self.positions[:bs],
                            out_cache_loc=self.out_cache_loc[:bs], slots=empty, num_tokens=empty,
                            start_pos=empty, query_start=empty, kv_cache=self.kv_cache,
                            backend=self.backend, metadata=meta)

    def _run(self, bs: int, batch: ForwardBatch) -> None:
        hidden = self.model(batch.input_ids, batch.positions, batch)
        self.logits[:bs].copy_(self.model.compute_logits(hidden))  # type: ignore[operator]

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, largest first, all sharing one memory pool."""
        t0 = time.perf_counter()
        pool: Any = None
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        for bs in reversed(self.sizes):
            batch = self._batch(bs)
            with torch.cuda.stream(stream):
                for _ in range(2):  # compile and autotune outside the capture
                    self._run(bs, batch)
            stream.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                self._run(bs, batch)
            if pool is None:
                pool = graph.pool()
            self.graphs[bs] = graph
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        logger.info("captured %d decode CUDA graphs (batch sizes %d..%d) in %.1f s",
                    len(self.sizes), self.sizes[0], self.max_bs, time.perf_counter() - t0)

    def can_run(self, batch_size: int) -> bool:
        return 0 < batch_size <= self.max_bs

    def run(self, input_ids: np.ndarray, positions: np.ndarray, out_cache_loc: np.ndarray,
            slots: np.ndarray) -> torch.Tensor:
        """Replay for one decode token per request; returns float32 logits [B, vocab] (a view of
        the static buffer, valid until the next replay)."""
        b = len(input_ids)
        bs = self.sizes[bisect.bisect_left(self.sizes, b)]
        st = self._staging_np
        st[:3 * bs] = 0
        st[:b], st[bs:bs + b], st[2 * bs:2 * bs + b] = input_ids, positions, out_cache_loc
        st[2 * bs + b:3 * bs] = -1
        dev = self._staging[:3 * bs].to(self.device, non_blocking=True).view(3, bs)
        self.input_ids[:bs].copy_(dev[0])
        self.positions[:bs].copy_(dev[1])
        self.out_cache_loc[:bs].copy_(dev[2])
        self.seq_lens[:bs].copy_(dev[1].add(1))
        page_size = self.kv_cache.page_size
        cols = max(1, -(-(int(positions.max()) + 1) // page_size))
        rows = self.kv_cache.page_table_host[slots.astype(np.int64), :cols]
        self.page_table[:b, :cols].copy_(torch.from_numpy(np.ascontiguousarray(rows)))
        self.graphs[bs].replay()
        self.replays += 1
        return self.logits[:b]
