"""CUDA graphs for pure-decode steps: one graph per captured batch size over static buffers.

A decode batch of B requests is padded to the smallest captured size >= B: padding rows read
token 0 at position 0 with a one-token context of slot 0's pages, and write no K/V
(out_cache_loc -1, which write_kv_to_pages skips). Inside the graph, input ids equal to
LAST_SAMPLED become the slot's last sampled token (one-step-ahead scheduling) and the context
lengths derive from the positions; the graph runs the whole model plus the LM head, the logits
land in a static buffer and sampling runs outside the graph. The attention backend owns the
metadata the graph reads (triton: gathered page-table rows; flashinfer: a planned wrapper per
size) and refreshes it before each replay. Nothing in `run` waits for the GPU.
"""

from __future__ import annotations

import bisect
import logging
import time
from typing import Any

import numpy as np
import torch

from tokenspeed.host_copy import to_device_int64
from tokenspeed.kv_cache import PagedKVCache
from tokenspeed.layers.attention import AttentionBackend, ForwardBatch
from tokenspeed.plan import LAST_SAMPLED

logger = logging.getLogger(__name__)

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
    def __init__(self, model: torch.nn.Module, kv_cache: PagedKVCache, backend: AttentionBackend,
                 max_bs: int, vocab_size: int, device: torch.device,
                 last_tokens: torch.Tensor) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.backend = backend
        self.device = device
        self.last_tokens = last_tokens  # [max_slots] int64: each slot's last sampled token
        self.sizes = capture_sizes(max_bs)
        self.max_bs = self.sizes[-1]
        n = self.max_bs
        # Rows: input ids, positions, cache locations, slots; one copy fills all four.
        self.inputs = torch.zeros((4, n), dtype=torch.int64, device=device)
        self.inputs[2].fill_(-1)
        backend.init_graphs(self.sizes)
        self.logits = torch.zeros((n, vocab_size), dtype=torch.float32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.replays = 0

    def _run(self, bs: int) -> None:
        ids, positions, out_loc, slots = self.inputs[:, :bs]
        ids = torch.where(ids == LAST_SAMPLED, self.last_tokens[slots], ids)
        empty = np.zeros(0, dtype=np.int64)
        meta = self.backend.graph_metadata(bs, positions)
        batch = ForwardBatch(input_ids=ids, positions=positions, out_cache_loc=out_loc,
                             slots=empty, num_tokens=empty, start_pos=empty, query_start=empty,
                             kv_cache=self.kv_cache, backend=self.backend, metadata=meta)
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
            with torch.cuda.stream(stream):
                for _ in range(2):  # compile and autotune outside the capture
                    self._run(bs)
            stream.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                self._run(bs)
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
            slots: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """Replay for one decode token per request. Returns float32 logits [B, vocab] (a view of
        the static buffer, valid until the next replay) and the slots [B] on the device."""
        b = len(input_ids)
        bs = self.sizes[bisect.bisect_left(self.sizes, b)]
        packed = np.zeros((4, bs), dtype=np.int64)
        packed[0, :b], packed[1, :b], packed[2, :b], packed[3, :b] = (
            input_ids, positions, out_cache_loc, slots)
        packed[2, b:] = -1
        (dev,) = to_device_int64([packed.reshape(-1)], self.device)
        self.inputs[:, :bs].copy_(dev.view(4, bs))
        self.backend.prepare_replay(bs, slots, positions, self.inputs[3, :bs])
        self.graphs[bs].replay()
        self.replays += 1
        return self.logits[:b], self.inputs[3, :b]
