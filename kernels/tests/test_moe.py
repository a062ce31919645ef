"""fused_moe (route → align → grouped GEMMs with SiLU-and-mul → combine) vs the fp32 torch reference:
expert counts 8/64/128, top-k 1/2/8, token counts from 1, experts that receive no tokens, expert
parallel slices, and the alignment invariants the GEMMs rely on."""

from __future__ import annotations

import pytest
import torch

from helpers import TOL, rel_err
from tokenspeed_kernels.moe import fused_moe, max_padded, moe_align, moe_route
from tokenspeed_kernels.reference import ref_fused_moe, ref_moe_route


def _case(tokens: int, hidden: int, inter: int, experts: int, top_k: int, dtype: torch.dtype,
          device: str, seed: int, skew: bool = False) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen, device=device)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen, device=device) / hidden ** 0.5
    w2 = torch.randn(experts, hidden, inter, generator=gen, device=device) / inter ** 0.5
    logits = torch.randn(tokens, experts, generator=gen, device=device)
    if skew:  # the first experts win everywhere: the rest receive no tokens
        logits[:, : max(top_k, 2)] += 20.0
    return tuple(t.to(dtype=dtype, device=device) for t in (x, w13, w2, logits))


# (tokens, hidden, inter, experts, top_k): tiny so that the interpreter runs each in about a second.
SHAPES = [
    (1, 32, 16, 8, 1),
    (1, 64, 32, 8, 2),
    (3, 32, 48, 8, 8),
    (17, 64, 32, 8, 2),
    (40, 32, 16, 64, 2),
    (5, 64, 32, 64, 8),
    (2, 32, 16, 128, 8),
    (33, 32, 32, 128, 1),
    (200, 32, 16, 8, 2),
]


@pytest.mark.parametrize(("tokens", "hidden", "inter", "experts", "top_k"), SHAPES)
def test_fused_moe_matches_reference(tokens: int, hidden: int, inter: int, experts: int, top_k: int,
                                     device: str) -> None:
    x, w13, w2, logits = _case(tokens, hidden, inter, experts, top_k, torch.float32, device,
                               seed=tokens * experts + top_k)
    weights, ids = moe_route(logits, top_k, renormalize=top_k > 1)
    ref_w, ref_ids = ref_moe_route(logits, top_k, renormalize=top_k > 1)
    assert torch.equal(ids.long(), ref_ids)
    torch.testing.assert_close(weights, ref_w)
    out = fused_moe(x, w13, w2, weights, ids)
    assert out.shape == x.shape and out.dtype == x.dtype
    assert rel_err(out, ref_fused_moe(x, w13, w2, ref_w, ref_ids, dtype=torch.float64)) < TOL[torch.float32]


@pytest.mark.parametrize("top_k", [1, 2])
def test_experts_without_tokens(top_k: int, device: str) -> None:
    x, w13, w2, logits = _case(24, 32, 16, 64, top_k, torch.float32, device, seed=7, skew=True)
    weights, ids = moe_route(logits, top_k, renormalize=False)
    assert len(ids.unique()) <= 2  # 62 of 64 experts idle
    out = fused_moe(x, w13, w2, weights, ids)
    assert rel_err(out, ref_fused_moe(x, w13, w2, weights, ids, dtype=torch.float64)) < TOL[torch.float32]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision(dtype: torch.dtype, device: str) -> None:
    x, w13, w2, logits = _case(9, 64, 32, 8, 2, dtype, device, seed=3)
    weights, ids = moe_route(logits, 2, renormalize=True)
    out = fused_moe(x, w13, w2, weights, ids)
    assert out.dtype == dtype
    assert rel_err(out, ref_fused_moe(x, w13, w2, weights, ids)) < TOL[dtype]


def test_expert_parallel_slices_sum_to_the_whole(device: str) -> None:
    """Each of 4 EP ranks holds 2 of 8 experts; the partial outputs add up to the full one."""
    x, w13, w2, logits = _case(11, 32, 16, 8, 2, torch.float32, device, seed=5)
    weights, ids = moe_route(logits, 2, renormalize=True)
    full = fused_moe(x, w13, w2, weights, ids)
    parts = [fused_moe(x, w13[r * 2:(r + 1) * 2], w2[r * 2:(r + 1) * 2], weights, ids, expert_start=r * 2)
             for r in range(4)]
    for r, part in enumerate(parts):
        ref = ref_fused_moe(x, w13[r * 2:(r + 1) * 2], w2[r * 2:(r + 1) * 2], weights, ids, r * 2,
                            dtype=torch.float64)
        assert rel_err(part, ref) < TOL[torch.float32]
    assert rel_err(sum(parts), full) < TOL[torch.float32]


def _biases(w13: torch.Tensor, w2: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    b13 = 0.5 * torch.randn(w13.shape[:2], generator=gen)
    b2 = 0.5 * torch.randn(w2.shape[:2], generator=gen)
    return b13.to(w13.device, w13.dtype), b2.to(w2.device, w2.dtype)


# (tokens, hidden, inter, experts, top_k, expert_start, local experts): GPT-OSS-like (top-k of
# many, renormalised), intermediate sizes off the tiles, an expert-parallel slice.
GPT_OSS_SHAPES = [(1, 32, 16, 8, 2, 0, 8), (17, 64, 48, 8, 4, 0, 8), (40, 32, 16, 32, 4, 8, 8)]


@pytest.mark.parametrize(("tokens", "hidden", "inter", "experts", "top_k", "start", "local"),
                         GPT_OSS_SHAPES)
@pytest.mark.parametrize("limit", [0.7, 7.0])
def test_gpt_oss_experts_match_reference(tokens: int, hidden: int, inter: int, experts: int,
                                         top_k: int, start: int, local: int, limit: float,
                                         device: str) -> None:
    """Expert biases on both GEMMs and GPT-OSS's clamped SwiGLU (alpha 1.702; a limit low enough
    that the clamps bite on most entries, and the shipped 7.0)."""
    x, w13, w2, logits = _case(tokens, hidden, inter, experts, top_k, torch.float32, device,
                               seed=tokens + experts)
    b13, b2 = _biases(w13, w2, seed=tokens)
    weights, ids = moe_route(logits, top_k, renormalize=True)
    mine = slice(start, start + local)
    out = fused_moe(x, w13[mine], w2[mine], weights, ids, start, w13_bias=b13[mine],
                    w2_bias=b2[mine], activation="swiglu_oai", alpha=1.702, limit=limit)
    ref = ref_fused_moe(x, w13[mine], w2[mine], weights, ids, start, dtype=torch.float64,
                        b13=b13[mine], b2=b2[mine], swiglu_oai=(1.702, limit))
    assert rel_err(out, ref) < TOL[torch.float32]
    silu = ref_fused_moe(x, w13[mine], w2[mine], weights, ids, start, dtype=torch.float64,
                         b13=b13[mine], b2=b2[mine])
    assert rel_err(out, silu) > 10 * TOL[torch.float32]  # the activation is not SiLU's


@pytest.mark.parametrize(("tokens", "experts", "top_k", "block_m", "start", "local"),
                         [(1, 8, 2, 16, 0, 8), (50, 8, 2, 16, 0, 8), (7, 128, 8, 16, 0, 128),
                          (30, 64, 2, 32, 16, 16), (3, 8, 1, 16, 4, 4)])
def test_align_groups_every_local_assignment_once(tokens: int, experts: int, top_k: int, block_m: int,
                                                  start: int, local: int, device: str) -> None:
    gen = torch.Generator().manual_seed(tokens + experts)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
    ids = ids.to(torch.int32).to(device)
    a = moe_align(ids, local, start, block_m)
    n = tokens * top_k
    assert a.sorted_ids.numel() == max_padded(n, local, block_m)
    padded = int(a.num_padded)
    sorted_ids = a.sorted_ids.cpu()
    flat = ids.reshape(-1).long().cpu() - start
    held = sorted(i for i in range(n) if 0 <= flat[i] < local)
    real = sorted_ids[sorted_ids < n].tolist()
    assert sorted(real) == held  # every local assignment exactly once, nothing else
    assert (sorted_ids[padded:] == n).all()
    blocks = a.block_expert.cpu()
    for b in range(padded // block_m):
        rows = sorted_ids[b * block_m:(b + 1) * block_m]
        rows = rows[rows < n]
        assert len(rows) > 0 and (flat[rows] == blocks[b]).all()
        assert rows.tolist() == sorted(rows.tolist())  # token order kept within an expert
    assert (blocks[padded // block_m:] == -1).all()


GPU_SHAPES = [(t, 8, 2, torch.bfloat16) for t in (1, 64, 4096)] + \
    [(t, 64, 8, torch.bfloat16) for t in (1, 256)] + \
    [(t, 128, 8, torch.bfloat16) for t in (1, 8, 64, 256, 1024, 4096)] + \
    [(t, 128, 8, torch.float32) for t in (1, 256)]


@pytest.mark.gpu
@pytest.mark.parametrize(("tokens", "experts", "top_k", "dtype"), GPU_SHAPES)
def test_fused_moe_gpu_shapes(tokens: int, experts: int, top_k: int, dtype: torch.dtype) -> None:
    """Qwen3-30B-A3B's expert shape (hidden 2048, intermediate 768), Mixtral-like 8/top-2."""
    x, w13, w2, logits = _case(tokens, 2048, 768, experts, top_k, dtype, "cuda", seed=tokens)
    weights, ids = moe_route(logits, top_k, renormalize=True)
    out = fused_moe(x, w13, w2, weights, ids)
    ref = ref_fused_moe(x, w13, w2, weights, ids, dtype=torch.float32)
    assert rel_err(out, ref) < TOL[dtype]


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 8, 64, 512, 4096])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpt_oss_experts_gpu(tokens: int, dtype: torch.dtype) -> None:
    """GPT-OSS-20B's experts (hidden 2880, intermediate 2880, 32 experts, top-4): biases and the
    clamped SwiGLU (alpha 1.702, limit 7.0)."""
    x, w13, w2, logits = _case(tokens, 2880, 2880, 32, 4, dtype, "cuda", seed=tokens)
    b13, b2 = _biases(w13, w2, seed=tokens)
    weights, ids = moe_route(logits, 4, renormalize=True)
    out = fused_moe(x, w13, w2, weights, ids, w13_bias=b13, w2_bias=b2, activation="swiglu_oai",
                    alpha=1.702, limit=7.0)
    ref = ref_fused_moe(x, w13, w2, weights, ids, dtype=torch.float32, b13=b13, b2=b2,
                        swiglu_oai=(1.702, 7.0))
    assert rel_err(out, ref) < TOL[dtype]


@pytest.mark.gpu
def test_fused_moe_replays_in_a_cuda_graph() -> None:
    """Captured once per batch size, replayed with new inputs and new routing: no host syncs."""
    x, w13, w2, logits = _case(8, 256, 128, 64, 8, torch.bfloat16, "cuda", seed=1)
    static_x, static_logits = x.clone(), logits.clone()
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):  # warm up (compile) outside the capture
        fused_moe(static_x, w13, w2, *moe_route(static_logits, 8, True))
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe(static_x, w13, w2, *moe_route(static_logits, 8, True))
    for seed in range(3):
        nx, _, _, nl = _case(8, 256, 128, 64, 8, torch.bfloat16, "cuda", seed=100 + seed)
        static_x.copy_(nx)
        static_logits.copy_(nl)
        graph.replay()
        weights, ids = moe_route(nl, 8, True)
        assert rel_err(out, ref_fused_moe(nx, w13, w2, weights, ids)) < TOL[torch.bfloat16]
