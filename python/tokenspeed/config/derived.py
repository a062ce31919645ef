"""Defaults that follow from what a worker measures at start-up rather than from a constant:
the flag table's help states them from the constants here, and nothing else restates them.
Imports nothing heavy (the flag table formats its help from these numbers)."""

from __future__ import annotations

# --max-running-requests when not given: the KV pool's tokens shared at this many tokens per
# request. A request's footprint over its life averages its prompt plus half its answer
# (1,536 for BENCHMARKS.md's S1, 1k in / 1k out), so a pool full of such requests holds
# about this many at once; with the Llama-3.1-8B shape on an H100 (bf16 pool ~423k tokens)
# that is 256 running, as the fixed default was, and an fp8 KV cache (twice the tokens) 512.
KV_TOKENS_PER_RUNNING_REQUEST = 1536
# Rounded down to a multiple of this, so that a pool a few pages smaller or larger (another
# rank, another start) gives the same value; also a multiple of the CUDA graph step (8).
RUNNING_REQUESTS_STEP = 64
# Never fewer than this (admission still keeps a small pool from over-committing: requests
# wait or are retracted when pages run out), never more: the slots of a worker and of a plan
# are sized for this bound before the pool is known.
MIN_DEFAULT_RUNNING_REQUESTS = 64
MAX_DEFAULT_RUNNING_REQUESTS = 1024


def default_max_running_requests(pool_tokens: int, context_len: int) -> int:
    """The default `--max-running-requests`: the KV pool's tokens divided by
    KV_TOKENS_PER_RUNNING_REQUEST (or by the context length when that is shorter: no request
    holds more), rounded down to a multiple of RUNNING_REQUESTS_STEP, within
    [MIN_DEFAULT_RUNNING_REQUESTS, MAX_DEFAULT_RUNNING_REQUESTS]. The worker applies it to its
    own pool (model_runner.py), so its CUDA graphs and slots match; the engine takes the
    smallest value of all ranks."""
    per_request = max(1, min(KV_TOKENS_PER_RUNNING_REQUEST, context_len))
    running = pool_tokens // per_request // RUNNING_REQUESTS_STEP * RUNNING_REQUESTS_STEP
    return max(MIN_DEFAULT_RUNNING_REQUESTS, min(MAX_DEFAULT_RUNNING_REQUESTS, running))

# --cuda-graph-max-bs when not given: the max running requests, at most this. It covers the
# fp8 default above on an H100 (512); a decode step of more requests is long enough (tens of ms
# on an 8B model) that an eager launch hides behind the GPU, so larger graphs would buy
# capture time and memory for little. vLLM's default capture limit is also 512.
MAX_DEFAULT_CUDA_GRAPH_BS = 512


def default_cuda_graph_max_bs(max_running: int) -> int:
    """The default `--cuda-graph-max-bs`: every decode batch the engine can send, up to
    MAX_DEFAULT_CUDA_GRAPH_BS."""
    return min(max_running, MAX_DEFAULT_CUDA_GRAPH_BS)
