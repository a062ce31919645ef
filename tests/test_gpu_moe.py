"""GPU checks of the MoE models (run on the device machine): Qwen3-MoE through ModelRunner on CUDA
with the triton MoE backend in decode CUDA graphs, against HF transformers (same seeded dummy
weights) and against the torch_native backend. Thresholds and helpers: tests/test_gpu.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_gpu import (
    Driver,
    compare_with_hf,
    hf_from_ours,
    hf_greedy,
    make_runner,
    prompts_for,
    staggered_greedy,
    write_config,
)

from tokenspeed.bench.model_configs import QWEN3_30B_A3B

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

NEW_TOKENS = 32
# fp32, small: 8 of 32 experts per token, every layer sparse but one (mlp_only_layers).
SMALL_MOE_FP32 = {**QWEN3_30B_A3B, "vocab_size": 1000, "hidden_size": 256, "intermediate_size": 512,
                  "moe_intermediate_size": 128, "num_experts": 32, "num_hidden_layers": 4,
                  "mlp_only_layers": [2], "num_attention_heads": 8, "num_key_value_heads": 2,
                  "head_dim": 32, "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2}


def test_qwen3_moe_fp32_triton_in_graphs_matches_hf_and_torch_native(tmp_path: Path) -> None:
    path = write_config(tmp_path, "moe", SMALL_MOE_FP32)
    prompts = prompts_for(SMALL_MOE_FP32["vocab_size"])
    triton_runner = make_runner(path, "float32", graphs=True, moe_backend="triton")
    assert triton_runner.graphs is not None  # type: ignore[attr-defined]
    ours = Driver(triton_runner).greedy(prompts, NEW_TOKENS)
    assert triton_runner.graphs.replays == NEW_TOKENS - 1  # type: ignore[attr-defined]
    hf = hf_from_ours(path, triton_runner.model, torch.float32)  # type: ignore[attr-defined]
    ref = [hf_greedy(hf, p, NEW_TOKENS)[0] for p in prompts]
    native = make_runner(path, "float32", moe_backend="torch_native")
    assert native.graphs is None  # type: ignore[attr-defined]  (torch_native MoE: eager only)
    eager = Driver(native).greedy(prompts, NEW_TOKENS)
    same = sum(a == b for o, r in zip(ours, ref) for a, b in zip(o, r)) / (len(ref) * NEW_TOKENS)
    print(f"\n[qwen3-moe small fp32] triton+graphs vs HF greedy agreement {same:.3f}; "
          f"vs torch_native identical={ours == eager}")
    assert ours == ref
    assert eager == ref


def test_qwen3_30b_a3b_shaped_bf16_matches_hf(tmp_path: Path) -> None:
    # Full width (128 experts, top-8, hidden 2048), 4 of the 48 layers.
    compare_with_hf("qwen3-30b-a3b x4 layers",
                    write_config(tmp_path, "qwen3moe", QWEN3_30B_A3B, num_hidden_layers=4,
                                 eos_token_id=151645), moe_backend="triton")


def test_qwen3_moe_fp32_extend_graphs_mixed_steps_match_hf(tmp_path: Path) -> None:
    """Prefills beside decodes (one prompt joining each step) replay extend graphs, whose fused
    MoE sees the padded token count."""
    from tokenspeed.worker.cuda_graph import extend_capture_sizes

    path = write_config(tmp_path, "moe", SMALL_MOE_FP32)
    prompts = prompts_for(SMALL_MOE_FP32["vocab_size"])
    runner = make_runner(path, "float32", moe_backend="triton",
                         extend_graph_sizes=extend_capture_sizes(256))
    ours = staggered_greedy(runner, prompts, NEW_TOKENS)
    hf = hf_from_ours(path, runner.model, torch.float32)  # type: ignore[attr-defined]
    ref = [hf_greedy(hf, p, NEW_TOKENS)[0] for p in prompts]
    assert runner.extend_graphs.replays == len(prompts)  # type: ignore[attr-defined]
    assert ours == ref


def test_qwen3_30b_a3b_shaped_bf16_extend_graphs_match_hf(tmp_path: Path) -> None:
    from tokenspeed.worker.cuda_graph import extend_capture_sizes

    compare_with_hf("qwen3-30b-a3b x4 layers, extend graphs",
                    write_config(tmp_path, "qwen3moe", QWEN3_30B_A3B, num_hidden_layers=4,
                                 eos_token_id=151645), moe_backend="triton",
                    extend_graph_sizes=extend_capture_sizes(2048))
