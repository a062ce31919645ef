"""EAGLE-3 drafting in the worker (worker/draft_chain.py): a random head in the public layout
loads, and the drafts the runner returns after prefill chunks, after a verify step that
rejects and after one that accepts every draft are exactly those of a plain torch reference
of the head's forward over HF transformers' hidden states of the target (same weights); so are
every request's drafts in a mixed batch (the head's attention batched through the attention
backend, torch_native and triton) and after a page copy."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from eagle3_head import make_head, reference_drafts
from spec_checks import BatchDrafting, drafting_resumes_after_pauses, drafts_follow_the_reference
from transformers import LlamaConfig, LlamaForCausalLM

from tokenspeed.models.eagle3 import Eagle3Config
from tokenspeed.worker.draft_chain import DraftSpec
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


@pytest.fixture(scope="module")
def sharp_head(target_and_head: tuple[str, Path]) -> Path:
    """A head whose drafts hang on its attention more (larger weights): a batched attention
    that read a wrong key or page would change them."""
    target = Path(target_and_head[0])
    return make_head(target / "sharp_head", json.loads((target / "config.json").read_text()),
                     draft_vocab=120, seed=3, std=0.2)


@functools.cache
def hf_model(target: str) -> LlamaForCausalLM:
    return LlamaForCausalLM.from_pretrained(target, torch_dtype=torch.float32)


def hf_reference(target: str, head: Path, tokens: list[int]) -> list[int]:
    """The reference drafts after `tokens`: HF's hidden states at the inputs of layers 2,
    N // 2, N - 3 (hidden_states[i] is layer i's input), then the head in plain torch."""
    model = hf_model(target)
    with torch.no_grad():
        hs = model(torch.tensor([tokens]), output_hidden_states=True).hidden_states
    n = model.config.num_hidden_layers
    aux = torch.cat([hs[i][0] for i in (2, n // 2, n - 3)], -1)[:-1]
    return reference_drafts(head, model.model.embed_tokens.weight, aux, tokens, STEPS)


def hf_greedy(target: str, tokens: list[int], n: int) -> list[int]:
    model = hf_model(target)
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
                         draft=DraftSpec("EAGLE3", str(head), STEPS))
    drafts_follow_the_reference(runner, [(37 * i) % 290 + 3 for i in range(11)], STEPS,
                                lambda seq: hf_reference(target, head, seq),
                                lambda seq, n: hf_greedy(target, seq, n))


def test_a_config_alone_needs_dummy_weights(target_and_head: tuple[str, Path], tmp_path: Path) -> None:
    target, head = target_and_head
    (tmp_path / "config.json").write_text((head / "config.json").read_text())
    with pytest.raises(ValueError, match="dummy"):
        ModelRunner(target, page_size=4, max_slots=2, max_context_len=64,
                    draft=DraftSpec("EAGLE3", str(tmp_path), STEPS))
    runner = ModelRunner(target, page_size=4, max_slots=2, max_context_len=64, load_format="dummy",
                         draft=DraftSpec("EAGLE3", str(tmp_path), STEPS))
    out = runner.launch(StepPlan.build(new=[{"slot": 0, "temperature": 0.0}], page_tables=[(0, 0, [1, 2])],
                                       scheduled=[(0, 0, [5, 6, 7], True)])).wait()
    assert out.draft_tokens is not None and len(out.draft_tokens[0]) == STEPS


@pytest.mark.parametrize("backend", ["torch_native", "triton"])  # triton: the interpreter on CPU
def test_a_batch_drafts_as_each_request_alone(target_and_head: tuple[str, Path], sharp_head: Path,
                                              backend: str) -> None:
    # Four requests of different lengths in one batch, the head's attention one backend call
    # per pass: prompt chunks (one of a single token, which only carries its last position on),
    # last chunks, plain decodes, verify steps that reject and one that accepts every draft, in
    # mixed orders. Every request's drafts are the reference's for that request alone.
    target, head = target_and_head[0], sharp_head
    runner = ModelRunner(target, page_size=4, max_slots=4, max_context_len=64,
                         attention_backend=backend, draft=DraftSpec("EAGLE3", str(head), STEPS))
    prompts = {s: [(31 * i + 17 * s) % 290 + 3 for i in range(n)]
               for s, n in ((0, 5), (1, 9), (2, 14), (3, 7))}
    b = BatchDrafting(runner, prompts, STEPS, lambda seq: hf_reference(target, head, seq))
    b.step(StepPlan.build(**b.admission(), scheduled=[
        (2, 0, prompts[2][:6], False), (0, 0, prompts[0], True), (3, 0, prompts[3][:3], False),
        (1, 0, prompts[1], True)]), {0, 1})
    b.step(StepPlan.build(scheduled=[
        (2, 6, prompts[2][6:10], False), b.verify(0), (1, len(b.seqs[1]) - 1, [b.seqs[1][-1]], True),
        (3, 3, prompts[3][3:4], False)]), {0, 1})
    right = hf_greedy(target, b.seqs[1], STEPS + 1)
    b.step(StepPlan.build(scheduled=[
        b.verify(1, right[:STEPS]), (3, 4, prompts[3][4:], True), b.verify(0),
        (2, 10, prompts[2][10:], True)]), {0, 1, 2, 3})
    assert b.seqs[1][-(STEPS + 1):] == right
    b.step(StepPlan.build(scheduled=[b.verify(s) for s in (3, 2, 1, 0)]), {0, 1, 2, 3})


@pytest.mark.parametrize("backend", ["torch_native", "triton"])
def test_drafting_resumes_exactly_after_paused_steps(target_and_head: tuple[str, Path],
                                                    sharp_head: Path, backend: str) -> None:
    # Speculation turned off by the scheduler (`pause_drafts`) and back on, per request and
    # for the whole batch: the head's KV kept up, its drafts the reference's on resumption.
    target, head = target_and_head[0], sharp_head
    runner = ModelRunner(target, page_size=4, max_slots=2, max_context_len=64,
                         attention_backend=backend, draft=DraftSpec("EAGLE3", str(head), STEPS))
    prompts = {0: [(29 * i) % 290 + 3 for i in range(6)], 1: [(13 * i + 5) % 290 + 3 for i in range(9)]}
    drafting_resumes_after_pauses(BatchDrafting(runner, prompts, STEPS,
                                                lambda seq: hf_reference(target, head, seq)))


def test_a_copied_page_brings_the_heads_kv(target_and_head: tuple[str, Path], sharp_head: Path) -> None:
    # The plan's device page copies (as for a shared prefix's partial page): B's first two pages
    # are copies of A's and it computes from position 6 on; the head's entries of positions
    # 0 ... 5 must come with the copies for B's drafts to be those of B alone.
    target = target_and_head[0]
    runner = ModelRunner(target, page_size=4, max_slots=2, max_context_len=64,
                         draft=DraftSpec("EAGLE3", str(sharp_head), STEPS))
    a = [(41 * i) % 290 + 3 for i in range(8)]
    b = a[:7] + [11, 12, 13]
    runner.launch(StepPlan.build(new=[{"slot": 0, "temperature": 0.0}],
                                 page_tables=[(0, 0, [1, 2, 3])],
                                 scheduled=[(0, 0, a, True)])).wait()
    out = runner.launch(StepPlan.build(new=[{"slot": 1, "temperature": 0.0}],
                                       page_tables=[(1, 0, [10, 11, 12])], copies=[(1, 10), (2, 11)],
                                       scheduled=[(1, 6, b[6:], True)])).wait()
    assert out.draft_tokens is not None
    seq = b + np.asarray(out.tokens).tolist()
    assert out.draft_tokens[0].tolist() == hf_reference(target, sharp_head, seq)
