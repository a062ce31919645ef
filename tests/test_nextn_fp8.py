"""NEXTN on a block-FP8 checkpoint (DeepSeek-V3/R1's release: `weight_block_size` [128, 128], the
MTP layer's decoder layer FP8 as the target's layers, its norms, `eh_proj` and `shared_head` not):
a tiny random V3 with its MTP layer (tests/deepseek_mtp_model.py) block-quantised here, each tile
scaled by its own factor first (x1/8 .. x8) so a scale on the wrong tile shows. The MTP head
drafts as a plain torch reference over HF on the dequantised weights (the activations' fp8
rounding taken out, as tests/test_fp8_block_weights.py does), greedy tokens with NEXTN are plain
decoding's on the same checkpoint, and dummy block-FP8 weights draft."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from deepseek_mtp_model import MtpModel, hf_greedy, make_mtp_model, reference_drafts
from safetensors.torch import load_file, save_file
from spec_checks import drafts_follow_the_reference
from test_fp8_block_weights import V3_QUANT, quantize_tiled
from transformers import AutoModelForCausalLM

from tokenspeed.layers.quantization.fp8 import FP8
from tokenspeed.worker.draft_chain import DraftSpec
from tokenspeed.worker.model_runner import ModelRunner
from tokenspeed.worker.offline_scheduler import OfflineScheduler
from tokenspeed.worker.plan import StepPlan

STEPS = 3
NEXTN = DraftSpec("NEXTN", None, STEPS)
# Widths on the 128 grid where layers fuse (gate/up, the experts); hidden 192: two K-blocks.
SHAPE = {"hidden_size": 192, "intermediate_size": 128, "moe_intermediate_size": 128}
PROMPT = [(37 * i) % 250 + 3 for i in range(11)]


def _quantised(name: str) -> bool:
    """V3's FP8 tensors: the projections of every layer, the MTP layer's decoder layer's too;
    not the MTP layer's own eh_proj / shared_head, the router, norms, embeddings, head."""
    return name.startswith("model.layers.") and name.endswith(("_proj.weight", "_with_mqa.weight")) \
        and ".eh_proj." not in name


def _per_expert(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Stacked expert banks (the MTP layer's, written from HF's state dict) as V3's checkpoint
    names them: one gate/up/down matrix per expert."""
    out = {}
    for name, t in tensors.items():
        if name.endswith(".mlp.experts.gate_up_proj"):
            for e, (gate, up) in enumerate(x.chunk(2, dim=0) for x in t):
                out[f"{name[:-len('gate_up_proj')]}{e}.gate_proj.weight"] = gate.contiguous()
                out[f"{name[:-len('gate_up_proj')]}{e}.up_proj.weight"] = up.contiguous()
        elif name.endswith(".mlp.experts.down_proj"):
            for e, down in enumerate(t):
                out[f"{name[:-len('down_proj')]}{e}.down_proj.weight"] = down.contiguous()
        else:
            out[name] = t
    return out


@pytest.fixture(scope="module")
def fp8_mtp(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, MtpModel]:
    """(block-FP8 checkpoint dir, the MTP model on exactly its dequantised weights, fp32)."""
    src = tmp_path_factory.mktemp("mtp_src")
    m = make_mtp_model(src, **SHAPE)
    file = next(src.glob("*.safetensors"))
    gen = torch.Generator().manual_seed(7)
    tensors, out, deq = _per_expert(load_file(str(file))), {}, {}
    for name, t in tensors.items():
        if not _quantised(name):
            out[name] = t
            continue
        q, s, deq[name] = quantize_tiled(t, gen)
        out[name], out[name + "_scale_inv"] = q, s
    dst = tmp_path_factory.mktemp("mtp_fp8")
    save_file(out, str(dst / file.name), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, "quantization_config": V3_QUANT}))
    # The reference: HF on the dequantised weights, the target and the MTP layer's decoder layer
    # (layer N of an N + 1 layer model read from the same file).
    save_file({**tensors, **deq}, str(file), metadata={"format": "pt"})
    n = m.target.config.num_hidden_layers
    target = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    full = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32, num_hidden_layers=n + 1).eval()
    return str(dst), MtpModel(src, target, full.model.layers[n], m.mtp)


def test_the_mtp_layer_loads_as_the_targets_layers(fp8_mtp: tuple[str, MtpModel]) -> None:
    path, m = fp8_mtp
    runner = ModelRunner(path, page_size=4, max_slots=2, max_context_len=64, draft=NEXTN)
    assert runner.fp8 is not None and runner.fp8.weight_block == (128, 128)
    head = runner.drafter.head
    attn, moe = head.decoder.self_attn, head.decoder.mlp
    assert attn.q_a_proj.weight.dtype == FP8 and attn.q_a_proj.weight_scale.shape == (1, 2)
    assert attn.o_proj.weight.dtype == FP8 and moe.shared_experts.gate_up_proj.weight.dtype == FP8
    assert moe.shared_experts.gate_up_proj.weight_scale.shape == (2, 2)
    assert moe.experts.gate_up_proj.dtype == FP8 and moe.experts.gate_up_proj_scale.shape == (8, 2, 2)
    assert attn.kv_b_proj.weight.dtype == torch.float32 and attn.kv_b_proj.weight_scale is None
    assert moe.gate.weight.dtype == torch.float32
    # The layer's own tensors as shipped (unquantised), in the dtype.
    assert head.eh_proj.weight.dtype == torch.float32
    torch.testing.assert_close(head.eh_proj.weight, m.mtp["eh_proj.weight"])
    # The loaded scales are the checkpoint's, tile for tile.
    n = m.target.config.num_hidden_layers
    ckpt = load_file(str(next(Path(path).glob("*.safetensors"))))
    assert torch.equal(attn.o_proj.weight_scale, ckpt[f"model.layers.{n}.self_attn.o_proj.weight_scale_inv"])
    assert torch.equal(moe.experts.down_proj_scale[3],
                       ckpt[f"model.layers.{n}.mlp.experts.3.down_proj.weight_scale_inv"])


def test_drafts_are_the_reference_on_the_dequantised_weights(
        fp8_mtp: tuple[str, MtpModel], monkeypatch: pytest.MonkeyPatch) -> None:
    """The weight path alone (the activations' fp8 rounding taken out of the reference GEMM):
    the FP8 head drafts as the MTP layer on the dequantised weights, through prompt chunks, a
    rejecting and an all-accepting verify step. A scale on the wrong tile (x1/8 .. x8 apart), a
    missing one or an unscaled weight drafts otherwise."""
    import tokenspeed_kernels.fp8_block as blocks

    def unrounded(x: torch.Tensor, group: int = 128, dtype: object = None) -> tuple:
        return x.float(), torch.ones(x.shape[0], -(-x.shape[1] // group))

    monkeypatch.setattr(blocks, "ref_per_token_group_quant_fp8", unrounded)
    path, m = fp8_mtp
    runner = ModelRunner(path, page_size=4, max_slots=2, max_context_len=64, draft=NEXTN)
    drafts_follow_the_reference(runner, PROMPT, STEPS, lambda seq: reference_drafts(m, seq, STEPS),
                                lambda seq, n: hf_greedy(m.target, seq, n))


def _speculative_greedy(runner: ModelRunner, prompt: list[int], n: int,
                        right: list[int]) -> list[int]:
    """`n` greedy tokens of one request with the runner's drafts verified each step; every
    other step verifies `right`'s continuation instead (all accepted)."""
    out = runner.launch(StepPlan.build(new=[{"slot": 0, "temperature": 0.0}],
                                       page_tables=[(0, 0, list(range(1, 17)))],
                                       scheduled=[(0, 0, prompt, True)])).wait()
    seq = prompt + np.asarray(out.tokens).tolist()
    for i in range(16):
        if len(seq) - len(prompt) >= n:
            break
        drafts = out.draft_tokens[0].tolist()
        if i % 2:
            drafts = right[len(seq) - len(prompt):][:STEPS]
            assert len(drafts) == STEPS
        out = runner.launch(StepPlan.build(scheduled=[(0, len(seq) - 1, [seq[-1], *drafts],
                                                       True, STEPS)])).wait()
        seq += np.asarray(out.tokens).tolist()
    return seq[len(prompt):][:n]


def test_nextn_greedy_is_plain_greedy_on_the_fp8_checkpoint(fp8_mtp: tuple[str, MtpModel]) -> None:
    # The real numerics (activations rounded to fp8): speculation changes no token.
    path, _ = fp8_mtp
    plain = ModelRunner(path, page_size=4, max_slots=2, max_context_len=64)
    want = OfflineScheduler(plain).generate([PROMPT], 16, chunk_size=64).tokens[0]
    runner = ModelRunner(path, page_size=4, max_slots=2, max_context_len=64, draft=NEXTN)
    assert _speculative_greedy(runner, PROMPT, 12, want) == want[:12]


def test_dummy_block_fp8_weights_draft(fp8_mtp: tuple[str, MtpModel]) -> None:
    path, _ = fp8_mtp
    runner = ModelRunner(path, page_size=4, max_slots=2, max_context_len=64, load_format="dummy",
                         draft=NEXTN)
    head, layer = runner.drafter.head, runner.model.model.layers[1]
    for ours, targets in ((head.decoder.self_attn.q_b_proj, layer.self_attn.q_b_proj),
                          (head.decoder.mlp.shared_experts.down_proj, layer.mlp.shared_experts.down_proj)):
        assert ours.weight.dtype == FP8 and ours.weight_scale.shape == targets.weight_scale.shape
    experts = head.decoder.mlp.experts
    assert experts.gate_up_proj.dtype == FP8 and experts.down_proj_scale.shape == (8, 2, 1)
    assert head.decoder.self_attn.kv_b_proj.weight.dtype == torch.float32
    assert head.eh_proj.weight.dtype == torch.float32
    out = runner.launch(StepPlan.build(new=[{"slot": 0, "temperature": 0.0}],
                                       page_tables=[(0, 0, [1, 2, 3])],
                                       scheduled=[(0, 0, [5, 6, 7, 8, 9], True)])).wait()
    assert out.draft_tokens is not None and len(out.draft_tokens[0]) == STEPS
