"""GPU: speculative decoding's steps under CUDA graphs (worker/verify_graph.py, issue 32). Greedy
tokens with a draft head and graphs equal those of the same head run eagerly and those of no
speculation (fp32 small configs, exact), at batch 1 and 5 (padded to a graph of 8 rows), with
the head's own drafts (mostly rejected) and with right drafts (the reference's continuation: all
accepted) in turn; the verify graphs replay, and so do the head's draft graphs
(worker/draft_graph.py) after each verify step, their drafts the eager head's. EAGLE-3 over a
Llama target; NEXTN over a tiny DeepSeek-V3 (MLA: extend graphs do not run MLA, so its verify
steps and its drafting stay eager, which the test states). Small on purpose (about a minute): failures print the first difference.

    pytest -q -m gpu tests/test_gpu_spec.py
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from eagle3_head import make_head
from test_gpu import SMALL_FP32, write_config

from tokenspeed.worker.draft_chain import DraftSpec
from tokenspeed.worker.model_runner import ModelRunner
from tokenspeed.worker.plan import StepPlan

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

STEPS = 3  # drafts per step
NEW = 24  # tokens generated per request
PAGE, SLOT_PAGES = 16, 16  # 256 positions a slot
BATCHES = {"batch1": [29], "batch5": [5, 17, 33, 64, 100]}
DEVICE = "cuda"  # a module constant so the helpers can be smoke-tested on the CPU


def make_runner(path: str, draft: DraftSpec | None, graphs: bool, **kw: Any) -> ModelRunner:
    return ModelRunner(path, dtype="float32", device=DEVICE, page_size=PAGE, max_slots=8,
                       num_pages=8 * SLOT_PAGES + 8, max_context_len=SLOT_PAGES * PAGE, seed=0,
                       disable_cuda_graph=not graphs, draft=draft, **kw)


def prompts_for(vocab: int, lens: list[int]) -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [rng.integers(10, vocab - 10, size=n).tolist() for n in lens]


def admit(prompts: list[list[int]]) -> StepPlan:
    return StepPlan.build(new=[{"slot": s, "temperature": 0.0} for s in range(len(prompts))],
                          page_tables=[(s, 0, range(1 + SLOT_PAGES * s, 1 + SLOT_PAGES * (s + 1)))
                                       for s in range(len(prompts))],
                          scheduled=[(s, 0, p, True) for s, p in enumerate(prompts)])


def events(out: Any) -> dict[int, tuple[list[int], list[int]]]:
    """Per slot: (tokens, drafts) of a step's output."""
    ends = np.cumsum(out.counts)
    res = {}
    for i, slot in enumerate(np.asarray(out.slots).tolist()):
        toks = np.asarray(out.tokens[ends[i] - out.counts[i]:ends[i]]).tolist()
        drafts = [] if out.draft_tokens is None else out.draft_tokens[i].tolist()
        res[slot] = (toks, drafts)
    return res


def plain_greedy(runner: ModelRunner, prompts: list[list[int]], n: int) -> list[list[int]]:
    """No speculation: a prefill step, then one decode step per token."""
    gen: list[list[int]] = [[] for _ in prompts]
    seqs = [list(p) for p in prompts]
    out = runner.launch(admit(prompts)).wait()
    for _ in range(n):
        for slot, (toks, _) in events(out).items():
            gen[slot] += toks
            seqs[slot] += toks
        out = runner.launch(StepPlan.build(scheduled=[(s, len(q) - 1, [q[-1]], True)
                                                      for s, q in enumerate(seqs)])).wait()
    return gen


def spec_greedy(runner: ModelRunner, prompts: list[list[int]], n: int,
                right: list[list[int]]) -> tuple[list[list[int]], list[list[list[int]]]]:
    """With the runner's draft head: every step verifies each request's drafts, the head's
    own on odd steps and the next STEPS tokens of `right` (its reference) on even ones.
    Returns the tokens per request and the drafts the head proposed per step."""
    gen: list[list[int]] = [[] for _ in prompts]
    seqs = [list(p) for p in prompts]
    drafts: dict[int, list[int]] = {}
    trace = []
    out = runner.launch(admit(prompts)).wait()
    step = 0
    while True:
        got = events(out)
        trace.append([got[s][1] for s in sorted(got)])
        for slot, (toks, d) in got.items():
            gen[slot] += toks
            seqs[slot] += toks
            drafts[slot] = d
        live = [s for s in range(len(prompts)) if len(gen[s]) < n]
        if not live:
            return [g[:n] for g in gen], trace
        rows = []
        for s in live:
            d = right[s][len(gen[s]):len(gen[s]) + STEPS] if step % 2 == 0 else drafts[s]
            rows.append((s, len(seqs[s]) - 1, [seqs[s][-1], *d], True, len(d)))
        out = runner.launch(StepPlan.build(step_id=step + 1, scheduled=rows)).wait()
        step += 1


def first_difference(name: str, want: list[list[int]], got: list[list[int]]) -> str:
    for slot, (w, g) in enumerate(zip(want, got)):
        if w != g:
            i = next((j for j, (a, b) in enumerate(zip(w, g)) if a != b), min(len(w), len(g)))
            return f"{name}: slot {slot} differs from token {i}: want {w[i:i + 8]}, got {g[i:i + 8]}"
    return ""


def check_exact(path: str, draft: DraftSpec, prompts: list[list[int]], graphs_expected: bool,
                **kw: Any) -> None:
    plain = make_runner(path, None, graphs=True, **kw)
    ref = plain_greedy(plain, prompts, NEW + STEPS + 1)
    del plain
    eager_runner = make_runner(path, draft, graphs=False, **kw)
    assert eager_runner.verify_graphs is None
    eager, eager_drafts = spec_greedy(eager_runner, prompts, NEW, ref)
    del eager_runner
    runner = make_runner(path, draft, graphs=True, **kw)
    vg = runner.verify_graphs
    print(f"{draft.algorithm}: verify graphs {'none' if vg is None else vg.shapes}, "
          f"cuda_graph_max_bs {runner.cuda_graph_max_bs}")
    assert (vg is not None) == graphs_expected
    graphed, graph_drafts = spec_greedy(runner, prompts, NEW, ref)
    want = [r[:NEW] for r in ref]
    problems = [first_difference("spec eager vs no spec", want, eager),
                first_difference("spec + graphs vs no spec", want, graphed)]
    if eager_drafts != graph_drafts:
        i = next(j for j, (a, b) in enumerate(zip(eager_drafts, graph_drafts)) if a != b)
        problems.append(f"drafts differ at step {i}: eager {eager_drafts[i]}, graphs {graph_drafts[i]}")
    assert not [p for p in problems if p], "\n".join(p for p in problems if p)
    if vg is not None:  # every step after the prefill is a pure verify step
        print(f"verify graph replays: {vg.replays} of {len(graph_drafts) - 1} verify steps")
        assert vg.replays == len(graph_drafts) - 1
        dg = runner.drafter.graphs  # and the head drafts after each in its graphs
        assert dg is not None
        print(f"draft graph replays: {dg.replays}, sizes {dg.sizes}")
        assert dg.replays == vg.replays
    else:
        assert runner.drafter.graphs is None


@pytest.fixture(scope="module")
def eagle3_target(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    root = tmp_path_factory.mktemp("spec_gpu")
    cfg = {**SMALL_FP32, "num_hidden_layers": 8}  # the head captures layers 2, 4, 5
    path = write_config(root, "target", cfg)
    head = make_head(root / "head", json.loads(Path(path, "config.json").read_text()),
                     draft_vocab=400)
    return path, str(head)


@pytest.mark.parametrize("batch", list(BATCHES))
def test_eagle3_graphs_give_the_eager_and_plain_tokens(eagle3_target: tuple[str, str],
                                                       batch: str) -> None:
    path, head = eagle3_target
    prompts = prompts_for(SMALL_FP32["vocab_size"], BATCHES[batch])
    check_exact(path, DraftSpec("EAGLE3", head, STEPS), prompts, graphs_expected=True,
                load_format="dummy", attention_backend="triton")


@pytest.mark.parametrize("batch", list(BATCHES))
def test_nextn_graphs_give_the_eager_and_plain_tokens(tmp_path_factory: pytest.TempPathFactory,
                                                      batch: str) -> None:
    try:
        from deepseek_mtp_model import make_mtp_model
    except ImportError as e:  # its HF helpers need test-only packages
        pytest.skip(f"tests/deepseek_mtp_model.py: {e}")
    m = make_mtp_model(tmp_path_factory.mktemp("mtp"))
    vocab = json.loads((m.path / "config.json").read_text())["vocab_size"]
    prompts = prompts_for(vocab, BATCHES[batch])
    check_exact(str(m.path), DraftSpec("NEXTN", None, STEPS), prompts, graphs_expected=False)
