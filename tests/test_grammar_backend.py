"""The worker-side grammar backend (`--grammar-backend xgrammar`, python/tokenspeed/worker/grammar_backend.py):
each slot's matcher through admission, steps, abort and slot reuse, with synthetic plans and token
ids over the default model's tokenizer. Masks are checked against the HF tokenizer's own decoding
of each allowed id, not against xgrammar."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tokenspeed._core import GRAMMAR_KINDS
from tokenspeed.launch.assets import ensure_default_model
from tokenspeed.worker.grammar_backend import (
    GRAMMAR_ERROR,
    XGrammarConfig,
    XGrammarSlots,
    xgrammar_json_options,
)
from tokenspeed.worker.plan import LAST_SAMPLED, PLAN_DTYPES, StepOutput, StepPlan

EOS = 2  # the default model's <|endoftext|>
SLOT = 3


@pytest.fixture(scope="module")
def tokenizer_dir() -> Path:
    return ensure_default_model()


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir)


@pytest.fixture
def slots(tokenizer_dir: Path) -> XGrammarSlots:
    # Only the tests that run matchers skip without xgrammar; the start-up checks never do.
    if importlib.util.find_spec("xgrammar") is None:
        pytest.skip("the xgrammar package is not installed (pip install xgrammar)")
    return XGrammarSlots(XGrammarConfig(str(tokenizer_dir), 49152, True, None), max_slots=8)


def plan_with(step: int, *, finished: tuple[int, ...] = (), new: tuple[int, ...] = (),
              decode: tuple[int, ...] = (), grammars: tuple[tuple, ...] = ()) -> StepPlan:
    """A plan: `new` slots prefill a 3-token prompt and sample, `decode` slots feed LAST_SAMPLED;
    `grammars` rows are (slot, kind, text, starts_after, generated)."""
    sched = [(s, 0, [1, 2, 3], True) for s in new] + [(s, 9, [LAST_SAMPLED], True) for s in decode]
    plan = StepPlan.build(step, finished=finished, new=[{"slot": s} for s in new], scheduled=sched)

    def lists(rows: list[list[int]], dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
        return (np.asarray([len(r) for r in rows], np.uint32),
                np.asarray([x for r in rows for x in r], dtype))

    a = plan.__dict__
    a["grammar_slot"] = np.asarray([g[0] for g in grammars], PLAN_DTYPES["grammar_slot"])
    a["grammar_kind"] = np.asarray([GRAMMAR_KINDS[g[1]] for g in grammars], PLAN_DTYPES["grammar_kind"])
    a["grammar_starts_after"] = np.asarray([g[3] for g in grammars], PLAN_DTYPES["grammar_starts_after"])
    a["grammar_text_len"], a["grammar_text"] = lists([list(g[2].encode()) for g in grammars],
                                                     PLAN_DTYPES["grammar_text"])
    a["grammar_stop_ids_len"], a["grammar_stop_ids"] = lists([[EOS] for _ in grammars],
                                                             PLAN_DTYPES["grammar_stop_ids"])
    a["grammar_generated_len"], a["grammar_generated"] = lists([list(g[4]) for g in grammars],
                                                               PLAN_DTYPES["grammar_generated"])
    return plan


def allowed_text(tokenizer, masks, row: int = 0) -> set[str]:
    words = masks.words[row]
    ids = [i for i in range(len(words) * 32) if (int(words[i // 32]) >> (i % 32)) & 1]
    return {tokenizer.decode([i]) for i in ids}


def out(slot_tokens: dict[int, int]) -> StepOutput:
    return StepOutput(slots=np.asarray(list(slot_tokens)), tokens=np.asarray(list(slot_tokens.values())),
                      logprobs=np.zeros(len(slot_tokens)))


def test_admit_step_terminate_abort(slots: XGrammarSlots, tokenizer) -> None:
    p0 = plan_with(0, new=(SLOT,), grammars=((SLOT, "regex", "(yes|no)", -1, ()),))
    assert slots.apply_plan(p0)
    m = slots.masks(p0)
    assert m is not None and m.rows.tolist() == [0]
    # Exactly the ids whose text is a non-empty prefix of an answer (the HF tokenizer's decoding).
    assert allowed_text(tokenizer, m) == {"y", "ye", "yes", "n", "no"}
    # Step 1 is planned one step ahead (its input is step 0's token, still in flight).
    p1 = plan_with(1, decode=(SLOT,))
    assert slots.apply_plan(p1)
    step0 = out({SLOT: tokenizer.encode("ye")[0]})
    slots.advance(0, step0)
    assert step0.errors is None
    m = slots.masks(p1)
    assert allowed_text(tokenizer, m) == {"s"}
    slots.advance(1, out({SLOT: tokenizer.encode("s")[0]}))
    # Complete: only the stop ids.
    p2 = plan_with(2, decode=(SLOT,))
    assert slots.apply_plan(p2)
    m = slots.masks(p2)
    assert allowed_text(tokenizer, m) == {tokenizer.decode([EOS])}
    slots.advance(2, out({SLOT: EOS}))
    # Terminated (ignore_eos would sample on): still only the stop ids, nothing fails.
    p3 = plan_with(3, decode=(SLOT,))
    assert slots.apply_plan(p3)
    assert allowed_text(tokenizer, slots.masks(p3)) == {tokenizer.decode([EOS])}
    o = out({SLOT: EOS})
    slots.advance(3, o)
    assert o.errors is None
    # Aborted: the slot's matcher is gone; the slot samples unconstrained if it ever runs.
    p4 = plan_with(4, finished=(SLOT,), decode=(5,))
    assert not slots.apply_plan(p4)
    assert SLOT not in slots.slots


def test_a_reused_slot_gets_a_fresh_matcher_and_late_tokens_reach_the_old_one(
        slots: XGrammarSlots, tokenizer) -> None:
    p0 = plan_with(0, new=(SLOT,), grammars=((SLOT, "choice", '["alpha", "beta"]', -1, ()),))
    assert slots.apply_plan(p0)
    slots.masks(p0)
    old = slots.slots[SLOT]
    # Before step 0's token is in, the request is aborted and its slot taken by another grammar.
    p1 = plan_with(1, finished=(SLOT,), new=(SLOT,), grammars=((SLOT, "regex", "[0-9]+", -1, ()),))
    assert slots.apply_plan(p1)
    slots.advance(0, out({SLOT: tokenizer.encode("al")[0]}))
    new = slots.slots[SLOT]
    assert new is not old
    digits = allowed_text(tokenizer, slots.masks(p1))
    assert "7" in digits and "al" not in digits and all(t.isdigit() for t in digits)
    # The old matcher took step 0's token, the new one did not.
    assert old.matcher.accept_string("pha") and not new.matcher.accept_string("pha")
    # A new request without a grammar in the slot: no matcher, no mask.
    p2 = plan_with(2, finished=(SLOT,), new=(SLOT,))
    assert not slots.apply_plan(p2)
    assert slots.masks(p2) is None


def test_reasoning_then_grammar_and_a_readmission_replays_its_tokens(slots: XGrammarSlots,
                                                                     tokenizer) -> None:
    think_end = 100
    p0 = plan_with(0, new=(SLOT,), grammars=((SLOT, "regex", "(yes|no)", think_end, ()),))
    assert slots.apply_plan(p0)
    assert slots.masks(p0) is None  # reasoning is free
    slots.advance(0, out({SLOT: think_end}))
    p1 = plan_with(1, decode=(SLOT,))
    assert slots.apply_plan(p1)
    assert allowed_text(tokenizer, slots.masks(p1)) == {"y", "ye", "yes", "n", "no"}
    # Readmitted after a retraction with [reasoning, think-end, "ye"] generated: it resumes after "ye".
    generated = (5, think_end, tokenizer.encode("ye")[0])
    p2 = plan_with(2, finished=(SLOT,), new=(6,),
                   grammars=((6, "regex", "(yes|no)", think_end, generated),))
    assert slots.apply_plan(p2)
    assert allowed_text(tokenizer, slots.masks(p2)) == {"s"}


def test_a_token_outside_the_grammar_fails_the_request(slots: XGrammarSlots, tokenizer) -> None:
    p0 = plan_with(0, new=(SLOT, 4), grammars=((SLOT, "regex", "(yes|no)", -1, ()),))
    assert slots.apply_plan(p0)
    slots.masks(p0)
    o = out({4: tokenizer.encode("maybe")[0], SLOT: tokenizer.encode("maybe")[0]})
    slots.advance(0, o)
    assert o.errors is not None and o.errors.tolist() == [0, GRAMMAR_ERROR]  # slot 4 is free
    assert np.frombuffer(o.arrays()["event_error"], np.uint32).tolist() == [0, GRAMMAR_ERROR]


@pytest.mark.parametrize("kind,text", [
    ("json_schema", '{"type": "object", "properties": {"a": {"type": "integer"}}}'),
    ("grammar", 'start: "a" | "b"'),  # Lark (no ::=)
    ("grammar", 'root ::= "a" | "b"'),
    ("structural_tag", ('{"type": "structural_tag", "structures": [{"begin": "<f>", '
                        '"schema": {"type": "object"}, "end": "</f>"}], "triggers": ["<f>"]}')),
])
def test_every_kind_the_server_sends_compiles(slots: XGrammarSlots, kind: str, text: str) -> None:
    slots.admit(SLOT, kind, text, [EOS])
    assert slots.slots[SLOT].error is None and slots.slots[SLOT].active


def test_a_grammar_xgrammar_cannot_compile_fails_at_its_first_sample(slots: XGrammarSlots) -> None:
    p0 = plan_with(0, new=(SLOT,), grammars=((SLOT, "grammar", "root ::= (", -1, ()),))
    assert slots.apply_plan(p0)
    assert slots.masks(p0) is None
    o = out({SLOT: 7})
    slots.advance(0, o)
    assert o.errors is not None and o.errors.tolist() == [GRAMMAR_ERROR]


def test_serve_fails_at_start_when_xgrammar_does_not_import(tmp_path: Path) -> None:
    (tmp_path / "xgrammar.py").write_text("raise ImportError('no xgrammar here')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    r = subprocess.run([sys.executable, "-m", "tokenspeed.launch.cli", "serve", "--device", "cpu", "--port", "1",
                        "--grammar-backend", "xgrammar"], env=env, capture_output=True, text=True, check=False,
                       timeout=120)
    assert r.returncode != 0
    assert "--grammar-backend xgrammar needs the xgrammar package" in r.stderr, r.stderr[-2000:]
    assert "no xgrammar here" in r.stderr


def test_json_whitespace_flags_map_or_are_refused() -> None:
    default = r"( |\n[ \t]{0,16})"
    assert xgrammar_json_options(default, False, default) == (False, None)
    assert xgrammar_json_options("any", False, default) == (True, None)
    assert xgrammar_json_options(default, True, default) == (False, (",", ":"))
    with pytest.raises(ValueError, match="--constrained-json-whitespace-pattern"):
        xgrammar_json_options(r"[ ]?", False, default)
