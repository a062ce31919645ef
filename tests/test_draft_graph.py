"""Draft-head graphs after pure verify steps (worker/draft_graph.py), on the CPU: their static
inputs' padding, and the graph's body (run eagerly, no capture here; its attention through the
Triton interpreter) giving, step by step, exactly the drafts of the eager drafter over the same
rows (and the reference's, tests/test_eagle3.py), at batch 1 and 3 in a graph of 4 requests,
with drafts rejected and all accepted, and with drafting paused (the pass alone) and resumed. The captured graphs are checked on a GPU by
tests/test_gpu_spec.py."""

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

from tokenspeed.worker.draft_chain import DraftSpec
from tokenspeed.worker.draft_graph import DraftGraphRunner, draft_graph_bytes, draft_graphs_for
from tokenspeed.worker.model_runner import ModelRunner
from tokenspeed.worker.plan import StepPlan
from tokenspeed.worker.verify_graph import verify_graphs_for


def _needs_subprocess() -> bool:
    return _PREIMPORTED and not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"


def _runner(head: object, target: str) -> tuple[ModelRunner, DraftGraphRunner]:
    runner = ModelRunner(target, page_size=4, max_slots=4, max_context_len=64,
                         attention_backend="triton", draft=DraftSpec("EAGLE3", str(head), STEPS))
    runner.cuda_graph_max_bs = 4  # no graphs on the CPU: the bodies run uncaptured
    runner.verify_graphs = verify_graphs_for(runner, runner.drafter.head.capture_width, STEPS)
    graphs = draft_graphs_for(runner, runner.verify_graphs)
    assert graphs is not None
    runner.drafter.graphs = graphs
    return runner, graphs


def test_the_memory_estimate_grows_with_the_batch() -> None:
    one = draft_graph_bytes(8, 3, 4096, 3 * 4096, 128256, 2, 520)
    assert one > 8 * 128256 * 2 and draft_graph_bytes(16, 3, 4096, 3 * 4096, 128256, 2, 520) > one


def test_padding_requests_write_nothing_and_keep_to_their_scratch(
        target_and_head: tuple) -> None:  # noqa: F811
    if _needs_subprocess():
        return  # the body test below runs it in its subprocess
    runner, graphs = _runner(target_and_head[1], target_and_head[0])
    flat = graphs.pack(4, None, None)
    graphs.inputs.copy_(torch.from_numpy(flat))
    tokens, chain = graphs._view("tokens"), graphs._view("chain")
    copies, table = graphs._view("copies"), graphs._view("table")
    assert (tokens[2] == -1).all() and (chain[1] == -1).all()  # no K/V written
    assert chain[0, :, 0].tolist() == list(range(1, STEPS))  # drafts after position 0
    scratch = runner.kv_cache.num_pages + graphs.per * torch.arange(4)
    assert (copies[0] == scratch).all() and (copies[1] == scratch).all()  # a page onto itself
    assert (table[2].view(4, graphs.per)[:, 0] == scratch).all()


def test_the_draft_graph_body_drafts_as_the_eager_drafter(target_and_head: tuple,  # noqa: F811
                                                          sharp_head: object) -> None:  # noqa: F811
    """Prompts eagerly, then pure verify steps, each drafted through the draft graph's body
    (padded to 4 requests) and, over the same rows, through the eager drafter: the same drafts,
    the reference's; tokens the target's greedy ones."""
    if _needs_subprocess():
        env = dict(os.environ, TRITON_INTERPRET="1")
        res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                              f"{__file__}"], check=False, env=env, capture_output=True, text=True,
                             timeout=600)
        assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
        return
    target, head = target_and_head[0], sharp_head
    runner, graphs = _runner(head, target)
    drafter, ran = runner.drafter, []
    body, run = graphs._run, graphs.run
    graphs._run = lambda bs, chain=True: (  # type: ignore[method-assign]
        ran.append(bs if chain else -bs), body(bs, chain))[1]

    def run_and_compare(rows, chain):  # type: ignore[no-untyped-def]
        got = run(rows, chain)
        if not len(chain.rows):  # drafting paused: the pass alone, no drafts
            assert got.shape == (0, STEPS)
            return got
        d = drafter._upload(rows, chain)  # the eager drafter over the same rows
        outs = drafter._verified(rows, d, graphs.aux)
        want = drafter._chain(chain, d, outs[d["last_row"]]).cpu().numpy()
        assert np.array_equal(got, want), (got, want)
        return got

    graphs.run = run_and_compare  # type: ignore[method-assign]
    prompts = {s: [(31 * i + 17 * s) % 290 + 3 for i in range(n)] for s, n in ((0, 5), (1, 9), (2, 14))}
    b = BatchDrafting(runner, prompts, STEPS, lambda seq: hf_reference(target, head, seq))
    b.step(StepPlan.build(**b.admission(), scheduled=[(s, 0, p, True) for s, p in prompts.items()]),
           {0, 1, 2})
    assert ran == []  # prompts: eager
    b.step(StepPlan.build(scheduled=[b.verify(0)]), {0})  # batch 1, the head's drafts
    assert ran == [1]
    right = hf_greedy(target, b.seqs[1], STEPS + 1)
    b.step(StepPlan.build(scheduled=[b.verify(2), b.verify(1, right[:STEPS]), b.verify(0)]), {0, 1, 2})
    assert b.seqs[1][-(STEPS + 1):] == right  # all accepted
    assert ran == [1, 4]
    # Speculation paused (plain steps, the pass alone: graphs of -4 here), then resumed.
    for _ in range(2):
        b.step(StepPlan.build(scheduled=[b.plain(s) for s in (1, 0, 2)]), {0, 1, 2}, paused={0, 1, 2})
    assert ran == [1, 4, -4, -4]
    b.step(StepPlan.build(scheduled=[b.plain(s, paused=False) for s in (2, 0, 1)]), {0, 1, 2})
    b.step(StepPlan.build(scheduled=[b.verify(s) for s in (0, 1, 2)]), {0, 1, 2})
    assert ran == [1, 4, -4, -4, 4, 4]
    for slot, seq in b.seqs.items():  # greedy tokens: the target's own
        p = prompts[slot]
        assert seq[len(p):] == hf_greedy(target, p, len(seq) - len(p)), slot
