"""CUDA graphs for the target's steps under a draft head (EAGLE-3, NEXTN: worker/draft_chain.py).

Such a runner's steps are mostly pure verify steps: every scheduled request samples and feeds
exactly its last sampled token plus its drafts (1 + d tokens, d <= k, the chain's length; d = 0
is a plain decode), and the step needs the hidden state at *every* position (the logits of each
verified row) and the target's captured hidden states at every position (the head's input,
`model.model.captured`). Eagerly, the host launch time of the target's forward dominates the
step (28 ms of an 8B model on an H100 at batch 1, against 6 ms for a decode graph).

A pure verify step is an extend step (several new tokens per request after a cached prefix), so
`VerifyGraphRunner` is an `ExtendGraphRunner` (cuda_graph.py: tiled extend attention whose tile
table is built on the device, padding tokens writing no K/V) with one graph per batch size B of
`capture_sizes(max_bs)`, of B * (k + 1) tokens and B request rows, whose static outputs are the
hidden states and the captured states of every token. A step of b requests and n <= b * (k + 1)
tokens takes the smallest graph with B >= b. The LM head runs after the replay on the verified
rows (eagerly: one launch, as for the extend graphs). Steps that are not pure verify (prompt
chunks, a new request's prompt of several tokens, prompt logprobs) run eagerly, as before.
Decode and extend graphs are not captured beside a draft head: they keep no captured states.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from tokenspeed.layers.attention import AttentionBackend
from tokenspeed.layers.kv_cache import PagedKVCache
from tokenspeed.worker.cuda_graph import ExtendGraphRunner, capture_sizes

if TYPE_CHECKING:
    from tokenspeed.worker.plan import StepPlan


def verify_shapes(max_bs: int, num_steps: int) -> list[tuple[int, int]]:
    """(tokens, request rows) of the verify graphs: B * (k + 1) tokens for B requests."""
    return [(b * (num_steps + 1), b) for b in capture_sizes(max_bs)]


def is_pure_verify(plan: StepPlan) -> bool:
    """Every scheduled request samples and feeds its last token plus its drafts, nothing more
    (no prompt chunk; one token and no drafts is a plain decode)."""
    n = plan.sched_tokens_len
    return bool(len(n)) and bool(plan.sched_sample.all()) and bool(
        np.array_equal(n.astype(np.int64), plan.sched_num_draft_tokens.astype(np.int64) + 1))


def verify_graph_bytes(max_bs: int, num_steps: int, hidden_size: int, capture_width: int,
                       itemsize: int, activations: int, profile_tokens: int) -> int:
    """Bytes the verify graphs need beyond the model: their pool (the activations of the
    largest, scaled from a profiled forward of `profile_tokens` tokens) and the static buffers
    (per token: inputs, hidden state, captured states)."""
    t = max_bs * (num_steps + 1)
    pool = activations * t // max(profile_tokens, 1)
    buffers = t * (4 * 8 + (hidden_size + capture_width) * itemsize) + 5 * (max_bs + 1) * 8
    return pool + buffers


class VerifyGraphRunner(ExtendGraphRunner):
    """Verify graphs (see the module docstring). Before capture (CPU tests) `run` runs the
    graph's body eagerly, with its padding and tiled attention."""

    kind = "verify"

    def __init__(self, model: torch.nn.Module, kv_cache: PagedKVCache, backend: AttentionBackend,
                 max_bs: int, num_steps: int, capture_width: int, hidden_size: int,
                 device: torch.device, last_tokens: torch.Tensor, dtype: torch.dtype,
                 head_dim: int) -> None:
        shapes = verify_shapes(max_bs, num_steps)
        super().__init__(model, kv_cache, backend, [t for t, _ in shapes], max_bs, hidden_size,
                         device, last_tokens, dtype, head_dim, shapes=shapes)
        t = self.sizes[-1]
        self.hidden = torch.zeros((t, hidden_size), dtype=dtype, device=device)
        self.aux = torch.zeros((t, capture_width), dtype=dtype, device=device)

    def _keep(self, hidden: torch.Tensor, num_tokens: int, last: torch.Tensor) -> None:
        """Every token's hidden state and captured states (the head reads all verified rows)."""
        self.hidden[:num_tokens].copy_(hidden)
        self.aux[:num_tokens].copy_(self.model.model.captured)  # type: ignore[union-attr]

    def run_step(self, plan: StepPlan, positions: np.ndarray, out_cache_loc: np.ndarray,
                 query_start: np.ndarray, drafter: Any) -> torch.Tensor | None:
        """Replay for `plan` if it is a pure verify step a graph holds: the hidden states
        [n, H] of its n tokens, and their captured states [n, capture_width] as the `drafter`'s
        `aux` (views of the static buffers, valid until the next replay); None: the step runs
        eagerly."""
        n, b = int(query_start[-1]), len(plan.sched_slot)
        if not is_pure_verify(plan) or not self.can_run(n, b):
            return None
        self._replay(plan.sched_tokens.astype(np.int64), positions, out_cache_loc,
                     plan.sched_slot.astype(np.int64), plan.sched_start_pos.astype(np.int64),
                     query_start)
        drafter.aux = self.aux[:n]
        return self.hidden[:n]


def verify_graphs_for(runner: Any, capture_width: int, num_steps: int) -> VerifyGraphRunner:
    """The verify graphs of a ModelRunner with a draft head (uncaptured), up to its
    `cuda_graph_max_bs` requests."""
    c = runner.config
    return VerifyGraphRunner(runner.model, runner.kv_cache, runner.backend,
                             runner.cuda_graph_max_bs, num_steps, capture_width, c.hidden_size,
                             runner.device, runner.last_tokens, runner.dtype, c.head_dim)
