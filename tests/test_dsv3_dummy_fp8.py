"""Dummy weights under a block-FP8 config (DeepSeek-V3's quantization_config), on CPU: linears and
routed experts are block-quantised as a V3 checkpoint holds them (fp8 + one scale per 128x128
tile), and each rank's shard is the same numbers at every layout (TP, MoE-TP, EP, data-parallel
attention), so two layouts serve the same model. Plus the DeepSeek-V3 benchmark config."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import DeepseekV3Config

from tokenspeed.bench.model_configs import DEEPSEEK_V3
from tokenspeed.distributed.groups import GROUP_NAMES, ParallelGroup, ParallelSizes, ParallelState
from tokenspeed.layers.moe import MoeOptions, MoeParallel
from tokenspeed.layers.quantization.fp8 import FP8, dequantize
from tokenspeed.layers.quantization.methods import resolve_quantization
from tokenspeed.models.weights import load_model, open_checkpoint
from tokenspeed_kernels.fp8_block import dequantize_block

# V3's shape, narrowed; every TP-2 shard (q_b 256 rows, o_proj 256 columns, MLP 256, experts 128)
# on the 128 grid, as V3's are at TP <= 8.
TINY = {**DEEPSEEK_V3, "vocab_size": 512, "hidden_size": 256, "intermediate_size": 512,
        "moe_intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 8,
        "num_key_value_heads": 8, "q_lora_rank": 128, "kv_lora_rank": 64, "qk_nope_head_dim": 32,
        "qk_rope_head_dim": 32, "v_head_dim": 64, "n_routed_experts": 8, "num_experts_per_tok": 2,
        "n_group": 4, "topk_group": 2, "first_k_dense_replace": 1, "max_position_embeddings": 256}


def test_v3_config_is_the_released_shape() -> None:
    hf = DeepseekV3Config(**{k: v for k, v in DEEPSEEK_V3.items() if k != "model_type"})
    assert (hf.hidden_size, hf.num_attention_heads, hf.q_lora_rank, hf.kv_lora_rank) == (7168, 128, 1536, 512)
    assert (hf.n_routed_experts, hf.num_experts_per_tok, hf.n_group, hf.topk_group) == (256, 8, 8, 4)
    assert DEEPSEEK_V3["quantization_config"]["weight_block_size"] == [128, 128]
    assert DEEPSEEK_V3["rope_scaling"]["factor"] == 40 and DEEPSEEK_V3["scoring_func"] == "sigmoid"


def _state(rank: int, world: int, attn_tp: int, moe_tp: int, ep: int) -> ParallelState:
    """Rank `rank`'s groups, no process groups (loading never communicates)."""
    sizes = ParallelSizes(world_size=world, attn_tp=attn_tp, dense_tp=attn_tp, moe_tp=moe_tp, ep=ep)

    def g(name: str, size: int, index: int) -> ParallelGroup:
        return ParallelGroup(name, index, size, tuple(range(size)))

    sizes_of = {"world": (world, rank), "attn_tp": (attn_tp, rank % attn_tp),
                "dense_tp": (attn_tp, rank % attn_tp), "moe_tp": (moe_tp, rank % moe_tp),
                "ep": (ep, rank // moe_tp), "attn_dp": (world // attn_tp, rank // attn_tp)}
    return ParallelState(sizes, rank, *(g(n, *sizes_of[n]) for n in GROUP_NAMES))


def _load(path: Path, st: ParallelState | None = None) -> dict[str, torch.Tensor]:
    """name → dequantised fp32 weight of this rank's shard."""
    ckpt = open_checkpoint(str(path), "dummy")
    fp8 = resolve_quantization(None, ckpt.config.raw, str(path))
    moe = MoeParallel()
    if st is not None:
        moe = MoeParallel(ep_rank=st.ep.rank, ep_size=st.ep.size, tp_rank=st.moe_tp.rank,
                          tp_size=st.moe_tp.size)
    model = load_model(ckpt, dtype=torch.float32, device=torch.device("cpu"), max_positions=256,
                       seed=3, moe=MoeOptions(parallel=moe), fp8=fp8, parallel=st)
    out = {}
    for name, m in model.named_modules():
        if getattr(m, "weight", None) is not None and m.weight.dtype == FP8:
            out[name] = dequantize(m.weight, m.weight_scale, torch.float32)
        elif getattr(m, "gate_up_proj_scale", None) is not None:
            out[name + ".w13"] = dequantize_block(m.gate_up_proj, m.gate_up_proj_scale, (128, 128))
            out[name + ".w2"] = dequantize_block(m.down_proj, m.down_proj_scale, (128, 128))
    out["kv_b"] = model.model.layers[0].self_attn.kv_b_proj.weight.float()
    return out


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("v3_dummy")
    (path / "config.json").write_text(json.dumps(TINY))
    return path


def test_dummy_weights_are_block_fp8_like_a_checkpoint(model_dir: Path) -> None:
    ckpt = open_checkpoint(str(model_dir), "dummy")
    fp8 = resolve_quantization(None, ckpt.config.raw, str(model_dir))
    model = load_model(ckpt, dtype=torch.float32, device=torch.device("cpu"), max_positions=256,
                       seed=3, fp8=fp8)
    attn, moe = model.model.layers[1].self_attn, model.model.layers[1].mlp
    assert attn.q_b_proj.weight.dtype == FP8 and attn.q_b_proj.weight_scale.shape == (4, 1)
    assert attn.kv_a_proj_with_mqa.weight_scale.shape == (1, 2)  # 96 x 256: a partial row block
    assert attn.kv_b_proj.weight.dtype == torch.float32  # read as matrices: high precision
    assert moe.experts.gate_up_proj.dtype == FP8 and moe.experts.gate_up_proj_scale.shape == (8, 4, 2)
    assert moe.experts.down_proj_scale.shape == (8, 2, 2) and moe.gate.weight.dtype == torch.float32
    assert model.model.layers[0].mlp.gate_up_proj.weight_scale.shape == (8, 2)
    assert model.lm_head.weight.dtype == torch.float32


def _halves(w: torch.Tensor, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    return w[..., :i, :], w[..., i:, :]


def test_dummy_model_is_the_same_at_every_layout(model_dir: Path) -> None:
    full = _load(model_dir)
    tp = [_load(model_dir, _state(r, 2, 2, 2, 1)) for r in range(2)]  # --tp 2
    ep = [_load(model_dir, _state(r, 2, 1, 1, 2)) for r in range(2)]  # --dp 2 attention, --ep 2
    attn = "model.layers.1.self_attn."
    for name, dim in (("q_b_proj", 0), ("o_proj", 1)):
        assert torch.equal(torch.cat([t[attn + name] for t in tp], dim), full[attn + name])
        assert all(torch.equal(e[attn + name], full[attn + name]) for e in ep)  # replicated
    assert torch.equal(torch.cat([t["kv_b"] for t in tp]), full["kv_b"])
    for key, inter in (("model.layers.0.mlp.gate_up_proj", 512), ("model.layers.1.mlp.experts.w13", 256)):
        parts = [_halves(t[key], inter // 2) for t in tp]  # each rank: its gate rows, its up rows
        gate, up = (torch.cat([p[j] for p in parts], -2) for j in (0, 1))
        assert torch.equal(torch.cat([gate, up], -2), full[key])
    w13, w2 = "model.layers.1.mlp.experts.w13", "model.layers.1.mlp.experts.w2"
    assert torch.equal(torch.cat([t[w2] for t in tp], -1), full[w2])
    for key in (w13, w2):
        assert torch.equal(torch.cat([e[key] for e in ep]), full[key])  # experts 0-3 | 4-7
    assert full[w13].abs().max() > 0 and not torch.equal(full[w13][0], full[w13][1])
