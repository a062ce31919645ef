"""Verify graphs for a draft head's steps (worker/verify_graph.py), on the CPU: which steps
take one, their sizes and padding, and the graph's body (run eagerly, no capture here; its
tiled attention through the Triton interpreter) giving the drafts and tokens of a plain torch
reference over HF transformers (tests/test_eagle3.py's) at batch 1 and 3, with drafts rejected
and accepted. The captured graphs are checked on a GPU by tests/test_gpu_spec.py."""

from __future__ import annotations

import os
import subprocess
import sys

import torch

_PREIMPORTED = "tokenspeed_kernels" in sys.modules
if not torch.cuda.is_available():  # the Triton kernels through the interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np
from spec_checks import BatchDrafting
from test_eagle3 import STEPS, hf_greedy, hf_reference, sharp_head, target_and_head  # noqa: F401

from tokenspeed.worker.cuda_graph import pack_extend_step
from tokenspeed.worker.draft_chain import DraftSpec
from tokenspeed.worker.model_runner import ModelRunner
from tokenspeed.worker.plan import StepPlan
from tokenspeed.worker.verify_graph import (
    is_pure_verify,
    verify_graph_bytes,
    verify_graphs_for,
    verify_shapes,
)


def test_one_graph_per_batch_size_of_k_plus_one_tokens_a_request() -> None:
    assert verify_shapes(8, 3) == [(4, 1), (8, 2), (16, 4), (32, 8)]
    assert verify_shapes(20, 1) == [(2, 1), (4, 2), (8, 4), (16, 8), (32, 16), (40, 20)]


def test_only_pure_verify_steps_take_a_graph() -> None:
    def plan(*rows: tuple) -> StepPlan:
        return StepPlan.build(scheduled=list(rows))

    assert is_pure_verify(plan((0, 9, [5, 6, 7, 8], True, 3), (1, 4, [5, 6], True, 1)))
    assert is_pure_verify(plan((0, 9, [5], True), (1, 4, [5, 6, 7, 8], True, 3)))  # a decode beside
    assert not is_pure_verify(plan((0, 9, [5, 6, 7, 8], True, 3), (1, 0, [5, 6, 7], True)))  # a prompt
    assert not is_pure_verify(plan((0, 9, [5, 6, 7, 8], True, 3), (1, 0, [5], False)))  # a chunk
    assert not is_pure_verify(plan())


def test_padding_tokens_write_no_kv_and_absent_rows_have_no_tokens() -> None:
    # Two requests of 4 and 2 tokens in the graph of 16 tokens and 4 rows.
    qs = np.array([0, 4, 6])
    tokens, requests = pack_extend_step((16, 4), np.arange(10, 16), np.array([9, 10, 11, 12, 4, 5]),
                                        np.array([90, 91, 92, 93, 40, 41]), np.array([3, 1]),
                                        np.array([9, 4]), qs)
    assert tokens.shape == (4, 16) and requests.shape == (5, 5)
    assert tokens[2, :6].tolist() == [90, 91, 92, 93, 40, 41]
    assert (tokens[2, 6:] == -1).all()  # padding tokens: no K/V written
    assert tokens[3, :6].tolist() == [3, 3, 3, 3, 1, 1]
    assert requests[1].tolist() == [0, 4, 6, 6, 6]  # absent rows start and end at the last token
    assert requests[3, :2].tolist() == [13, 6] and requests[4, :2].tolist() == [3, 5]


def test_the_memory_estimate_covers_the_largest_graph() -> None:
    one = verify_graph_bytes(8, 3, 4096, 3 * 4096, 2, activations=1 << 30, profile_tokens=8192)
    two = verify_graph_bytes(16, 3, 4096, 3 * 4096, 2, activations=1 << 30, profile_tokens=8192)
    assert one >= 32 * 4 * 4096 * 2 + (1 << 30) * 32 // 8192  # buffers, pool of 32 tokens
    assert two > one


def _needs_subprocess() -> bool:
    return _PREIMPORTED and not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"


def test_the_verify_graph_body_drafts_as_the_reference(target_and_head: tuple, sharp_head: object) -> None:  # noqa: F811
    """Prompts eagerly, then pure verify steps through the graph's body (padded to 4 rows,
    B * (k + 1) tokens): drafts rejected, all accepted, a plain decode beside verifies; each
    request's drafts and tokens are the reference's."""
    if _needs_subprocess():
        env = dict(os.environ, TRITON_INTERPRET="1")
        res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                              f"{__file__}::test_the_verify_graph_body_drafts_as_the_reference"],
                             check=False, env=env, capture_output=True, text=True, timeout=600)
        assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
        return
    target, head = target_and_head[0], sharp_head
    runner = ModelRunner(target, page_size=4, max_slots=4, max_context_len=64,
                         attention_backend="triton", draft=DraftSpec("EAGLE3", str(head), STEPS))
    runner.cuda_graph_max_bs = 4  # no graphs on the CPU: the body runs uncaptured
    runner.verify_graphs = graphs = verify_graphs_for(runner, runner.drafter.head.capture_width, STEPS)
    ran: list[tuple[int, int]] = []
    body = graphs._run
    graphs._run = lambda shape: (ran.append(shape), body(shape))[1]  # type: ignore[method-assign]
    prompts = {s: [(31 * i + 17 * s) % 290 + 3 for i in range(n)] for s, n in ((0, 5), (1, 9), (2, 14))}
    b = BatchDrafting(runner, prompts, STEPS, lambda seq: hf_reference(target, head, seq))
    b.step(StepPlan.build(**b.admission(), scheduled=[(s, 0, p, True) for s, p in prompts.items()]),
           {0, 1, 2})
    assert ran == []  # prompts: eager
    b.step(StepPlan.build(scheduled=[b.verify(0)]), {0})  # batch 1, the head's drafts
    assert ran == [(4, 1)]
    right = hf_greedy(target, b.seqs[1], STEPS + 1)
    b.step(StepPlan.build(scheduled=[b.verify(2), b.verify(1, right[:STEPS]), b.verify(0)]), {0, 1, 2})
    assert b.seqs[1][-(STEPS + 1):] == right  # all accepted
    s2 = b.seqs[2]
    b.step(StepPlan.build(scheduled=[b.verify(1), (2, len(s2) - 1, [s2[-1]], True), b.verify(0)]),
           {0, 1, 2})
    assert ran == [(4, 1), (16, 4), (16, 4)]
    for slot, seq in b.seqs.items():  # greedy tokens: the target's own
        p = prompts[slot]
        assert seq[len(p):] == hf_greedy(target, p, len(seq) - len(p)), slot
