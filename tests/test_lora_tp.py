"""LoRA under tensor parallelism (gloo, 2 CPU ranks): adapters are sharded like their base
layers (column-parallel: B's rows; row-parallel: A's columns, delta summed by the all-reduce)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from lora_ranks import HEAD_DIM, HEADS, HIDDEN, INTER, KV_HEADS, lora_layers_on_rank
from safetensors.torch import save_file
from tp_ranks import run_ranks


def _adapter(path: Path, rank: int, alpha: int) -> None:
    """A PEFT-format adapter over all seven projections of one layer."""
    shapes = {"q_proj": (HIDDEN, HEADS * HEAD_DIM), "k_proj": (HIDDEN, KV_HEADS * HEAD_DIM),
              "v_proj": (HIDDEN, KV_HEADS * HEAD_DIM), "o_proj": (HEADS * HEAD_DIM, HIDDEN),
              "gate_proj": (HIDDEN, INTER), "up_proj": (HIDDEN, INTER), "down_proj": (INTER, HIDDEN)}
    g = torch.Generator().manual_seed(1)
    tensors = {}
    for m, (fin, fout) in shapes.items():
        part = "mlp" if m in ("gate_proj", "up_proj", "down_proj") else "self_attn"
        key = f"base_model.model.model.layers.0.{part}.{m}"
        tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fin, generator=g)
        tensors[f"{key}.lora_B.weight"] = torch.randn(fout, rank, generator=g)
    path.mkdir()
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": list(shapes)}))


@pytest.mark.parametrize("stacked", [False, True])
def test_adapters_shard_like_their_base_layers(tmp_path: Path, stacked: bool,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """stacked: A under each weight shard, the per-token merge kernel (the CPU ranks interpret
    it: they inherit TRITON_INTERPRET=1)."""
    if stacked:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    _adapter(tmp_path / "a", rank=4, alpha=8)
    assert run_ranks(lora_layers_on_rank, 2, str(tmp_path / "a"), 2.0, stacked) == ["ok", "ok"]
