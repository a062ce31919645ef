"""flashinfer attention backend: FlashInfer's paged FA2 kernels over the same KV pages.

K/V go into the cache through the same fused RoPE + KV-write kernel as the triton backend;
FlashInfer then attends over the paged cache. Once per step `prepare` plans a wrapper from the
host's page table (FlashInfer's CSR page lists: indptr, indices, last-page lengths) and every
layer runs it. Pure-decode steps use the decode wrapper with tensor cores, which runs the same
compiled module as prefill, so a first start JIT-compiles one module rather than two; steps with
a multi-token request use the prefill wrapper, causal with each request's new tokens aligned to
the end of its context. CUDA graphs: one decode wrapper per captured batch size in FlashInfer's
graph mode (fixed buffers), planned before each replay.

FlashInfer's plan stages its schedule in a pinned host buffer and copies it to the GPU
asynchronously, so a wrapper is planned again only after the event recorded behind its last
plan has passed; otherwise the host could overwrite the buffer while that copy is pending. In
the one-step-ahead loop the copy has run by then (the step before it has finished): the wait is
free.

FP8 KV cache (--kv-cache-dtype fp8*): the wrappers are planned with kv_data_type fp8 and the
query's own dtype, and each layer's run passes its k_scale/v_scale as Python floats (FlashInfer
folds them into the softmax scale and the output; floats, not tensors, so a CUDA graph captures
them without a device read).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tokenspeed.layers.attention import Attention, AttentionBackend, ForwardBatch
from tokenspeed.layers.kv_cache import PagedKVCache
from tokenspeed.layers.rotary import Rope
from tokenspeed.layers.triton_attention import store_kv

logger = logging.getLogger(__name__)

FLOAT_WORKSPACE_BYTES = 128 << 20  # split-KV scratch (FlashInfer's recommended size), shared
INT_WORKSPACE_BYTES = 8 << 20  # each wrapper's own schedule buffer (device, plus pinned host)


def paged_kv_arrays(page_table: np.ndarray, slots: np.ndarray, seq_lens: np.ndarray,
                    page_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """FlashInfer's CSR view of the requests' pages, all int32: indptr [B + 1]; indices
    [indptr[-1]], the first ceil(len / page_size) page-table entries of each slot, concatenated;
    and the tokens in each request's last page [B]. Every seq_len must be >= 1."""
    seq_lens = np.asarray(seq_lens, dtype=np.int64)
    num_pages = -(-seq_lens // page_size)
    indptr = np.zeros(len(seq_lens) + 1, dtype=np.int32)
    np.cumsum(num_pages, out=indptr[1:])
    width = int(num_pages.max()) if len(seq_lens) else 0
    rows = page_table[np.asarray(slots, dtype=np.int64), :width]
    indices = rows[np.arange(width)[None, :] < num_pages[:, None]]  # row-major: request order
    last = seq_lens - (num_pages - 1) * page_size
    return indptr, indices.astype(np.int32), last.astype(np.int32)


@dataclass
class FlashInferMetadata:
    wrapper: Any  # the planned FlashInfer wrapper every layer of the step runs


class FlashInferBackend(AttentionBackend):
    name = "flashinfer"
    fuses_rope = True  # the shared rotary_embedding_write_kv kernel

    def __init__(self, kv_cache: PagedKVCache, num_heads: int, head_dim: int,
                 sliding_window: int | None = None, q_dtype: torch.dtype | None = None) -> None:
        import flashinfer

        import tokenspeed_kernels  # noqa: F401  (the KV write; fail at start-up)

        self.kv_dtype = kv_cache.k[0].dtype if kv_cache.k else torch.bfloat16
        self.dtype = q_dtype or self.kv_dtype  # queries and outputs
        if self.dtype not in (torch.bfloat16, torch.float16) or self.kv_dtype not in (
                torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2):
            raise ValueError(f"attention_backend 'flashinfer' needs bfloat16 or float16 queries and a "
                             f"bfloat16, float16 or fp8 KV cache, not {self.dtype} / {self.kv_dtype}; "
                             "use --dtype bfloat16 or --attention-backend triton")
        self.kv_cache = kv_cache
        self.num_heads = num_heads
        self.num_kv_heads = int(kv_cache.k[0].shape[2]) if kv_cache.k else 1
        self.head_dim = head_dim
        self.scaling = head_dim ** -0.5
        self.sliding_window = sliding_window
        self.device = kv_cache.page_table.device
        self._flashinfer = flashinfer
        self.workspace = torch.zeros(FLOAT_WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        self.decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_tensor_cores=True, backend="fa2")
        self.prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD",
                                                                      backend="fa2")
        self.graph_wrappers: dict[int, Any] = {}
        self._planned: dict[int, torch.cuda.Event] = {}  # id(wrapper) → event behind its plan

    @staticmethod
    def memory_bytes(num_graphs: int) -> int:
        """The shared workspace, the eager and per-graph wrappers' buffers, and some slack."""
        return FLOAT_WORKSPACE_BYTES + (2 + num_graphs) * INT_WORKSPACE_BYTES + (32 << 20)

    # --- planning ------------------------------------------------------------------------

    def _plan(self, wrapper: Any, slots: np.ndarray, seq_lens: np.ndarray,
              num_tokens: np.ndarray | None = None) -> None:
        """Plan `wrapper` for these requests: decode (one new token each) if num_tokens is None,
        else prefill/extend with num_tokens new tokens each."""
        indptr, indices, last = (torch.from_numpy(a) for a in paged_kv_arrays(
            self.kv_cache.page_table_host, slots, seq_lens, self.kv_cache.page_size))
        done = self._planned.get(id(wrapper))
        if done is not None:
            done.synchronize()  # the last plan's copy out of the pinned buffer has run
        kw = {"q_data_type": self.dtype, "kv_data_type": self.kv_dtype, "sm_scale": self.scaling}
        geometry = (self.num_heads, self.num_kv_heads, self.head_dim, self.kv_cache.page_size)
        if num_tokens is None:
            wrapper.plan(indptr, indices, last, *geometry, **kw)
        else:
            qo_indptr = np.zeros(len(num_tokens) + 1, dtype=np.int32)
            np.cumsum(num_tokens, out=qo_indptr[1:])
            wrapper.plan(torch.from_numpy(qo_indptr), indptr, indices, last, *geometry,
                         causal=True, **kw)
        event = torch.cuda.Event()
        event.record()
        self._planned[id(wrapper)] = event

    def prepare(self, batch: ForwardBatch) -> None:
        seq_lens = batch.seq_lens
        if self.sliding_window is not None and int(seq_lens.max()) > self.sliding_window:
            raise NotImplementedError(
                f"the flashinfer attention backend has no sliding-window attention here (window "
                f"{self.sliding_window}); use --attention-backend torch_native")
        decode = bool((batch.num_tokens == 1).all())
        wrapper = self.decode if decode else self.prefill
        self._plan(wrapper, batch.slots, seq_lens, None if decode else batch.num_tokens)
        batch.metadata = FlashInferMetadata(wrapper)

    # --- CUDA graphs ---------------------------------------------------------------------

    def init_graphs(self, sizes: list[int]) -> None:
        n = max(sizes)
        # One set of page-list buffers serves every size: each replay is planned just before
        # it, in stream order.
        self._graph_indptr = torch.zeros(n + 1, dtype=torch.int32, device=self.device)
        self._graph_last = torch.ones(n, dtype=torch.int32, device=self.device)
        self._graph_indices = torch.zeros(n * self.kv_cache.max_pages_per_slot, dtype=torch.int32,
                                          device=self.device)
        for bs in sizes:
            self.graph_wrappers[bs] = self._flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace, "NHD", use_cuda_graph=True, use_tensor_cores=True,
                paged_kv_indptr_buffer=self._graph_indptr[:bs + 1],
                paged_kv_indices_buffer=self._graph_indices,
                paged_kv_last_page_len_buffer=self._graph_last[:bs], backend="fa2")

    def graph_metadata(self, bs: int, positions: torch.Tensor) -> FlashInferMetadata:
        wrapper = self.graph_wrappers[bs]
        if not torch.cuda.is_current_stream_capturing():  # warm-up runs plan; capture reuses it
            self._plan(wrapper, np.zeros(bs, np.int64), np.ones(bs, np.int64))
        return FlashInferMetadata(wrapper)

    def prepare_replay(self, bs: int, slots: np.ndarray, positions: np.ndarray,
                       slots_dev: torch.Tensor) -> None:
        pad = bs - len(slots)  # padding rows: one token of context in slot 0's first page
        self._plan(self.graph_wrappers[bs], np.concatenate([slots, np.zeros(pad, np.int64)]),
                   np.concatenate([positions + 1, np.ones(pad, np.int64)]))

    # --- per layer -----------------------------------------------------------------------

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: Attention,
                batch: ForwardBatch, rope: Rope | None = None) -> torch.Tensor:
        if layer.scaling != self.scaling:
            raise ValueError(f"flashinfer backend planned with softmax scale {self.scaling}, layer "
                             f"{layer.layer_id} uses {layer.scaling}")
        k_cache, v_cache = store_kv(self.kv_cache, layer.layer_id, q, k, v, batch.out_cache_loc, rope)
        m: FlashInferMetadata = batch.metadata
        if self.kv_dtype == self.dtype:
            return m.wrapper.run(q, (k_cache, v_cache)).flatten(1)
        # A scale of 1.0 is left out: FlashInfer multiplies the output by v_scale in an extra op.
        ks, vs = self.kv_cache.k_scale[layer.layer_id], self.kv_cache.v_scale[layer.layer_id]
        return m.wrapper.run(q, (k_cache, v_cache), k_scale=None if ks == 1.0 else ks,
                             v_scale=None if vs == 1.0 else vs).flatten(1)
