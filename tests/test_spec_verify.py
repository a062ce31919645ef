"""Verifying speculative drafts (worker/spec_verify.py): which rows are kept, and that the
output distribution with drafts is the model's own (a statistical test on a tiny vocabulary,
through the real Sampler), greedy and sampled."""

from __future__ import annotations

import numpy as np
import torch

from tokenspeed.worker.plan import NEUTRAL_SAMPLING, StepPlan
from tokenspeed.worker.sampler import Sampler
from tokenspeed.worker.spec_verify import Drafts, SimulatedAcceptance


def test_drafts_of_a_plan_and_their_logit_rows() -> None:
    plan = StepPlan.build(scheduled=[(0, 10, [7, 1, 2, 3], True, 3), (1, 0, [5, 6], False),
                                     (2, 4, [9], True), (3, 8, [4, 8], True, 1)])
    d = Drafts.of(plan)
    assert d is not None
    assert d.rows.tolist() == [4, 1, 2]
    assert [x.tolist() for x in d.drafts] == [[1, 2, 3], [], [8]]
    query_start = np.array([0, 4, 6, 7, 9])
    sample = plan.sched_sample.astype(bool)
    assert d.logit_rows(query_start, sample).tolist() == [0, 1, 2, 3, 6, 7, 8]
    assert Drafts.of(StepPlan.build(scheduled=[(0, 3, [1], True)])) is None


def test_accept_keeps_drafts_up_to_the_first_mismatch_then_the_models_token() -> None:
    d = Drafts(rows=np.array([4, 1, 2, 3]),
               drafts=[np.array([1, 2, 3]), np.array([], np.int64), np.array([8]), np.array([5, 6])])
    sampled = np.array([1, 2, 9, 4,  # drafts 1, 2 accepted, 3 rejected: the model said 9
                        7,  # no drafts: one token
                        8, 3,  # the draft accepted, then the bonus token
                        0, 6, 6])  # the first draft rejected
    keep, counts, tokens = d.accept(sampled)
    assert counts.tolist() == [3, 1, 2, 1]
    assert tokens is sampled and sampled[keep].tolist() == [1, 2, 9, 7, 8, 3, 0]


def test_simulated_acceptance_emits_drafts_at_the_asked_average_length() -> None:
    """TOKENSPEED_SIMULATE_ACCEPT_LEN=2.5 with 3 drafts a request: 1 or 2 drafts accepted
    (2.5 tokens a step on average), whatever the model sampled, and the accepted drafts are the
    tokens emitted; a request with one draft accepts it; a plain decode row stays one token."""
    steps = 4000
    d = Drafts(rows=np.array([4, 2, 1] * steps),
               drafts=[np.array([11, 12, 13]), np.array([21]), np.zeros(0, np.int64)] * steps,
               simulated=SimulatedAcceptance(2.5))
    sampled = np.tile(np.array([90, 91, 92, 93, 94, 95, 96]), steps)
    keep, counts, tokens = d.accept(sampled)
    three, one, plain = counts[0::3], counts[1::3], counts[2::3]
    assert set(three.tolist()) == {2, 3} and abs(three.mean() - 2.5) < 0.05
    assert (one == 2).all() and (plain == 1).all()
    c = int(counts[0])
    first = [11, 12, 13][:c - 1] + [90 + c - 1]  # the drafts, then the model's token after them
    assert tokens[keep][:c + 3].tolist() == first + [21, 95, 96]
    assert sampled[0] == 90, "the model's tokens are not overwritten"


def _outputs(logits: list[torch.Tensor], draft: int, trials: int, **params: float) -> list[list[int]]:
    """What `trials` verifications of one draft produce: rows at two positions (the draft's
    and the bonus), sampled by the real Sampler, then accepted."""
    s = Sampler("cpu", seed=7)
    s.add(0, {**NEUTRAL_SAMPLING, **params})
    batch = torch.stack([logits[0], logits[1]] * trials)
    tokens = s.sample([0] * (2 * trials), batch).tokens.numpy()
    d = Drafts(rows=np.full(trials, 2), drafts=[np.array([draft])] * trials)
    keep, counts, _ = d.accept(tokens)
    out, off = [], 0
    for c in counts.tolist():
        out.append(tokens[keep[off:off + c]].tolist())
        off += c
    return out


def _close(observed: np.ndarray, expected: np.ndarray, n: int) -> None:
    """Each frequency within 5 standard errors of its probability."""
    se = np.sqrt(expected * (1 - expected) / n) + 1e-9
    assert (np.abs(observed - expected) <= 5 * se + 1e-3).all(), (observed, expected)


def test_rejection_sampling_leaves_the_distribution_unchanged() -> None:
    vocab = 5
    p0 = torch.tensor([0.1, 0.4, 0.2, 0.25, 0.05])  # the draft's position
    p1 = torch.tensor([0.3, 0.05, 0.05, 0.2, 0.4])  # the position after an accepted draft
    logits = [p0.log(), p1.log()]
    trials = 40_000
    for draft in (1, 4):  # a likely draft and an unlikely one
        outs = _outputs(logits, draft, trials, temperature=1.0)
        first = np.bincount([o[0] for o in outs], minlength=vocab) / trials
        _close(first, p0.numpy(), trials)
        # Given the draft was accepted, the next token follows p1.
        after = [o[1] for o in outs if o[0] == draft]
        assert all(len(o) == 2 for o in outs if o[0] == draft)
        assert all(len(o) == 1 for o in outs if o[0] != draft)
        _close(np.bincount(after, minlength=vocab) / len(after), p1.numpy(), len(after))
    # With top-k the distribution is the truncated one, draft or not.
    outs = _outputs(logits, 3, trials, temperature=1.0, top_k=2)
    first = np.bincount([o[0] for o in outs], minlength=vocab) / trials
    _close(first, np.array([0, 0.4, 0, 0.25, 0]) / 0.65, trials)


def test_greedy_verification_is_argmax_chains() -> None:
    p0 = torch.tensor([0.1, 0.4, 0.2, 0.25, 0.05])
    p1 = torch.tensor([0.3, 0.05, 0.05, 0.2, 0.4])
    assert _outputs([p0.log(), p1.log()], 1, 3, temperature=0.0) == [[1, 4]] * 3
    assert _outputs([p0.log(), p1.log()], 2, 3, temperature=0.0) == [[1]] * 3
