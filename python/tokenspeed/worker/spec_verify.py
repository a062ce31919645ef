"""Verifying speculative drafts (a chain per request) in one forward pass.

A plan row with `num_draft_tokens = d` feeds the request's last known token followed by `d`
drafts; the model's logits at those `d + 1` positions give, for each position, the
distribution of the next token. Each of the `d + 1` rows is sampled by the ordinary sampler
(greedy, or temperature / top-k / top-p / min-p, logit bias, top logprobs: the same code path
as a plain decode), and the chain is accepted while each draft equals the token sampled at the
position before it; the first mismatch (or the row after the last draft) contributes its own
sampled token. So a step yields 1 to d + 1 tokens.

Greedy: the output is exactly what d + 1 plain decodes would produce. Sampling: the drafts
come from NGRAM, a point mass q = delta(draft), and for a point mass this *is* speculative
rejection sampling: accept the draft with probability min(1, p(draft) / q(draft)) =
p(draft), and on rejection draw from the residual max(0, p - q) normalised = p restricted to
tokens other than the draft. Sampling x ~ p and accepting iff x == draft accepts with
probability p(draft), and when x != draft, x is distributed as p conditioned on x != draft,
the residual. Every emitted token is therefore distributed as p at its position given the
tokens before it: the output distribution is unchanged (tests/test_spec_verify.py checks it
on a tiny vocabulary). Draft heads with a non-degenerate q (EAGLE) will need the general form.

Benchmarks only: `TOKENSPEED_SIMULATE_ACCEPT_LEN=a` (read at worker start; SGLang's
`SGLANG_SIMULATE_ACC_LEN`) accepts drafts as if `a` tokens per verify step (the model's own
token included) were right on average, whatever the model says, so the cost of drafting and
verifying is measured on dummy weights, whose drafts are never right. The accepted drafts are
emitted as they are, so the KV, the radix cache and the counts are what a run with that
acceptance has; the text is junk. A request with fewer drafts than `a - 1` accepts all of them.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

import numpy as np

from tokenspeed.worker.plan import StepPlan

logger = logging.getLogger(__name__)
SIMULATE_ENV = "TOKENSPEED_SIMULATE_ACCEPT_LEN"


class SimulatedAcceptance:
    """How many drafts a verify step accepts when simulating acceptance length `mean` (>= 1,
    the model's own token included): floor(mean - 1) or one more, at random (seeded), so the
    average is `mean - 1` wherever a request has that many drafts."""

    def __init__(self, mean: float, seed: int = 0) -> None:
        if not mean >= 1.0:
            raise ValueError(f"{SIMULATE_ENV}={mean}: an acceptance length is at least 1")
        self.base, self.frac = int(mean - 1), (mean - 1) % 1
        self.rng = np.random.default_rng(seed)

    def drafts_accepted(self, available: int) -> int:
        return min(available, self.base + int(self.rng.random() < self.frac))

    @staticmethod
    def from_env() -> SimulatedAcceptance | None:
        text = os.environ.get(SIMULATE_ENV)
        if not text:
            return None
        logger.warning("%s=%s: verify steps accept drafts by simulation, not by the model "
                       "(a benchmark mode: the output is junk)", SIMULATE_ENV, text)
        return SimulatedAcceptance(float(text))


SIMULATED = SimulatedAcceptance.from_env()


@dataclass
class Drafts:
    """The sampled requests of a step that carries drafts, in plan order."""

    rows: np.ndarray  # [R] int64: sampled rows per request (1 + its drafts)
    drafts: list[np.ndarray]  # per request, its draft token ids (may be empty)
    simulated: SimulatedAcceptance | None = field(default_factory=lambda: SIMULATED)

    @staticmethod
    def of(plan: StepPlan) -> Drafts | None:
        """The plan's drafts, or None when it carries none (a plain step)."""
        if not len(plan.sched_slot) or not plan.sched_num_draft_tokens.any():
            return None
        sample = plan.sched_sample.astype(bool)
        d = plan.sched_num_draft_tokens.astype(np.int64)
        ends = np.cumsum(plan.sched_tokens_len.astype(np.int64))
        drafts = [np.array(plan.sched_tokens[e - n:e], np.int64) if n else np.zeros(0, np.int64)
                  for e, n, s in zip(ends.tolist(), d.tolist(), sample.tolist()) if s]
        return Drafts(rows=(d[sample] + 1), drafts=drafts)

    def logit_rows(self, query_start: np.ndarray, sample: np.ndarray) -> np.ndarray:
        """Indices of the hidden states to compute logits for: each sampled request's last
        `1 + drafts` input positions."""
        ends = query_start[1:][sample]
        return np.concatenate([np.arange(e - n, e) for e, n in zip(ends.tolist(),
                                                                    self.rows.tolist())])

    def accept(self, sampled: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """From the tokens sampled at every row: (indices of the rows kept, in order; tokens
        kept per request; the rows' tokens). A request keeps its drafts up to the first one that
        differs from the token sampled before it, then that row's own token. The rows' tokens
        are `sampled`, except when simulating: a copy with the accepted drafts written in."""
        keep, counts, off = [], [], 0
        if self.simulated is not None:
            sampled = np.array(sampled, copy=True)
        for n, d in zip(self.rows.tolist(), self.drafts):
            t = sampled[off:off + n]
            if self.simulated is not None:
                m = self.simulated.drafts_accepted(len(d))
                t[:m] = d[:m]
            else:
                m = 0
                while m < len(d) and int(d[m]) == int(t[m]):
                    m += 1
            keep.extend(range(off, off + m + 1))
            counts.append(m + 1)
            off += n
        return np.asarray(keep, np.int64), np.asarray(counts, np.int64), sampled
