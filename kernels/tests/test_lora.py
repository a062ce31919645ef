"""Multi-LoRA shrink/expand kernels (BGMV per token, SGMV per segment) and the stacked GEMM's
merge kernel vs the torch reference (tokenspeed.layers.lora.lora_reference), on a batch mixing
adapters and base-model rows; and the linear layers' stacked path (base weight and A in one
tensor) vs their unstacked one."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tokenspeed.layers.linear import ColumnLinear, RowLinear
from tokenspeed.layers.lora import LoraBatch, LoraWeights, lora_reference, token_segments
from tokenspeed_kernels.lora import bgmv_expand, bgmv_merge, bgmv_shrink, sgmv_expand, sgmv_shrink

# (in features, sub-projection output sizes, rank): a fused qkv with GQA, a gate_up, an o_proj
# whose sizes are no multiple of any block; a long K that the per-token shrink splits in slices
# (1500 = 2 slices of 768, the last one short).
SHAPES = [(40, [24, 8, 8], 4), (36, [20, 20], 8), (50, [37], 3), (1500, [20, 12], 4)]
SLOTS = 3


def _case(k: int, subs: list[int], rank: int, dtype: torch.dtype, device: str,
          seg_lens: list[int], seg_slots: list[int]):
    gen = torch.Generator().manual_seed(k * 100 + rank)
    t = sum(seg_lens)
    x = torch.randn(t, k, generator=gen).to(dtype=dtype, device=device)
    a = torch.randn(SLOTS, len(subs) * rank, k, generator=gen).to(dtype=dtype, device=device)
    b = torch.randn(SLOTS, sum(subs), rank, generator=gen).to(dtype=dtype, device=device)
    y = torch.randn(t, sum(subs), generator=gen).to(dtype=dtype, device=device)
    token_slot = np.repeat(np.asarray(seg_slots, np.int32), seg_lens)
    return x, a, b, y, token_slot


# Segments as a mixed step lays them out: prefill chunks (long) and decodes (one token), some on
# the base model (-1), the same adapter in two requests.
LAYOUTS = [([5, 1, 1, 19, 1, 2], [0, -1, 2, 1, 0, -1]), ([1, 1, 1, 1], [2, 2, -1, 0])]


def _reference(x, a, b, y, token_slot, subs, rank):
    return lora_reference(x.float().cpu(), a.float().cpu(), b.float().cpu(),
                          token_segments(token_slot), subs, rank, y.float().cpu().clone())


def _tol(dtype: torch.dtype) -> float:
    return 1e-4 if dtype == torch.float32 else 3e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_bgmv_matches_reference(dtype, shape, layout, device):
    k, subs, rank = shape
    x, a, b, y, token_slot = _case(k, subs, rank, dtype, device, *layout)
    want = _reference(x, a, b, y, token_slot, subs, rank)
    # A fixed-size slot buffer longer than the step, as CUDA graphs hold it (-1 past the end).
    slots = torch.full((len(token_slot) + 7,), -1, dtype=torch.int32, device=device)
    slots[:len(token_slot)] = torch.from_numpy(token_slot).to(device)
    xa = bgmv_shrink(x, a, slots)
    offsets = tuple(np.cumsum(subs[:-1]).tolist())
    got = bgmv_expand(xa, b, slots, y.clone(), offsets, rank)
    scale = want.abs().max().item()
    assert (got.float().cpu() - want).abs().max().item() <= _tol(dtype) * scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_sgmv_matches_reference(dtype, shape, layout, device):
    k, subs, rank = shape
    x, a, b, y, token_slot = _case(k, subs, rank, dtype, device, *layout)
    want = _reference(x, a, b, y, token_slot, subs, rank)
    segs = token_segments(token_slot)
    start, length, slot = (torch.from_numpy(np.ascontiguousarray(c)).to(device) for c in segs.T)
    max_len = int(segs[:, 1].max())
    xa = torch.zeros(x.shape[0], a.shape[1], dtype=dtype, device=device)
    sgmv_shrink(x, a, start, length, slot, max_len, xa)
    got = sgmv_expand(xa, b, start, length, slot, max_len, y.clone(), tuple(subs), rank)
    scale = want.abs().max().item()
    assert (got.float().cpu() - want).abs().max().item() <= _tol(dtype) * scale


def test_base_rows_untouched(device):
    """Rows on the base model (-1) keep y exactly: no delta, no rounding through the kernel."""
    x, a, b, y, token_slot = _case(40, [24, 8, 8], 4, torch.float32, device, [2, 3], [-1, 1])
    slots = torch.from_numpy(token_slot).to(device)
    xa = bgmv_shrink(x, a, slots)
    got = bgmv_expand(xa, b, slots, y.clone(), (24, 32), 4)
    assert torch.equal(got[:2], y[:2])
    assert not torch.allclose(got[2:], y[2:])


def test_token_segments():
    segs = token_segments(np.asarray([-1, 0, 0, 2, 2, 2, -1, 0], np.int32))
    assert segs.tolist() == [[1, 2, 0], [3, 3, 2], [7, 1, 0]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_bgmv_merge_matches_reference(dtype, shape, layout, device):
    """One GEMM over [W; A_0; A_1; A_2] then the merge: the base output plus each row's delta."""
    k, subs, rank = shape
    x, a, b, _, token_slot = _case(k, subs, rank, dtype, device, *layout)
    w = torch.randn(sum(subs), k, generator=torch.Generator().manual_seed(3)).to(dtype=dtype,
                                                                                 device=device)
    out = x @ torch.cat([w, a.reshape(-1, k)]).T
    base = out[:, :sum(subs)].float().cpu()
    want = _reference(x, a, b, base, token_slot, subs, rank)
    slots = torch.full((len(token_slot) + 5,), -1, dtype=torch.int32, device=device)
    slots[:len(token_slot)] = torch.from_numpy(token_slot).to(device)
    got = bgmv_merge(out, b, slots, tuple(np.cumsum(subs[:-1]).tolist()), rank)
    assert got.is_contiguous() and got.shape == (x.shape[0], sum(subs))
    scale = want.abs().max().item()
    assert (got.float().cpu() - want).abs().max().item() <= _tol(dtype) * scale
    base_rows = torch.from_numpy(token_slot < 0)
    assert torch.equal(got.cpu()[base_rows], out.cpu()[base_rows, :sum(subs)]), "copied as is"


def _pool(layer, in_features: int, subs: list[int], batch: LoraBatch, device: str) -> LoraWeights:
    """A pool of 3 slots of rank 4 on `layer`, stacked, with adapters in slots 0 and 2."""
    gen = torch.Generator().manual_seed(in_features)
    with torch.no_grad():
        layer.weight.normal_(generator=gen)
        if layer.bias is not None:
            layer.bias.normal_(generator=gen)
    layer.to(device)
    lora = LoraWeights(batch, in_features, subs, 4, 3, torch.float32, torch.device(device))
    plain = layer.weight.detach().clone()
    assert lora.stack_base(layer.weight, layer.bias, quantized=False)
    assert lora.stacked is not None and layer.weight.data_ptr() == lora.stacked.data_ptr()
    assert torch.equal(layer.weight, plain)
    for slot in (0, 2):
        for sub, size in enumerate(subs):
            lora.set_sub(slot, sub, torch.randn(3, in_features, generator=gen).to(device),
                         torch.randn(size, 3, generator=gen).to(device))
    layer.lora = lora
    return lora


@pytest.mark.parametrize("which", ["qkv_bias", "row"])
def test_stacked_layer_matches_unstacked(which, device):
    """A layer's per-token step (one stacked GEMM + merge) gives what the segment path gives
    (the torch reference on CPU, SGMV on CUDA), and the base rows the plain layer's output."""
    batch = LoraBatch(torch.full((16,), -1, dtype=torch.int32, device=device), kernels=True)
    if which == "row":
        layer, k, subs = RowLinear(48, 37), 48, [37]
    else:
        layer, k, subs = ColumnLinear(40, [48, 16, 16], bias=True), 40, [48, 16, 16]
    _pool(layer, k, subs, batch, device)
    token_slot = np.asarray([2, -1, 0, 0, -1, 2, 2], np.int32)
    x = torch.randn(len(token_slot), k, generator=torch.Generator().manual_seed(9)).to(device)
    batch.set_segments(token_segments(token_slot))
    want = layer(x)
    batch.token_slot[:len(token_slot)] = torch.from_numpy(token_slot).to(device)
    batch.active, batch.per_token = True, True
    assert layer.lora is not None and layer.lora.stacked_step(x)
    got = layer(x)
    assert (got - want).abs().max().item() <= 1e-4 * want.abs().max().item()
    plain = torch.nn.functional.linear(x, layer.weight, layer.bias)
    base = torch.from_numpy(token_slot < 0).to(device)
    assert torch.allclose(got[base], plain[base], atol=1e-5)
    assert not torch.allclose(got[~base], plain[~base], atol=1e-3)


def test_stacking_is_refused_where_it_does_not_pay(monkeypatch):
    """FP8 (quantized) weights, pools whose A would outgrow half the base rows, or
    STACK_MAX_BYTES, stay apart."""
    from tokenspeed.layers import lora as lora_layer

    batch = LoraBatch(torch.full((4,), -1, dtype=torch.int32))
    layer = ColumnLinear(32, [16])
    lora = LoraWeights(batch, 32, [16], 4, 3, torch.float32, torch.device("cpu"))
    assert not lora.stack_base(layer.weight, None, quantized=True)
    assert not lora.stack_base(layer.weight, None, quantized=False)  # 12 A rows > 8
    assert lora.stacked is None and layer.weight.shape == (16, 32)
    small = LoraWeights(batch, 32, [16], 2, 2, torch.float32, torch.device("cpu"))  # 4 rows
    monkeypatch.setattr(lora_layer, "STACK_MAX_BYTES", 4 * 32 * 4 - 1)
    assert not small.stack_base(layer.weight, None, quantized=False)
    monkeypatch.setattr(lora_layer, "STACK_MAX_BYTES", 4 * 32 * 4)
    assert small.stack_base(layer.weight, None, quantized=False)
