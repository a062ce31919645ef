"""paged_extend_attention vs the fp32 torch reference (prefix + causal new tokens, GQA, pages)."""

from __future__ import annotations

import pytest
import torch

from helpers import TOL, make_paged_cache, rel_err
from tokenspeed_kernels import extend_config, extend_tiles, paged_extend_attention
from tokenspeed_kernels.reference import ref_paged_extend_attention


def _run(
    prefix_lens: list[int],
    new_lens: list[int],
    hkv: int,
    group: int,
    head_dim: int,
    page_size: int,
    dtype: torch.dtype,
    device: str,
    seed: int,
    pad_requests: int = 0,
    window: int | None = None,
    sinks: bool = False,
) -> None:
    """pad_requests: run the tiled launch a CUDA graph makes instead, with that many absent
    requests (no new tokens) after the real ones and a tile table sized for the worst case.
    sinks: random per-head sink logits (GPT-OSS)."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [p + n for p, n in zip(prefix_lens, new_lens)]
    k_cache, v_cache, page_table = make_paged_cache(seq_lens, page_size, hkv, head_dim, dtype, device, gen)
    starts = [0]
    for n in new_lens:
        starts.append(starts[-1] + n)
    q = torch.randn(starts[-1], hkv * group, head_dim, generator=gen).to(dtype=dtype, device=device)
    sink = (2.0 + 1.5 * torch.randn(hkv * group, generator=gen)).to(dtype=dtype, device=device) if sinks else None

    def i32(xs: list[int]) -> torch.Tensor:
        return torch.tensor(xs, dtype=torch.int32, device=device)

    args = (page_table, i32(starts), i32(prefix_lens), i32(seq_lens), head_dim**-0.5)
    ref = ref_paged_extend_attention(q, k_cache, v_cache, *args, window=window, sinks=sink)
    out = torch.full_like(q, float("nan"))
    if pad_requests:
        pad = [0] * pad_requests
        table = torch.cat([page_table, page_table[:1].expand(pad_requests, -1)])
        args = (table, i32(starts + [starts[-1]] * pad_requests), i32(prefix_lens + pad),
                i32(seq_lens + pad), head_dim**-0.5)
        block_m = extend_config(dtype, head_dim, k_cache.dtype, q.device)[0]
        requests = len(new_lens) + pad_requests
        tiles = extend_tiles(args[1], min(requests, starts[-1]) + starts[-1] // block_m, block_m)
        paged_extend_attention(q, k_cache, v_cache, *args, out=out, tiles=tiles, window=window, sinks=sink)
    else:
        paged_extend_attention(q, k_cache, v_cache, *args, out=out, window=window, sinks=sink)
    tol = 3e-4 if dtype == torch.float32 else TOL[dtype]
    err = rel_err(out, ref)
    assert err < tol, f"rel err {err:.2e}"


@pytest.mark.parametrize("group", [1, 3, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("page_size", [1, 16])
def test_extend_shapes(group: int, head_dim: int, page_size: int, device: str) -> None:
    # prefix 0 (plain prefill), a long prefix with 1 new token, odd sizes straddling tiles.
    _run([0, 33, 7, 100], [7, 1, 70, 33], 1, group, head_dim, page_size, torch.float32, device, seed=group)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_extend_dtypes(dtype: torch.dtype, device: str) -> None:
    _run([17, 0], [40, 9], 2, 2, 64, 16, dtype, device, seed=3)


@pytest.mark.parametrize("pad_requests", [0, 2])
def test_extend_sliding_window(pad_requests: int, device: str) -> None:
    """Each query sees only the keys within the window: a fresh prompt longer than it, chunks
    after a prefix longer than it, one token after a long prefix."""
    _run([0, 40, 100], [70, 33, 1], 2, 2, 64, 16, torch.float32, device, seed=5,
         pad_requests=pad_requests, window=24)


@pytest.mark.parametrize(("window", "pad_requests"), [(None, 0), (24, 0), (24, 2)])
def test_extend_sinks(window: int | None, pad_requests: int, device: str) -> None:
    """Attention sinks (GPT-OSS), alone or with a sliding window, eager or tiled: short and long
    prompts, chunks after a prefix, one token after a long prefix."""
    _run([0, 40, 100, 0], [70, 33, 1, 3], 2, 4, 64, 16, torch.float32, device, seed=8,
         pad_requests=pad_requests, window=window, sinks=True)


@pytest.mark.gpu
@pytest.mark.parametrize("window", [None, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_extend_sinks_gpu_gpt_oss(dtype: torch.dtype, window: int | None, device: str) -> None:
    """GPT-OSS-20B's heads (8 KV heads x 8, D=64) with sinks, full and sliding (128) layers."""
    _run([0, 1000, 4095, 300], [1500, 777, 1, 2048], 8, 8, 64, 16, dtype, device, seed=2,
         window=window, sinks=True)
    _run([0, 31], [300, 129], 8, 8, 64, 16, dtype, device, seed=3, pad_requests=3, window=window,
         sinks=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_extend_wide_heads(dtype: torch.dtype, device: str) -> None:
    """Gemma 3's 256-wide heads, with the tiles that fit a GPU's shared memory (the D=128 ones
    failed to launch on an H100: 320 KB)."""
    _run([0, 40], [70, 9], 2, 2, 256, 16, dtype, device, seed=6)


def test_extend_empty_request(device: str) -> None:
    # A request with no new tokens (q_start_loc repeats) must be skipped cleanly.
    _run([5, 12, 0], [3, 0, 4], 1, 2, 64, 16, torch.float32, device, seed=4)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("group", [1, 4])
def test_extend_gpu_big(dtype: torch.dtype, group: int, device: str) -> None:
    _run([0, 1000, 4095, 300], [1500, 777, 1, 2048], 8, group, 128, 16, dtype, device, seed=group)
    _run([0, 31], [300, 129], 4, group, 64, 1, dtype, device, seed=group + 9)


@pytest.mark.parametrize("pad_requests", [1, 5])
def test_extend_tiled_launch_matches(pad_requests: int, device: str) -> None:
    # The tiled grid of a CUDA graph: decodes (1 new token), an empty request, odd prefills,
    # absent requests after them; every real token is written, none of the padding.
    _run([33, 0, 5, 100, 9], [1, 0, 70, 1, 129], 2, 2, 64, 16, torch.float32, device, seed=7,
         pad_requests=pad_requests)


def test_extend_tiles_table() -> None:
    q_start = torch.tensor([0, 1, 1, 130, 131, 131], dtype=torch.int32)  # 1, 0, 129, 1, 0 new
    tiles = extend_tiles(q_start, 8, 64)
    # request 0: block 0; request 2: blocks 2, 1, 0 (last first); request 3: block 0; then none.
    assert tiles.tolist() == [[0, 2, 2, 2, 3, -1, -1, -1], [0, 2, 1, 0, 0, 0, 0, 0]]
    # skip_single: the one-token requests (0 and 3) get no tiles: the decode kernel runs them.
    lone = extend_tiles(q_start, 8, 64, skip_single=True)
    assert lone.tolist() == [[2, 2, 2, -1, -1, -1, -1, -1], [2, 1, 0, 0, 0, 0, 0, 0]]
