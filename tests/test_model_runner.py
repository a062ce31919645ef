"""ModelRunner.step semantics: plan diffs, output order, prefix sharing, slot reuse, sampling."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tokenspeed.config.derived import default_max_running_requests
from tokenspeed.worker.model_runner import ModelRunner
from tokenspeed.worker.offline_scheduler import OfflineScheduler
from tokenspeed.worker.plan import LAST_SAMPLED, PLAN_DTYPES, StepPlan

U32 = np.uint32


def runner_for(path: str, page_size: int = 4, **kw: object) -> ModelRunner:
    return ModelRunner(path, page_size=page_size, max_slots=8, max_context_len=128, **kw)


def new_requests(slots: list[int], temperature: float = 0.0, seed: int = -1,
                 top_logprobs: int = 0) -> dict[str, np.ndarray]:
    rows = [{"slot": s, "temperature": temperature, "seed": seed, "top_logprobs": top_logprobs}
            for s in slots]
    plan = StepPlan.build(new=rows)
    return {n: getattr(plan, n) for n in PLAN_DTYPES if n.startswith("new_")}

def pages(slot: int, first: int, ids: list[int]) -> dict[str, np.ndarray]:
    return {"pt_slot": np.asarray([slot], U32), "pt_first": np.asarray([first], U32),
            "pt_pages_len": np.asarray([len(ids)], U32), "pt_pages": np.asarray(ids, U32)}


def schedule(reqs: list[tuple[int, int, list[int], int]]) -> dict[str, np.ndarray]:
    """reqs: (slot, start_pos, tokens, sample)."""
    return {"sched_slot": np.asarray([r[0] for r in reqs], U32),
            "sched_tokens_len": np.asarray([len(r[2]) for r in reqs], U32),
            "sched_start_pos": np.asarray([r[1] for r in reqs], U32),
            "sched_sample": np.asarray([r[3] for r in reqs], np.uint8),
            "sched_tokens": np.asarray([t for r in reqs for t in r[2]], U32)}


PREFIX = [(11 * i) % 190 + 5 for i in range(12)]  # three pages of 4
TAIL_A, TAIL_B = [7, 8, 9], [21, 22, 23, 24, 25]


def greedy_from_scratch(path: str, prompt: list[int], n: int) -> tuple[list[int], list[torch.Tensor]]:
    res = OfflineScheduler(runner_for(path)).generate([prompt], n, keep_logits=True)
    return res.tokens[0], res.logits[0]


def decode_steps(runner: ModelRunner, slot: int, pos: int, first_token: int, page_ids: list[int],
                 n: int) -> tuple[list[int], list[torch.Tensor]]:
    """Feed back sampled tokens one at a time; `page_ids` are handed out as pages fill up."""
    tokens, logits, tok = [first_token], [], first_token
    for _ in range(n - 1):
        plan_kw = schedule([(slot, pos, [tok], 1)])
        if pos % runner.page_size == 0:
            plan_kw |= pages(slot, pos // runner.page_size, [page_ids.pop(0)])
        plan = StepPlan.of(**plan_kw)
        lg = runner.forward(plan)
        tok = int(runner.sample(plan, lg).tokens[0])
        tokens.append(tok)
        logits.append(lg[0])
        pos += 1
    return tokens, logits


def test_shared_prefix_pages_give_the_same_tokens_as_recomputing(tiny_llama: str) -> None:
    runner = runner_for(tiny_llama)
    # Request A (slot 0) computes PREFIX + TAIL_A into pages 9, 3, 6, 1.
    plan = StepPlan.of(**new_requests([0]), **pages(0, 0, [9, 3, 6, 1]),
                    **schedule([(0, 0, PREFIX + TAIL_A, 1)]))
    runner.step(plan)
    # A finishes; B (slot 5) reuses A's three prefix pages and only feeds its own tail.
    plan = StepPlan.of(finished_slot=np.asarray([0], U32), **new_requests([5]),
                    **pages(5, 0, [9, 3, 6, 12, 13]), **schedule([(5, 12, TAIL_B, 1)]))
    lg = runner.forward(plan)
    first = int(runner.sample(plan, lg).tokens[0])
    shared_tokens, shared_logits = decode_steps(runner, 5, 17, first, [14, 15], 8)

    ref_tokens, ref_logits = greedy_from_scratch(tiny_llama, PREFIX + TAIL_B, 8)
    assert shared_tokens == ref_tokens
    torch.testing.assert_close(lg[0], ref_logits[0], atol=1e-5, rtol=0)
    for a, b in zip(shared_logits, ref_logits[1:]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def test_prefix_shared_while_the_owner_keeps_decoding(tiny_llama: str) -> None:
    runner = runner_for(tiny_llama, page_size=1)
    prefix_pages = list(range(40, 52))
    runner.step(StepPlan.of(**new_requests([0]), **pages(0, 0, prefix_pages + [60, 61, 62]),
                         **schedule([(0, 0, PREFIX + TAIL_A, 1)])))
    # Same step: A decodes one token while B joins on A's first 12 pages.
    plan = StepPlan.of(**new_requests([1]), pt_slot=np.asarray([0, 1], U32),
                    pt_first=np.asarray([15, 0], U32), pt_pages_len=np.asarray([1, 17], U32),
                    pt_pages=np.asarray([63, *prefix_pages, 70, 71, 72, 73, 74], U32),
                    **schedule([(0, 15, [3], 1), (1, 12, TAIL_B, 1)]))
    out = runner.step(plan)
    ref_tokens, _ = greedy_from_scratch(tiny_llama, PREFIX + TAIL_B, 1)
    assert out.slots.tolist() == [0, 1]
    assert int(out.tokens[1]) == ref_tokens[0]


def test_last_sampled_placeholders_queued_ahead_match_explicit_tokens(tiny_llama: str) -> None:
    """One-step-ahead scheduling: each decode is launched before the previous step's token is
    known (input LAST_SAMPLED), alone and beside another request's prefill chunk."""
    ref_a, _ = greedy_from_scratch(tiny_llama, PREFIX, 6)
    ref_b, _ = greedy_from_scratch(tiny_llama, TAIL_B * 2, 4)
    runner = runner_for(tiny_llama)
    hole = LAST_SAMPLED
    steps = [StepPlan.of(**new_requests([2]), **pages(2, 0, [5, 6, 7, 8]),
                      **schedule([(2, 0, PREFIX, 1)]))]
    steps += [StepPlan.of(**schedule([(2, pos, [hole], 1)])) for pos in (12, 13)]
    # A mixed step: B's first prefill chunk (no sample) beside A's placeholder decode.
    steps.append(StepPlan.of(**new_requests([4]), **pages(4, 0, [0, 1, 2]),
                          **schedule([(4, 0, (TAIL_B * 2)[:6], 0), (2, 14, [hole], 1)])))
    steps.append(StepPlan.of(**schedule([(4, 6, (TAIL_B * 2)[6:], 1), (2, 15, [hole], 1)])))
    steps.append(StepPlan.of(**pages(2, 4, [9]), **schedule([(2, 16, [hole], 1), (4, 10, [hole], 1)])))
    steps.append(StepPlan.of(**schedule([(4, 11, [hole], 1)])))
    pending = [runner.launch(plan) for plan in steps]  # nothing waited for until here
    outs = [p.wait() for p in pending]
    got: dict[int, list[int]] = {2: [], 4: []}
    for out in outs:
        for slot, tok in zip(out.slots.tolist(), out.tokens.tolist()):
            got[slot].append(tok)
    assert got[2] == ref_a
    assert got[4] == ref_b[:3]


def test_output_follows_plan_order_and_skips_unsampled_chunks(tiny_llama: str) -> None:
    runner = runner_for(tiny_llama)
    plan = StepPlan.of(**new_requests([3, 1, 2]),
                    pt_slot=np.asarray([3, 1, 2], U32), pt_first=np.zeros(3, U32),
                    pt_pages_len=np.asarray([1, 2, 1], U32), pt_pages=np.asarray([0, 1, 2, 3], U32),
                    **schedule([(3, 0, [5, 6], 1), (1, 0, [7, 8, 9, 10, 11], 0), (2, 0, [4], 1)]))
    out = runner.step(plan)
    assert out.slots.tolist() == [3, 2]
    assert out.tokens.dtype == np.uint32 and out.logprobs.dtype == np.float32
    assert out.top_ids is not None and out.top_ids.shape == (2, 0)


def test_empty_plan_gives_empty_output(tiny_llama: str) -> None:
    out = runner_for(tiny_llama).step(StepPlan.of())
    assert len(out.slots) == len(out.tokens) == len(out.logprobs) == 0


def test_top_logprobs_are_the_log_softmax_top_k(tiny_llama: str) -> None:
    runner = runner_for(tiny_llama)
    plan = StepPlan.of(**new_requests([0], top_logprobs=4), **pages(0, 0, [0, 1]),
                    **schedule([(0, 0, PREFIX[:6], 1)]))
    logits = runner.forward(plan)
    out = runner.sample(plan, logits)
    ref = torch.log_softmax(logits, -1)[0]
    assert out.top_ids.shape == (1, 4)
    assert out.top_ids[0].tolist() == ref.topk(4).indices.tolist()
    np.testing.assert_allclose(out.top_logprobs[0], ref.topk(4).values.numpy(), rtol=1e-6)
    assert out.tokens[0] == out.top_ids[0, 0]
    assert out.logprobs[0] == pytest.approx(out.top_logprobs[0, 0])


def test_seeded_request_samples_the_same_tokens_alone_or_batched(tiny_llama: str) -> None:
    prompts = [PREFIX, TAIL_B * 3]
    sampling = {"temperature": [1.0, 1.0], "seed": [42, -1]}
    batched = OfflineScheduler(runner_for(tiny_llama)).generate(prompts, 10, sampling=sampling)
    alone = OfflineScheduler(runner_for(tiny_llama)).generate(
        prompts[:1], 10, sampling={"temperature": [1.0], "seed": [42]})
    other_seed = OfflineScheduler(runner_for(tiny_llama)).generate(
        prompts[:1], 10, sampling={"temperature": [1.0], "seed": [43]})
    assert batched.tokens[0] == alone.tokens[0]
    assert alone.tokens[0] != other_seed.tokens[0]


def test_reused_slot_starts_fresh(tiny_llama: str) -> None:
    runner = runner_for(tiny_llama)
    sched = OfflineScheduler(runner)
    sched.generate([TAIL_B * 2], 4, sampling={"temperature": [1.0], "seed": [1],
                                              "repetition_penalty": [1.3]})
    again = sched.generate([PREFIX], 6)  # slot 0 again: greedy, no penalty history
    assert again.tokens[0] == greedy_from_scratch(tiny_llama, PREFIX, 6)[0]


def test_the_start_up_eager_steps_leave_the_slots_and_pages_usable(tiny_llama: str) -> None:
    """On CUDA, start-up runs two eager mixed steps on slots 0-1 and the first pages (to compile
    their kernels before serving); requests in those slots and pages afterwards are unaffected."""
    runner = runner_for(tiny_llama)
    runner._compile_eager_steps()
    sched = OfflineScheduler(runner)
    got = sched.generate([PREFIX, TAIL_B], 6)
    assert got.tokens[0] == greedy_from_scratch(tiny_llama, PREFIX, 6)[0]
    assert got.tokens[1] == greedy_from_scratch(tiny_llama, TAIL_B, 6)[0]


def test_plan_errors_name_the_problem(tiny_llama: str) -> None:
    # (Token counts that disagree with the tokens cannot reach the worker: the codec refuses
    # them, see rust/ipc/tests/codec.rs.)
    runner = runner_for(tiny_llama)
    runner.step(StepPlan.of(**new_requests([0])))
    with pytest.raises(ValueError, match="out of range"):
        runner.step(StepPlan.of(**pages(0, 0, [runner.num_pages])))
    with pytest.raises(ValueError, match="max_context_len"):
        runner.step(StepPlan.of(**schedule([(0, 127, [1, 2], 1)])))


def test_defaults_on_cpu(tiny_llama: str) -> None:
    runner = runner_for(tiny_llama, page_size=16)
    assert runner.dtype == torch.float32
    assert runner.num_pages == 16384 // 16
    assert runner.kv_cache.k[0].shape == (1024, 16, 2, 16)
    assert runner_for(tiny_llama, num_pages=10).num_pages == 10
    assert Path(tiny_llama, "config.json").exists()


def test_without_max_slots_the_slots_follow_the_kv_pool(tiny_llama: str) -> None:
    # 16384 tokens with a 64-token context: 256 requests (the derived default, config/derived.py).
    runner = ModelRunner(tiny_llama, page_size=4, num_pages=4096, max_slots=None, max_context_len=64)
    assert runner.max_slots == default_max_running_requests(4096 * 4, 64) == 256
    assert runner.kv_cache.page_table.shape[0] == 256
    assert runner.last_tokens.shape[0] == 256
    assert runner.cuda_graph_max_bs == 0  # CPU: no graphs
    # The last slot works: a request there is prefilled and sampled.
    plan = StepPlan.of(**new_requests([255]), **pages(255, 0, [7, 8]),
                       **schedule([(255, 0, PREFIX[:5], 1)]))
    assert runner.step(plan).slots.tolist() == [255]
    # An explicit --max-running-requests wins over the pool.
    explicit = ModelRunner(tiny_llama, page_size=4, num_pages=4096, max_slots=8, max_context_len=64)
    assert explicit.max_slots == 8 and explicit.kv_cache.page_table.shape[0] == 8


@pytest.mark.parametrize("lengths", [[1089, 1089, 1089, 65, 65, 66], [1, 3, 5], [0, 7, 16, 17]])
def test_packed_step_inputs_start_aligned(lengths: list[int]) -> None:
    """A step's inputs travel as one packed int64 transfer; every view must start 16-byte
    aligned whatever the lengths, or Triton compiles its kernels again for the misaligned
    pointer in the middle of serving (an odd token count put `positions` at an odd offset)."""
    from tokenspeed.layers.host_copy import to_device_int64

    arrays = [np.arange(n, dtype=np.int64) * (i + 1) for i, n in enumerate(lengths)]
    views = to_device_int64(arrays, torch.device("cpu"))
    base = views[0].untyped_storage().data_ptr()
    for a, v in zip(arrays, views):
        assert (v.data_ptr() - base) % 16 == 0
        np.testing.assert_array_equal(v.numpy(), a)


def test_draft_chains_verify_to_the_plain_greedy_tokens(tiny_llama: str) -> None:
    """Speculative steps (spec_verify.py): the last token plus drafts, some right, some wrong;
    the accepted tokens are the plain greedy ones, the stale KV of rejected drafts is
    overwritten by the next step, and each event carries its tokens' logprobs."""
    want, _ = greedy_from_scratch(tiny_llama, PREFIX, 14)
    runner = runner_for(tiny_llama)
    prefill = StepPlan.of(**new_requests([0]), **pages(0, 0, list(range(8))),
                          **schedule([(0, 0, PREFIX, 1)]))
    got = [int(runner.step(prefill).tokens[0])]
    pos = len(PREFIX)
    step = 0
    while len(got) < len(want):
        # Drafts: the true continuation, with every other step's second draft wrong.
        truth = want[len(got):len(got) + 3]
        drafts = [t if (i != 1 or step % 2) else (t + 1) % 200 for i, t in enumerate(truth)]
        plan = StepPlan.build(scheduled=[(0, pos, [got[-1], *drafts], True, len(drafts))])
        out = runner.step(plan)
        assert out.counts.tolist() == [len(out.tokens)] and len(out.logprobs) == len(out.tokens)
        accepted = [int(t) for t in out.tokens]
        assert 1 <= len(accepted) <= len(drafts) + 1
        got.extend(accepted)
        pos += len(accepted)  # the last known token and the accepted drafts have valid KV
        step += 1
    assert got[:len(want)] == want
    assert step < len(want) - 1  # several tokens per step
