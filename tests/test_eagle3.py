"""EAGLE-3 drafting in the worker (worker/eagle3.py): a random head in the public layout
loads, and the drafts the runner returns after prefill chunks, after a verify step that
rejects and after one that accepts every draft are exactly those of a plain torch reference
of the head's forward over HF transformers' hidden states of the target (same weights)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from eagle3_head import make_head, reference_drafts
from transformers import LlamaConfig, LlamaForCausalLM

from tokenspeed.models.eagle3 import Eagle3Config
from tokenspeed.worker.model_runner import ModelRunner
from tokenspeed.worker.plan import StepPlan

STEPS = 3


@pytest.fixture(scope="module")
def target_and_head(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    cfg = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=8,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      initializer_range=0.2, tie_word_embeddings=False)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("eagle_target")
    LlamaForCausalLM(cfg).save_pretrained(path)
    head = make_head(path / "head", json.loads((path / "config.json").read_text()), draft_vocab=120)
    return str(path), head


def hf_reference(target: str, head: Path, tokens: list[int]) -> list[int]:
    """The reference drafts after `tokens`: HF's hidden states at the inputs of layers 2,
    N // 2, N - 3 (hidden_states[i] is layer i's input), then the head in plain torch."""
    model = LlamaForCausalLM.from_pretrained(target, torch_dtype=torch.float32)
    with torch.no_grad():
        hs = model(torch.tensor([tokens]), output_hidden_states=True).hidden_states
    n = model.config.num_hidden_layers
    aux = torch.cat([hs[i][0] for i in (2, n // 2, n - 3)], -1)[:-1]
    return reference_drafts(head, model.model.embed_tokens.weight, aux, tokens, STEPS)


def hf_greedy(target: str, tokens: list[int], n: int) -> list[int]:
    model = LlamaForCausalLM.from_pretrained(target, torch_dtype=torch.float32)
    out = model.generate(torch.tensor([tokens]), max_new_tokens=n, do_sample=False)
    return out[0, len(tokens):].tolist()


def test_head_config_and_capture_layers(target_and_head: tuple[str, Path]) -> None:
    cfg = Eagle3Config.load(target_and_head[1])
    assert (cfg.draft_vocab_size, cfg.head_dim, cfg.num_kv_heads) == (120, 16, 2)
    assert cfg.capture_layers(32) == (2, 16, 29)  # SGLang's / vLLM's default for Llama-3.1-8B
    ids = Eagle3Config(**{**cfg.__dict__, "aux_layer_ids": (1, 15, 28)})
    assert ids.capture_layers(32) == (2, 16, 29)  # a config's ids name layer outputs


def test_drafts_match_the_reference_forward(target_and_head: tuple[str, Path]) -> None:
    target, head = target_and_head
    runner = ModelRunner(target, page_size=4, max_slots=2, max_context_len=64,
                         eagle3=(str(head), STEPS))
    prompt = [(37 * i) % 290 + 3 for i in range(11)]
    pages = (0, 0, list(range(1, 17)))

    def step(plan: StepPlan) -> tuple[list[int], list[int]]:
        out = runner.launch(plan).wait()
        assert out.draft_tokens is not None
        return np.asarray(out.tokens).tolist(), out.draft_tokens[0].tolist()

    # Two prompt chunks (the first one's last position waits for the next chunk's token).
    runner.launch(StepPlan.build(new=[{"slot": 0, "temperature": 0.0}], page_tables=[pages],
                                 scheduled=[(0, 0, prompt[:6], False)])).wait()
    toks, drafts = step(StepPlan.build(scheduled=[(0, 6, prompt[6:], True)]))
    seq = prompt + toks
    assert drafts == hf_reference(target, head, seq)
    # A verify step whose drafts (the head's, random) are checked against the target.
    toks, drafts = step(StepPlan.build(scheduled=[(0, len(seq) - 1, [seq[-1], *drafts], True, STEPS)]))
    assert 1 <= len(toks) <= STEPS + 1
    seq += toks
    assert drafts == hf_reference(target, head, seq)
    # Right drafts (the target's own greedy continuation): all accepted, STEPS + 1 tokens in
    # one step, and the head drafts on from the end of the accepted run.
    right = hf_greedy(target, seq, STEPS + 1)
    toks, drafts = step(StepPlan.build(scheduled=[(0, len(seq) - 1, [seq[-1], *right[:STEPS]],
                                                   True, STEPS)]))
    assert toks == right
    seq += toks
    assert drafts == hf_reference(target, head, seq)


def test_a_config_alone_needs_dummy_weights(target_and_head: tuple[str, Path], tmp_path: Path) -> None:
    target, head = target_and_head
    (tmp_path / "config.json").write_text((head / "config.json").read_text())
    with pytest.raises(ValueError, match="dummy"):
        ModelRunner(target, page_size=4, max_slots=2, max_context_len=64,
                    eagle3=(str(tmp_path), STEPS))
    runner = ModelRunner(target, page_size=4, max_slots=2, max_context_len=64, load_format="dummy",
                         eagle3=(str(tmp_path), STEPS))
    out = runner.launch(StepPlan.build(new=[{"slot": 0, "temperature": 0.0}], page_tables=[(0, 0, [1, 2])],
                                       scheduled=[(0, 0, [5, 6, 7], True)])).wait()
    assert out.draft_tokens is not None and len(out.draft_tokens[0]) == STEPS
