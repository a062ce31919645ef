"""DeepSeek's multi-head latent attention with the compressed (latent) KV cache: its per-token
size, a prefix-cache hit over shared latent pages matching HF transformers (torch_native and
the triton MLA kernel under the interpreter), and what it refuses (fp8 KV, backends without it)."""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace

import pytest
import torch
from test_model_runner import PREFIX, TAIL_A, TAIL_B, decode_steps, new_requests, pages, schedule
from test_models_families import FAMILY_CONFIGS, family_models  # noqa: F401  (the fixture)
from test_models_numerics import hf_greedy
from transformers import DeepseekV3Config

from tokenspeed.models.config import config_from_hf_dict
from tokenspeed.worker.kv_sizing import page_bytes
from tokenspeed.worker.model_runner import ModelRunner
from tokenspeed.worker.plan import StepPlan


def test_kv_bytes_per_token_are_one_latent_per_layer() -> None:
    """DeepSeek-V3's shapes (61 layers, 128 heads, kv_lora_rank 512, rope 64), bf16: a token
    costs (512 + 64) * 2 bytes * 61 layers, not heads * (K 192 + V 128)."""
    raw = DeepseekV3Config().to_dict()
    raw["architectures"] = ["DeepseekV3ForCausalLM"]
    c = config_from_hf_dict(raw)
    assert (c.num_key_value_heads, c.head_dim, c.mla_v_dim) == (1, 576, 512)
    runner = SimpleNamespace(config=c, page_size=64, num_kv_heads=1, kv_dtype=torch.bfloat16)
    per_token = (512 + 64) * 2 * 61
    assert page_bytes(runner) == 64 * per_token
    expanded = 128 * (192 + 192) * 2 * 61  # the per-head K and padded V the cache held before
    assert expanded // per_token >= 80


def test_runner_pool_holds_the_latent(family_models: Callable[[str], tuple]) -> None:  # noqa: F811
    path, _ = family_models("deepseek_v3")
    runner = ModelRunner(path, page_size=4, max_slots=4, max_context_len=64, seed=0, num_pages=8)
    cfg = FAMILY_CONFIGS["deepseek_v3"]
    width = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    k, v = runner.kv_cache.k[0], runner.kv_cache.v[0]
    assert k.shape == (8, 4, 1, width) and v.shape == (8, 4, 1, cfg.kv_lora_rank)
    assert v.data_ptr() == k.data_ptr()  # V is the latent: no storage of its own
    assert page_bytes(runner) == 4 * width * 4 * cfg.num_hidden_layers


@pytest.mark.parametrize("backend", ["torch_native", "triton"])
def test_prefix_hit_on_latent_pages_matches_hf(family_models: Callable[[str], tuple],  # noqa: F811
                                               backend: str) -> None:
    """Request A fills latent pages; B reuses A's three prefix pages, prefills only its own
    tail (a chunk past a cached prefix) and decodes: HF's greedy tokens and logits."""
    path, model = family_models("deepseek_v3")
    runner = ModelRunner(path, page_size=4, max_slots=8, max_context_len=128, seed=0,
                         attention_backend=backend)
    runner.step(StepPlan.of(**new_requests([0]), **pages(0, 0, [9, 3, 6, 1]),
                            **schedule([(0, 0, PREFIX + TAIL_A, 1)])))
    plan = StepPlan.of(**new_requests([5]), **pages(5, 0, [9, 3, 6, 12, 13]),
                       **schedule([(5, 12, TAIL_B, 1)]))
    lg = runner.forward(plan)
    first = int(runner.sample(plan, lg).tokens[0])
    tokens, logits = decode_steps(runner, 5, 17, first, [14, 15], 6)
    ref_tokens, ref_logits = hf_greedy(model, [PREFIX + TAIL_B], 6)
    assert tokens == ref_tokens[0]
    worst = max((a - b).abs().max().item() for a, b in zip([lg[0], *logits], ref_logits[0]))
    assert worst < 1e-3, worst


def test_fp8_kv_cache_is_refused(family_models: Callable[[str], tuple]) -> None:  # noqa: F811
    path, _ = family_models("deepseek_v2")
    with pytest.raises(ValueError, match="not supported yet for multi-head latent attention"):
        ModelRunner(path, page_size=4, max_slots=4, max_context_len=64, seed=0,
                    kv_cache_dtype="fp8_e4m3")


def test_deterministic_inference_is_refused(family_models: Callable[[str], tuple]) -> None:  # noqa: F811
    from tokenspeed.layers import batch_invariant

    path, _ = family_models("deepseek_v2")
    batch_invariant.enable()
    try:
        with pytest.raises(ValueError, match="deterministic-inference is not supported yet"):
            ModelRunner(path, page_size=4, max_slots=4, max_context_len=64, seed=0)
    finally:
        batch_invariant.enable(False)


def test_mixed_step_mla_matches_torch_native(family_models: Callable[[str], tuple]) -> None:  # noqa: F811
    """Two decodes leading a step with a prefill chunk past a cached prefix (the triton backend:
    mla_decode_attention for the decodes, mla_extend_attention for the chunk): torch_native's
    logits."""
    path, _ = family_models("deepseek_v3")
    logits = {}
    for backend in ("torch_native", "triton"):
        runner = ModelRunner(path, page_size=4, max_slots=8, max_context_len=128, seed=0,
                             attention_backend=backend)
        runner.step(StepPlan.of(**new_requests([0]), **pages(0, 0, [1, 2, 3, 4]),
                                **schedule([(0, 0, PREFIX + TAIL_A, 1)])))
        runner.step(StepPlan.of(**new_requests([1]), **pages(1, 0, [5, 6]),
                                **schedule([(1, 0, TAIL_B + [7], 1)])))
        steps = [(0, 15, [40], 1), (1, 6, [41], 1), (2, 8, PREFIX[8:] + TAIL_B, 1)]
        plan = StepPlan.of(**new_requests([2]), **pages(2, 0, [1, 2, 7, 8, 9]), **schedule(steps))
        logits[backend] = runner.forward(plan)
    torch.testing.assert_close(logits["triton"], logits["torch_native"], atol=2e-4, rtol=1e-4)
