"""Phi-3/Phi-4, Gemma 3, GPT-OSS (and DeepSeek-V2/V3) through ModelRunner vs HF transformers on
tiny random checkpoints, fp32 CPU: greedy tokens and logits over chunked prefill and decode,
dummy loading, and TP=2 giving TP=1's tokens. test_e2e_model_families.py serves them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from test_models_numerics import assert_matches_hf, hf_greedy, randomize
from tp_ranks import generate_on_rank, run_ranks
from transformers import AutoModelForCausalLM, Phi3Config, PretrainedConfig

from tokenspeed.worker.model_runner import ModelRunner
from tokenspeed.worker.offline_scheduler import OfflineScheduler

_BASE = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256}

# LongRoPE: short factors below position 32, long ones from there (the prompts fit the
# original window and the generation crosses it), partial rotary (Phi-4-mini: 0.75).
PHI3_LONGROPE = Phi3Config(
    **_BASE, original_max_position_embeddings=32, partial_rotary_factor=0.75,
    pad_token_id=0, eos_token_id=2,
    rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                     "short_factor": [1.0 + 0.1 * i for i in range(6)],
                     "long_factor": [2.0 + 0.7 * i for i in range(6)]})

FAMILY_CONFIGS: dict[str, PretrainedConfig] = {
    "phi3_longrope": PHI3_LONGROPE,
}


def _prompts(lengths: list[int]) -> list[list[int]]:
    return [[(7 * i + 3 * j) % 250 + 3 for j in range(n)] for i, n in enumerate(lengths)]


PROMPTS = _prompts([3, 17, 40, 1, 9, 26, 64])
NEW_TOKENS = 24


@dataclass(frozen=True)
class Case:
    """A config served with `max_context_len` on `prompts`, `new_tokens` each."""

    config: str
    max_context_len: int = 128
    prompts: tuple[tuple[int, ...], ...] = tuple(map(tuple, PROMPTS))
    new_tokens: int = NEW_TOKENS


CASES: dict[str, Case] = {
    # A server context beyond the original window: long factors at every position, as
    # transformers has them for sequences longer than that window (prompts of 33+ tokens).
    "phi3_longrope_long": Case("phi3_longrope", 128, tuple(map(tuple, _prompts([33, 40, 47, 64])))),
    # A server context within the window: short factors, sequences up to 32 tokens.
    "phi3_longrope_short": Case("phi3_longrope", 32, tuple(map(tuple, _prompts([3, 17, 9, 1]))), 12),
}


@pytest.fixture(scope="module")
def family_models(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple]:
    """Per config: (checkpoint dir, HF model), built on first use."""
    cache: dict[str, tuple] = {}

    def get(name: str) -> tuple:
        if name not in cache:
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(FAMILY_CONFIGS[name]).eval()
            randomize(model, seed=1)
            path = tmp_path_factory.mktemp(name)
            model.save_pretrained(path)
            cache[name] = (str(path), model)
        return cache[name]

    return get


def hf_one_by_one(model: torch.nn.Module, prompts: list[list[int]], n: int) -> tuple[list, list]:
    """HF greedy one prompt at a time (a left-padded batch would put the longest prompt's
    positions, and its sliding-window / rope choices, on every row)."""
    tokens, logits = [], []
    for p in prompts:
        t, lg = hf_greedy(model, [p], n)
        tokens += t
        logits += lg
    return tokens, logits


@pytest.mark.parametrize("case", list(CASES))
def test_family_greedy_matches_hf(family_models: Callable[[str], tuple], case: str) -> None:
    c = CASES[case]
    path, model = family_models(c.config)
    prompts = [list(p) for p in c.prompts]
    ref_tokens, ref_logits = hf_one_by_one(model, prompts, c.new_tokens)
    runner = ModelRunner(path, page_size=4, max_slots=8, max_context_len=c.max_context_len, seed=0)
    assert runner.config.architecture == type(model).__name__
    assert_matches_hf(runner, prompts, ref_tokens, ref_logits, chunk_size=8)


@pytest.mark.parametrize("name", list(FAMILY_CONFIGS))
def test_family_dummy_weights_generate(family_models: Callable[[str], tuple], name: str) -> None:
    path, _ = family_models(name)
    runner = ModelRunner(path, page_size=4, max_slots=4, max_context_len=128, seed=0,
                         load_format="dummy")
    res = OfflineScheduler(runner).generate(PROMPTS[:2], 4, chunk_size=8, keep_logits=True)
    assert all(len(t) == 4 for t in res.tokens)
    assert all(torch.isfinite(x).all() for req in res.logits for x in req)


@pytest.mark.parametrize("name", ["phi3_longrope"])
def test_family_tp2_matches_tp1(family_models: Callable[[str], tuple], name: str) -> None:
    """The fused checkpoint tensors (Phi-3 qkv_proj / gate_up_proj) cut per rank."""
    path, _ = family_models(name)
    prompts = PROMPTS[:3]
    ref_tokens, ref_logits, _ = generate_on_rank(0, path, prompts, 8)
    tokens, logits, _ = run_ranks(generate_on_rank, 2, path, prompts, 8)[0]
    assert tokens == ref_tokens
    worst = max(abs(a - b).max() for o, r in zip(logits, ref_logits) for a, b in zip(o, r))
    assert worst < 1e-3, worst
