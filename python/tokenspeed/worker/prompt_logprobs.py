"""Prompt logprobs (vLLM's `prompt_logprobs`): each scored prompt token's logprob, top-k and rank,
computed from the hidden states of the step that fed the token, chunk by chunk."""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch

if TYPE_CHECKING:
    from tokenspeed.worker.plan import StepPlan
    from tokenspeed.worker.sampler import Sampler

PROMPT_LOGPROB_ROWS = 512  # prompt positions scored at once (bounds the [rows, vocab] buffer)


class PromptLogprobs(NamedTuple):
    """One slot's prompt logprobs from one step: per scored prompt token, its logprob, the
    top-k (ids, logprobs) and its 1-based rank in the distribution."""

    logprobs: np.ndarray  # [m] float32
    top_ids: np.ndarray  # [m, k] int64
    top_logprobs: np.ndarray  # [m, k] float32
    ranks: np.ndarray  # [m] int64


class PromptScorer:
    """Scores the prompt tokens of the requests that asked, step by step. Token t is scored by
    the log-softmax at position t - 1: across a chunk boundary that is the previous chunk's last
    position, which it keeps per slot (the carry) until the next chunk."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._carry: dict[int, torch.Tensor] = {}
        self._out: dict[int, PromptLogprobs] = {}

    def drop(self, slot: int) -> None:
        """A slot finished or was reassigned: forget its carry."""
        self._carry.pop(slot, None)

    def take(self) -> dict[int, PromptLogprobs]:
        """This step's results per slot (the step's event carries them)."""
        out, self._out = self._out, {}
        return out

    def score(self, plan: StepPlan, hidden: torch.Tensor, query_start: np.ndarray,
              wanted: list[int], model: torch.nn.Module, sampler: Sampler) -> None:
        """Score the input tokens of the plan's requests `wanted` (indices into the plan) from
        the step's hidden states."""
        ids = plan.sched_tokens.astype(np.int64)
        for i in wanted:
            slot = int(plan.sched_slot[i])
            k = sampler.slots[slot].top_logprobs
            lo, hi = int(query_start[i]), int(query_start[i + 1])
            lps, tops, top_lps, ranks = [], [], [], []
            carry = self._carry.pop(slot, None)
            prev = carry[None, :] if carry is not None else None
            for a in range(lo, hi, PROMPT_LOGPROB_ROWS):
                b = min(hi, a + PROMPT_LOGPROB_ROWS)
                rows = torch.log_softmax(
                    model.compute_logits(hidden[a:b]).float(), dim=-1)  # type: ignore[operator]
                if prev is None:  # the prompt's first token: nothing scores it
                    scorers, targets = rows[:-1], ids[a + 1:b]
                else:
                    scorers, targets = torch.cat([prev, rows[:-1]]), ids[a:b]
                tgt = torch.from_numpy(targets).to(self.device)
                own = scorers.gather(1, tgt[:, None])
                lps.append(own.squeeze(1))
                # vLLM's rank, also for a token outside the top-k: 1 + how many score higher.
                ranks.append((scorers > own).sum(dim=1) + 1)
                if k:
                    v, t = scorers.topk(min(k, scorers.shape[-1]), dim=-1)
                    top_lps.append(v)
                    tops.append(t)
                prev = rows[-1:]
            if plan.sched_sample[i]:
                sampler.prompt_logprobs_done(slot)
            elif prev is not None:
                self._carry[slot] = prev[0]
            m = sum(len(x) for x in lps)
            self._out[slot] = PromptLogprobs(
                torch.cat(lps).cpu().numpy() if lps else np.zeros(0, np.float32),
                torch.cat(tops).cpu().numpy() if tops else np.zeros((m, 0), np.int64),
                torch.cat(top_lps).cpu().numpy() if top_lps else np.zeros((m, 0), np.float32),
                torch.cat(ranks).cpu().numpy() if ranks else np.zeros(0, np.int64))
