"""How many KV pages a runner's pool holds: what fits on the GPU beside the weights, the
activations of the largest step the scheduler may send (measured by a profile forward), the
sampler and the CUDA graphs; a fixed token count on CPU."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

from tokenspeed.distributed.groups import dp_token_counts, state
from tokenspeed.layers.attention import ForwardBatch
from tokenspeed.layers.attention_backends import backend_memory_bytes
from tokenspeed.layers.kv_cache import PagedKVCache
from tokenspeed.worker.cuda_graph import capture_sizes, graph_memory_estimate
from tokenspeed.worker.draft_graph import spec_graph_bytes

logger = logging.getLogger(__name__)

CPU_DEFAULT_KV_TOKENS = 16384
DEFAULT_MEM_FRACTION_STATIC = 0.85
DEFAULT_CHUNKED_PREFILL = 8192
PROFILE_SAFETY_BYTES = 512 << 20  # allocator fragmentation, cuBLAS workspaces, NCCL later


def page_bytes(runner: Any) -> int:
    """Bytes of one KV page of this rank, every layer's K and V (MLA: one latent per token)."""
    c = runner.config
    return PagedKVCache.bytes_per_page(
        num_layers=c.num_hidden_layers, page_size=runner.page_size,
        num_kv_heads=runner.num_kv_heads, head_dim=c.head_dim, dtype=runner.kv_dtype,
        v_from_k=bool(c.mla_v_dim))


def profile_num_pages(runner: Any, mem_fraction_static: float | None,
                  chunked_prefill_size: int | None) -> int:
    """KV pages that fit beside the weights, the activations of the largest step the
    scheduler can send (measured by a profile forward), the sampler and the CUDA graphs."""
    c = runner.config
    per_page = page_bytes(runner)  # fp8: half the bytes of bf16, twice the pages
    per_page += getattr(runner, "draft_page_bytes", 0)  # a draft head's KV (worker/draft_chain.py)
    if runner.device.type != "cuda":
        return -(-CPU_DEFAULT_KV_TOKENS // runner.page_size)
    # A step holds at most max(chunked_prefill_size, running decodes) tokens.
    tokens = min(max(chunked_prefill_size or DEFAULT_CHUNKED_PREFILL, runner.max_slots),
                 runner.max_context_len)
    rows = min(runner.max_slots, tokens)
    # Every rank profiles at start-up, together: data-parallel attention's MoE layers gather
    # all groups' tokens, here the same count from each.
    with dp_token_counts([tokens] * state().sizes.attn_dp):
        activations = profile_forward(runner, tokens, rows)
    drafter = getattr(runner, "drafter", None)
    if drafter is not None:  # a verify step samples every verified row (1 + k per request)
        rows = min(runner.max_slots * (drafter.num_steps + 1), tokens)
    sampler = 4 * rows * c.vocab_size * 4  # float32 copies of the logits (softmax, sort)
    decode_bs = runner.cuda_graph_max_bs if drafter is None else 0  # else verify graphs
    graphs = graph_memory_estimate(decode_bs, c.vocab_size) if decode_bs else 0
    num_graphs = len(capture_sizes(decode_bs)) if decode_bs else 0
    graphs += backend_memory_bytes(runner.attention_backend, num_graphs)
    graphs += getattr(runner, "draft_fixed_bytes", 0)  # a draft head's scratch and backend
    if runner.extend_graph_sizes:  # their pool: the activations of the largest (logits: eager)
        graphs += activations * runner.extend_graph_sizes[-1] // tokens
    if drafter is not None and runner.cuda_graph_max_bs:  # verify graphs, the head's
        graphs += spec_graph_bytes(runner, activations, tokens)
    lora = getattr(runner, "lora", None)
    if lora is not None:  # LoRA's stacked GEMM in the graphs (worker/lora.py)
        graph_tokens = max(runner.extend_graph_sizes[-1] if runner.extend_graph_sizes else 0,
                           runner.cuda_graph_max_bs or 0)
        graphs += lora.stacked_bytes(graph_tokens)
    reserve = activations + sampler + graphs + PROFILE_SAFETY_BYTES
    fraction = mem_fraction_static or DEFAULT_MEM_FRACTION_STATIC
    free, total = torch.cuda.mem_get_info(runner.device)
    # (1 - fraction) of the GPU stays free for activations, as in SGLang, and never less
    # than the measured reserve, so that no step the scheduler admits can run out.
    budget = min(free - total * (1.0 - fraction), free - reserve)
    pages = int(budget // per_page)
    logger.info("GPU memory: %.2f GiB free of %.2f after weights; reserve %.2f GiB "
                "(activations %.2f for %d tokens, sampler %.2f, graphs %.2f); KV %.2f GiB",
                free / 2**30, total / 2**30, reserve / 2**30, activations / 2**30, tokens,
                sampler / 2**30, graphs / 2**30, max(pages, 0) * per_page / 2**30)
    if pages <= 0:
        raise RuntimeError(
            f"no GPU memory left for the KV cache: free {free / 2**30:.1f} GiB, total "
            f"{total / 2**30:.1f} GiB, mem_fraction_static {fraction}, reserve for "
            f"activations/graphs {reserve / 2**30:.2f} GiB; raise the fraction or lower "
            "--chunked-prefill-size / --cuda-graph-max-bs")
    return pages

@torch.inference_mode()
def profile_forward(runner: Any, tokens: int, rows: int) -> int:
    """Peak bytes allocated by a forward of `tokens` prompt tokens plus the LM head on `rows`
    of them, against a one-page scratch cache (every K/V lands in page 0)."""
    c = runner.config
    scratch = PagedKVCache(
        num_layers=c.num_hidden_layers, num_pages=1, page_size=runner.page_size,
        num_kv_heads=runner.num_kv_heads, head_dim=c.head_dim, dtype=runner.kv_dtype,
        device=runner.device, max_slots=1, max_context_len=tokens,
        k_scale=runner.kv_scales[0], v_scale=runner.kv_scales[1], v_from_k=c.mla_v_dim)
    backend = runner._make_backend(scratch)
    positions = np.arange(tokens, dtype=np.int64)
    dev = runner.device
    batch = ForwardBatch(
        input_ids=torch.zeros(tokens, dtype=torch.int64, device=dev),
        positions=torch.from_numpy(positions).to(dev),
        out_cache_loc=torch.from_numpy(positions % runner.page_size).to(dev),
        slots=np.zeros(1, np.int64), num_tokens=np.asarray([tokens], np.int64),
        start_pos=np.zeros(1, np.int64), query_start=np.asarray([0, tokens], np.int64),
        kv_cache=scratch, backend=backend)
    torch.cuda.synchronize(dev)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(dev)
    base = torch.cuda.memory_allocated(dev)
    backend.prepare(batch)
    hidden = runner.model(batch.input_ids, batch.positions, batch)
    logits = runner.model.compute_logits(hidden[:rows])  # type: ignore[operator]
    torch.softmax(logits, dim=-1)
    torch.cuda.synchronize(dev)
    peak = torch.cuda.max_memory_allocated(dev) - base
    del batch, hidden, logits, scratch, backend
    torch.cuda.empty_cache()
    return int(peak)
