"""Checks every speculative algorithm with a draft head shares (test_eagle3, test_nextn and
their end-to-end tests): the head's drafts against a reference through the drafting scenario,
and a server's greedy answers against plain decoding's."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import openai
import pytest

from server_harness import Server
from tokenspeed.worker.model_runner import ModelRunner
from tokenspeed.worker.plan import LAST_SAMPLED, StepPlan


def drafts_follow_the_reference(runner: ModelRunner, prompt: list[int], steps: int,
                                reference: Callable[[list[int]], list[int]],
                                greedy: Callable[[list[int], int], list[int]]) -> None:
    """One request in slot 0: two prompt chunks (the first one's last position waits for the
    next chunk's token), a verify step of the head's own (random) drafts, then one of right
    drafts (the target's greedy continuation: all accepted). After each, the drafts equal
    `reference(tokens so far)`; `greedy(tokens, n)` is the target's next n greedy tokens."""
    pages = (0, 0, list(range(1, 17)))

    def step(plan: StepPlan) -> tuple[list[int], list[int]]:
        out = runner.launch(plan).wait()
        assert out.draft_tokens is not None
        return np.asarray(out.tokens).tolist(), out.draft_tokens[0].tolist()

    runner.launch(StepPlan.build(new=[{"slot": 0, "temperature": 0.0}], page_tables=[pages],
                                 scheduled=[(0, 0, prompt[:6], False)])).wait()
    toks, drafts = step(StepPlan.build(scheduled=[(0, 6, prompt[6:], True)]))
    seq = prompt + toks
    assert toks == greedy(prompt, 1)
    assert drafts == reference(seq)
    toks, drafts = step(StepPlan.build(scheduled=[(0, len(seq) - 1, [seq[-1], *drafts], True, steps)]))
    assert 1 <= len(toks) <= steps + 1
    seq += toks
    assert drafts == reference(seq)
    # All accepted: steps + 1 tokens in one step, and the head drafts on from the run's end.
    right = greedy(seq, steps + 1)
    toks, drafts = step(StepPlan.build(scheduled=[(0, len(seq) - 1, [seq[-1], *right[:steps]],
                                                   True, steps)]))
    assert toks == right
    seq += toks
    assert drafts == reference(seq)


def answers(server: Server, bodies: list[dict]) -> list:
    """The server's completions of `bodies`, sent at once."""
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=400)
    model = client.models.list().data[0].id
    with ThreadPoolExecutor(len(bodies)) as pool:
        return list(pool.map(lambda body: client.completions.create(model=model, **body), bodies))


def assert_same_answers(want: list, got: list) -> None:
    """Greedy answers with speculation are plain decoding's: text, finish reasons, usage, and
    logprobs (within float noise: a verify step computes a row among more rows)."""
    for w_answer, g_answer in zip(want, got, strict=True):
        assert g_answer.usage.completion_tokens == w_answer.usage.completion_tokens
        for w, g in zip(w_answer.choices, g_answer.choices, strict=True):
            assert (g.text, g.finish_reason) == (w.text, w.finish_reason)
            if w.logprobs is None:
                assert g.logprobs is None
                continue
            assert g.logprobs.tokens == w.logprobs.tokens
            assert g.logprobs.token_logprobs == pytest.approx(w.logprobs.token_logprobs, abs=2e-3)


def drafting_resumes_after_pauses(b: BatchDrafting) -> None:
    """Slots 0 and 1 (`b`, admitted by the caller's first plan): a paused prompt's last chunk
    beside a drafting one, verify steps, then plain steps with drafting paused (the head only
    writes its KV), mixed and whole; after each resumption the drafts are the reference's for
    the whole sequence, so the KV of the paused positions is the head's own."""
    prompts = b.prompts
    b.step(StepPlan.build(**b.admission(), scheduled=[(0, 0, prompts[0], True),
                                                     (1, 0, prompts[1], True, 0, True)]),
           {0, 1}, paused={1})
    b.step(StepPlan.build(scheduled=[b.verify(0), b.plain(1, paused=False)]), {0, 1})
    b.step(StepPlan.build(scheduled=[b.plain(0), b.verify(1)]), {0, 1}, paused={0})
    # Paused steps planned one step ahead (overlap): `LAST_SAMPLED` inputs, never right after
    # a verify step (slot 1's first), as the scheduler plans them.
    for i in range(3):
        b.step(StepPlan.build(scheduled=[b.plain(0, ahead=True), b.plain(1, ahead=i > 0)]),
               {0, 1}, paused={0, 1})
    b.step(StepPlan.build(scheduled=[b.plain(1, paused=False), b.plain(0, paused=False)]), {0, 1})
    b.step(StepPlan.build(scheduled=[b.verify(0), b.verify(1)]), {0, 1})


class BatchDrafting:
    """Requests in slots 0, 1, ... (`prompts`), stepped together by plans a test writes: after
    each step, every request that sampled has the drafts `reference(its tokens so far)`, as it
    would alone."""

    def __init__(self, runner: ModelRunner, prompts: dict[int, list[int]], steps: int,
                 reference: Callable[[list[int]], list[int]]) -> None:
        self.runner, self.prompts, self.steps, self.reference = runner, prompts, steps, reference
        self.seqs = {s: list(p) for s, p in prompts.items()}
        self.drafts: dict[int, list[int]] = {}

    def admission(self) -> dict:
        """StepPlan.build's `new` and `page_tables` for every request (16 pages a slot)."""
        return {"new": [{"slot": s, "temperature": 0.0} for s in self.prompts],
                "page_tables": [(s, 0, list(range(1 + 16 * s, 17 + 16 * s))) for s in self.prompts]}

    def step(self, plan: StepPlan, want: set[int], paused: set[int] = frozenset()) -> None:  # type: ignore[assignment]
        """Runs `plan`; the slots in `want` sampled, and their drafts are the reference's (none
        for the `paused` ones: the plan paused their drafting)."""
        out = self.runner.launch(plan).wait()
        assert out.draft_tokens is not None
        ends = np.cumsum(out.counts)
        got = {}
        for i, slot in enumerate(np.asarray(out.slots).tolist()):
            self.seqs[slot] += np.asarray(out.tokens[ends[i] - out.counts[i]:ends[i]]).tolist()
            got[slot] = out.draft_tokens[i].tolist()
        assert set(got) == want
        for slot, d in got.items():
            if slot in paused:
                assert d == [], slot
                continue
            assert d == self.reference(self.seqs[slot]), slot
            self.drafts[slot] = d

    def plain(self, slot: int, paused: bool = True, ahead: bool = False) -> tuple:
        """A plain decode row of the slot's last token, its drafting `paused` (the scheduler's
        speculation gate) or not; `ahead`: planned one step ahead, the token a placeholder."""
        s = self.seqs[slot]
        return (slot, len(s) - 1, [LAST_SAMPLED if ahead else s[-1]], True, 0, paused)

    def verify(self, slot: int, guess: list[int] | None = None) -> tuple:
        """A scheduled row verifying the slot's last drafts (or `guess`)."""
        s = self.seqs[slot]
        return (slot, len(s) - 1, [s[-1], *(guess or self.drafts[slot])], True, self.steps)


def assert_drafts_reported(server: Server, algorithm: str, chain: int) -> dict:
    """After some answers: the server verified drafts of `algorithm` (a chain of `chain`), and
    /get_server_info and /metrics count them alike once the engine is idle (a request just
    ended by a stop string may still finish a step between the two reads: read both again
    until they agree, for at most 10 s). Returns the server info."""
    deadline = time.monotonic() + 10.0
    while True:
        info = server.info()
        metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
        drafted = [float(ln.split()[-1]) for ln in metrics.splitlines()
                   if ln.startswith("tokenspeed:spec_decode_num_draft_tokens_total")]
        if drafted == [info["engine"]["spec_draft_tokens"]] or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert info["speculative_algorithm"] == algorithm
    assert info["speculative_num_draft_tokens"] == chain
    assert info["disable_overlap_schedule"] is False  # overlap while speculation is paused
    engine = info["engine"]
    assert engine["spec_draft_tokens"] > 0 and engine["spec_verify_steps"] > 0
    assert 0 <= engine["spec_accepted_tokens"] <= engine["spec_draft_tokens"]
    assert drafted == [engine["spec_draft_tokens"]], (drafted, engine["spec_draft_tokens"])
    return info
