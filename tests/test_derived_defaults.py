"""Defaults derived from what the workers measure (config/derived.py): --max-running-requests
follows the KV pool, --cuda-graph-max-bs follows --max-running-requests."""

from __future__ import annotations

import pytest

from tokenspeed.config import BY_DEST
from tokenspeed.config.derived import (
    MAX_DEFAULT_CUDA_GRAPH_BS,
    MAX_DEFAULT_RUNNING_REQUESTS,
    MIN_DEFAULT_RUNNING_REQUESTS,
    default_cuda_graph_max_bs,
    default_max_running_requests,
)

# The pool the worker sized for Llama-3.1-8B (bf16, 32 layers x 8 KV heads x 128) on an H100
# at the default --mem-fraction-static: 26,430 pages of 16 tokens (benches/RESULTS.md, session 1).
LLAMA_8B_H100_BF16_TOKENS = 26_430 * 16
LLAMA_8B_CONTEXT = 131_072


def kv_bytes_per_token(kv_dtype_bytes: int) -> int:
    """K and V of every layer of Llama-3.1-8B."""
    return 2 * 32 * 8 * 128 * kv_dtype_bytes


def test_a_bf16_pool_of_the_8b_on_an_h100_keeps_256_running() -> None:
    for context in (8192, LLAMA_8B_CONTEXT):  # the benches pass --context-length 8192
        assert default_max_running_requests(LLAMA_8B_H100_BF16_TOKENS, context) == 256


def test_an_fp8_pool_holds_twice_the_tokens_and_runs_512() -> None:
    kv_bytes = LLAMA_8B_H100_BF16_TOKENS * kv_bytes_per_token(2)  # the same KV budget in bytes
    fp8_tokens = kv_bytes // kv_bytes_per_token(1)
    assert fp8_tokens == 2 * LLAMA_8B_H100_BF16_TOKENS
    assert default_max_running_requests(fp8_tokens, LLAMA_8B_CONTEXT) == 512


def test_the_cpu_pool_keeps_the_floor_of_64() -> None:
    # 16384 tokens: the worker's CPU pool when --max-total-tokens is not given.
    assert default_max_running_requests(16_384, 8192) == MIN_DEFAULT_RUNNING_REQUESTS == 64


def test_a_short_context_counts_its_own_length_per_request() -> None:
    assert default_max_running_requests(65_536, 512) == 128
    assert default_max_running_requests(65_536, 8192) == 64  # 42 at 1536 per request: the floor


@pytest.mark.parametrize("tokens", [0, 1, 100_000, 393_215, 393_216, 10**6, 10**9])
def test_the_value_is_a_multiple_of_64_within_the_bounds(tokens: int) -> None:
    n = default_max_running_requests(tokens, LLAMA_8B_CONTEXT)
    assert MIN_DEFAULT_RUNNING_REQUESTS <= n <= MAX_DEFAULT_RUNNING_REQUESTS
    assert n % 64 == 0


def test_the_value_grows_with_the_pool_up_to_the_bound() -> None:
    values = [default_max_running_requests(t, LLAMA_8B_CONTEXT) for t in range(0, 2_000_000, 7_919)]
    assert values == sorted(values)
    assert values[-1] == MAX_DEFAULT_RUNNING_REQUESTS == 1024


def test_cuda_graphs_cover_the_running_requests_up_to_512() -> None:
    assert default_cuda_graph_max_bs(64) == 64
    assert default_cuda_graph_max_bs(256) == 256
    assert default_cuda_graph_max_bs(512) == 512
    assert default_cuda_graph_max_bs(1024) == MAX_DEFAULT_CUDA_GRAPH_BS == 512


def test_the_flag_help_states_the_rule() -> None:
    running = BY_DEST["max_running_requests"].help
    for number in ("1536", "64", "1024", "fp8"):
        assert number in running, running
    assert BY_DEST["max_running_requests"].default is None
    assert "512" in BY_DEST["cuda_graph_max_bs"].help
    assert BY_DEST["cuda_graph_max_bs"].default is None
