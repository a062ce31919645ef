"""paged_decode_attention vs the fp32 torch reference (GQA, head dims, page sizes, splits, dtypes)."""

from __future__ import annotations

import pytest
import torch

from helpers import TOL, make_paged_cache, rel_err
from tokenspeed_kernels import paged_decode_attention
from tokenspeed_kernels.decode_attention import decode_semaphores
from tokenspeed_kernels.reference import ref_paged_decode_attention

FUSED = pytest.mark.parametrize("fused_reduce", [True, False], ids=["fused", "two_kernel"])


def _run(
    seq_lens: list[int],
    hkv: int,
    group: int,
    head_dim: int,
    page_size: int,
    dtype: torch.dtype,
    device: str,
    num_splits: int | None,
    seed: int,
    fused_reduce: bool = True,
    prefetch: bool | None = None,
    window: int | None = None,
    sinks: bool = False,
) -> None:
    """sinks: random per-head sink logits (GPT-OSS), large enough to take much of the softmax."""
    gen = torch.Generator().manual_seed(seed)
    k_cache, v_cache, page_table = make_paged_cache(seq_lens, page_size, hkv, head_dim, dtype, device, gen)
    q = torch.randn(len(seq_lens), hkv * group, head_dim, generator=gen).to(dtype=dtype, device=device)
    sink = (2.0 + 1.5 * torch.randn(hkv * group, generator=gen)).to(dtype=dtype, device=device) if sinks else None
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    scale = head_dim**-0.5
    out = torch.full_like(q, float("nan"))
    paged_decode_attention(q, k_cache, v_cache, page_table, lens, scale, out=out, num_splits=num_splits,
                           fused_reduce=fused_reduce, prefetch=prefetch, window=window, sinks=sink)  # fmt: skip
    ref = ref_paged_decode_attention(q, k_cache, v_cache, page_table, lens, scale, window=window, sinks=sink)
    err = rel_err(out, ref)
    assert err < TOL[dtype], f"rel err {err:.2e}"
    if fused_reduce:  # the counters are left zeroed for the next launch (CUDA-graph replays)
        assert not decode_semaphores(q.device, len(seq_lens) * hkv).any()


@FUSED
@pytest.mark.parametrize("group", [1, 3, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("page_size", [1, 16])
def test_decode_shapes(group: int, head_dim: int, page_size: int, fused_reduce: bool, device: str) -> None:
    _run([1, 7, 33, 300], 2, group, head_dim, page_size, torch.float32, device, None, seed=group * head_dim,
         fused_reduce=fused_reduce)  # fmt: skip


@FUSED
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_decode_dtypes(dtype: torch.dtype, fused_reduce: bool, device: str) -> None:
    _run([5, 130], 2, 4, 64, 16, dtype, device, None, seed=1, fused_reduce=fused_reduce)


@FUSED
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("num_splits", [1, 3, 8])
def test_decode_prefetch(group: int, num_splits: int, fused_reduce: bool, device: str) -> None:
    """The next tile loaded while this one computes: splits that end mid-tile, on a tile
    boundary (64, 128) and empty ones (8 splits of 7 tokens) give the reference's output."""
    _run([7, 64, 128, 200], 2, group, 64, 16, torch.float32, device, num_splits, seed=num_splits + group,
         fused_reduce=fused_reduce, prefetch=True)  # fmt: skip


@FUSED
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_sliding_window(num_splits: int, fused_reduce: bool, device: str) -> None:
    """Only the last `window` keys (Gemma 3 / GPT-OSS local layers): contexts shorter than,
    equal to and longer than the window, split or not."""
    _run([5, 24, 90], 2, 2, 64, 16, torch.float32, device, num_splits, seed=11,
         fused_reduce=fused_reduce, window=24)  # fmt: skip


@FUSED
@pytest.mark.parametrize("window", [None, 24])
@pytest.mark.parametrize("num_splits", [1, 3, 8])
def test_decode_sinks(num_splits: int, window: int | None, fused_reduce: bool, device: str) -> None:
    """Attention sinks (GPT-OSS): one sink score per head in the denominator, counted once over
    the splits (empty ones among them: 8 splits of 5 tokens), alone or with a sliding window."""
    _run([1, 5, 24, 90], 2, 4, 64, 16, torch.float32, device, num_splits, seed=21 + num_splits,
         fused_reduce=fused_reduce, window=window, sinks=True)  # fmt: skip


@FUSED
@pytest.mark.parametrize("num_splits", [1, 3, 8])
def test_decode_splits(num_splits: int, fused_reduce: bool, device: str) -> None:
    # 8 splits over seq 7 leaves most splits empty; the reduce must weigh them 0.
    _run([7, 200], 1, 8, 64, 16, torch.float32, device, num_splits, seed=num_splits, fused_reduce=fused_reduce)


def test_decode_fused_matches_two_kernel_and_replays(device: str) -> None:
    """Fused and two-kernel reduces agree; repeated launches on one counter buffer (as graph
    replays do) give the same output and leave the counters zero; a caller's buffer works."""
    gen = torch.Generator().manual_seed(11)
    seq_lens = [3, 64, 65, 200, 1]
    k_cache, v_cache, page_table = make_paged_cache(seq_lens, 16, 2, 64, torch.float32, device, gen)
    q = torch.randn(len(seq_lens), 8, 64, generator=gen).to(device)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    args = (q, k_cache, v_cache, page_table, lens, 0.125)
    two = paged_decode_attention(*args, num_splits=5, fused_reduce=False)
    sems = torch.zeros(len(seq_lens) * 2, dtype=torch.int32, device=device)
    for _ in range(3):
        fused = paged_decode_attention(*args, num_splits=5, semaphores=sems)
        torch.testing.assert_close(fused, two, atol=1e-6, rtol=1e-6)
        assert not sems.any()


def test_decode_output_dtype_and_alloc(device: str) -> None:
    gen = torch.Generator().manual_seed(0)
    k_cache, v_cache, page_table = make_paged_cache([9], 4, 1, 64, torch.bfloat16, device, gen)
    q = torch.randn(1, 2, 64, generator=gen).to(dtype=torch.bfloat16, device=device)
    lens = torch.tensor([9], dtype=torch.int32, device=device)
    out = paged_decode_attention(q, k_cache, v_cache, page_table, lens, 0.125)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    ref = ref_paged_decode_attention(q, k_cache, v_cache, page_table, lens, 0.125)
    assert rel_err(out, ref) < TOL[torch.bfloat16]


@pytest.mark.gpu
@FUSED
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_decode_gpu_big(dtype: torch.dtype, group: int, fused_reduce: bool, device: str) -> None:
    gen = torch.Generator().manual_seed(7)
    seq_lens = torch.randint(1, 5000, (37,), generator=gen).tolist() + [8192, 1]
    _run(seq_lens, 8, group, 128, 16, dtype, device, None, seed=group, fused_reduce=fused_reduce)
    _run(seq_lens[:5], 8, group, 128, 1, dtype, device, 16, seed=group + 1, fused_reduce=fused_reduce)


@pytest.mark.gpu
@FUSED
@pytest.mark.parametrize("window", [None, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_decode_sinks_gpu_gpt_oss(dtype: torch.dtype, window: int | None, fused_reduce: bool,
                                  device: str) -> None:
    """GPT-OSS-20B's heads (8 KV heads x 8, D=64) with sinks, full and sliding (128) layers."""
    gen = torch.Generator().manual_seed(5)
    seq_lens = torch.randint(1, 3000, (29,), generator=gen).tolist() + [4096, 1, 128, 129]
    _run(seq_lens, 8, 8, 64, 16, dtype, device, None, seed=3, fused_reduce=fused_reduce, window=window,
         sinks=True)  # fmt: skip


@pytest.mark.gpu
def test_decode_fused_reduce_gpu_stress(device: str) -> None:
    """Memory-ordering stress: 64 splits per kv head racing to be last, 8 launches per CUDA graph,
    replayed with new q and lengths each time: every (request, head) row of every launch must
    match the two-kernel result (a stale or missing partial would be off by O(1))."""
    gen = torch.Generator().manual_seed(3)
    batch, hkv, group, d, splits, launches = 16, 8, 4, 128, 64, 8
    k_cache, v_cache, page_table = make_paged_cache([8192] * batch, 16, hkv, d, torch.bfloat16, device, gen)
    q = torch.randn(launches, batch, hkv * group, d, device=device, dtype=torch.bfloat16)
    lens = torch.full((batch,), 8192, dtype=torch.int32, device=device)
    sems = torch.zeros(batch * hkv, dtype=torch.int32, device=device)
    fused, two = torch.empty_like(q), torch.empty_like(q)

    def step() -> None:
        for i in range(launches):
            args = (q[i], k_cache, v_cache, page_table, lens, d**-0.5)
            paged_decode_attention(*args, out=fused[i], num_splits=splits, semaphores=sems)
            paged_decode_attention(*args, out=two[i], num_splits=splits, fused_reduce=False)

    step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for replay in range(100):
        q.normal_()
        lens.random_(1, 8193)
        fused.fill_(float("nan"))
        graph.replay()
        row_err = (fused.float() - two.float()).norm(dim=-1) / two.float().norm(dim=-1)
        assert row_err.max().item() < 2e-2, f"replay {replay}: worst row rel err {row_err.max().item()}"
    torch.cuda.synchronize()
    assert not sems.any()
