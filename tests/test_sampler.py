"""Sampler: greedy, seeded sampling, top-k/top-p/min-p masking, penalties, logprobs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tokenspeed.worker.plan import NEUTRAL_SAMPLING
from tokenspeed.worker.sampler import Sampler, TokenMasks

PROBS = torch.tensor([0.5, 0.3, 0.15, 0.05])


def batch_of(logits: torch.Tensor, n: int) -> torch.Tensor:
    return logits[None, :].repeat(n, 1)


def params(**overrides: float) -> dict:
    """A request's sampling fields: neutral (from the Rust core) but for `overrides`."""
    return {**NEUTRAL_SAMPLING, **overrides}


def sampler_with(n: int, **overrides: float) -> Sampler:
    s = Sampler("cpu", seed=0)
    for slot in range(n):
        s.add(slot, params(**overrides))
    return s


def drawn_tokens(n: int, **params: float) -> set[int]:
    s = sampler_with(n, **params)
    return set(s.sample(list(range(n)), batch_of(PROBS.log(), n)).tokens.tolist())


def test_greedy_is_argmax() -> None:
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    s = sampler_with(6, temperature=0.0)
    assert s.sample(list(range(6)), logits).tokens.tolist() == logits.argmax(-1).tolist()


def test_logprobs_are_log_softmax_of_chosen_and_top_tokens() -> None:
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(1))
    s = Sampler("cpu")
    s.add(0, params(temperature=0.0, top_logprobs=5))
    s.add(1, params(temperature=1.0, seed=3))
    s.add(2, params(temperature=0.7, top_k=10, top_logprobs=2))
    res = s.sample([0, 1, 2], logits)
    ref = torch.log_softmax(logits, dim=-1)
    torch.testing.assert_close(res.logprobs, ref.gather(1, res.tokens[:, None]).squeeze(1))
    assert res.top_ids.shape == (3, 5)
    torch.testing.assert_close(res.top_logprobs, ref.topk(5, dim=-1).values)
    assert res.top_ids[:, 0].tolist() == logits.argmax(-1).tolist()


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch() -> None:
    logits = torch.randn(20, 100, generator=torch.Generator().manual_seed(2))

    def run(seed: int, with_neighbour: bool) -> list[int]:
        s = Sampler("cpu", seed=123)
        s.add(0, params(temperature=1.0, seed=seed))
        s.add(1, params(temperature=1.0))  # unseeded neighbour draws from the shared generator
        out = []
        for step in range(20):
            slots = [1, 0] if with_neighbour else [0]
            rows = logits[[(step + 1) % 20, step]] if with_neighbour else logits[[step]]
            out.append(s.sample(slots, rows).tokens[-1].item())
        return out

    assert run(7, False) == run(7, True) == run(7, False)
    assert run(7, False) != run(8, False)


def test_top_k_1_equals_greedy() -> None:
    logits = torch.randn(8, 64, generator=torch.Generator().manual_seed(3))
    s = sampler_with(8, temperature=1.5, top_k=1)
    assert s.sample(list(range(8)), logits).tokens.tolist() == logits.argmax(-1).tolist()


@pytest.mark.parametrize(("params", "allowed"), [
    ({"top_k": 2}, {0, 1}),
    ({"top_p": 0.7}, {0, 1}),  # 0.5 alone < 0.7, 0.5 + 0.3 reaches it
    ({"top_p": 0.45}, {0}),
    ({"min_p": 0.4}, {0, 1}),  # keeps p >= 0.4 * 0.5
    ({"min_p": 0.2}, {0, 1, 2}),
    ({}, {0, 1, 2, 3}),
])
def test_truncation_masks_exactly_the_tail(params: dict, allowed: set[int]) -> None:
    assert drawn_tokens(2000, temperature=1.0, **params) == allowed


def test_unmasked_sampling_follows_the_distribution() -> None:
    n = 4000
    tokens = sampler_with(n, temperature=1.0).sample(list(range(n)), batch_of(PROBS.log(), n)).tokens
    freq = torch.bincount(tokens, minlength=4).float() / n
    torch.testing.assert_close(freq, PROBS, atol=0.03, rtol=0)


def test_low_temperature_sharpens() -> None:
    n = 1000
    s = sampler_with(n, temperature=0.05)
    tokens = s.sample(list(range(n)), batch_of(PROBS.log(), n)).tokens
    assert (tokens == 0).float().mean() > 0.99


def test_repetition_penalty_demotes_seen_tokens() -> None:
    logits = torch.tensor([[2.0, 1.9, -1.0, 0.5]])
    s = Sampler("cpu")
    s.add(0, params(temperature=0.0, repetition_penalty=1.2))
    s.observe_inputs(0, [0])  # token 0 in the prompt: 2.0 / 1.2 < 1.9
    assert s.sample([0], logits).tokens.item() == 1


def test_frequency_and_presence_penalties_count_outputs() -> None:
    logits = torch.tensor([[3.0, 2.5, 0.0]])
    s = Sampler("cpu")
    s.add(0, params(temperature=0.0, frequency_penalty=0.3, presence_penalty=0.0))
    got = [s.sample([0], logits).tokens.item() for _ in range(3)]
    assert got == [0, 0, 1]  # 3.0 - 0.3 * 2 = 2.4 < 2.5
    s.add(1, params(temperature=0.0, presence_penalty=0.6))
    assert [s.sample([1], logits).tokens.item() for _ in range(2)] == [0, 1]


def test_logprobs_ignore_penalties() -> None:
    logits = torch.tensor([[2.0, 1.9, -1.0, 0.5]])
    s = Sampler("cpu")
    s.add(0, params(temperature=0.0, repetition_penalty=1.5))
    s.observe_inputs(0, [0])
    res = s.sample([0], logits)
    assert res.logprobs.item() == pytest.approx(torch.log_softmax(logits, -1)[0, 1].item())


def test_unknown_slot_is_an_error() -> None:
    with pytest.raises(KeyError, match="slot 5"):
        Sampler("cpu").sample([5], torch.zeros(1, 4))


def test_stop_ids_are_masked_until_min_tokens() -> None:
    logits = torch.zeros(1, 10)
    logits[0, 3] = 5.0  # the stop token is the favourite
    s = Sampler("cpu")
    s.add(0, params(temperature=0.0, min_tokens=2), stop_ids=[3])
    drawn = [s.sample([0], logits).tokens.item() for _ in range(3)]
    assert drawn[0] != 3 and drawn[1] != 3, "masked for the first min_tokens samples"
    assert drawn[2] == 3, "allowed afterwards"
    lp = s.sample([0], logits).logprobs
    torch.testing.assert_close(lp, torch.log_softmax(logits, -1)[:, 3], msg="logprobs stay raw")


def test_parameters_are_all_required() -> None:
    s = Sampler("cpu")
    with pytest.raises(KeyError, match="miss"):
        s.add(0, {"temperature": 0.0})


def test_logit_bias_moves_only_its_own_slot_and_not_the_logprobs() -> None:
    s = Sampler("cpu")
    s.add(0, params(temperature=0.0), logit_bias_ids=[3, 5], logit_bias_values=[100.0, -100.0])
    s.add(1, params(temperature=0.0))
    logits = torch.tensor([[0.0, 1.0, 2.0, 0.5, 0.1, 3.0]] * 2)
    res = s.sample([0, 1], logits)
    assert res.tokens.tolist() == [3, 5]  # slot 0: 3 forced, 5 forbidden; slot 1: plain argmax
    raw = torch.log_softmax(logits[0], dim=-1)
    assert res.logprobs.tolist() == pytest.approx([raw[3].item(), raw[5].item()])
    with pytest.raises(ValueError, match="logit bias"):
        s.add(2, params(), logit_bias_ids=[1], logit_bias_values=[])


def bitmask(allowed: set[int], vocab: int) -> np.ndarray:
    words = np.zeros(-(-vocab // 32), np.uint32)
    for t in allowed:
        words[t // 32] |= np.uint32(1 << (t % 32))
    return words


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_token_masks_restrict_only_their_rows_and_keep_raw_logprobs(temperature: float) -> None:
    vocab = 70  # not a multiple of 32: the last word is partial
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(4))
    allowed = {3, 33, 64, 69}
    s = sampler_with(3, temperature=temperature, seed=5)
    masks = TokenMasks(np.asarray([1]), np.stack([bitmask(allowed, vocab)]))
    for _ in range(20):
        res = s.sample([0, 1, 2], logits, masks=masks)
        assert res.tokens[1].item() in allowed
        # Logprobs are the model's: log_softmax of the unmasked logits.
        ref = torch.log_softmax(logits, dim=-1)
        torch.testing.assert_close(res.logprobs, ref.gather(1, res.tokens[:, None]).squeeze(1))
    if temperature == 0.0:
        best = max(allowed, key=lambda t: logits[1, t].item())
        assert res.tokens.tolist() == [logits[0].argmax().item(), best, logits[2].argmax().item()]


def test_token_masks_never_allow_ids_past_the_mask() -> None:
    """Logits wider than the mask (a padded vocabulary): the extra ids stay forbidden."""
    logits = torch.full((1, 40), -5.0)
    logits[0, 39] = 50.0  # the padded id is the model's favourite
    s = sampler_with(1, temperature=0.0)
    masks = TokenMasks(np.asarray([0]), np.stack([bitmask({2}, 32)]))
    assert s.sample([0], logits, masks=masks).tokens.tolist() == [2]


def test_plain_greedy_is_only_the_argmax_with_its_logprob() -> None:
    """The fused one-pass path (CUDA) serves a batch only when nothing but the argmax and its
    logprob is asked of any row."""
    s = Sampler("cpu")
    s.add(0, params(temperature=0.0))
    s.add(1, params(temperature=0.0))
    assert s.plain_greedy(np.array([0, 1]), None)
    assert s.plain_greedy(np.array([0]), TokenMasks(np.zeros(0, np.int64), np.zeros((0, 2), np.uint32)))
    assert not s.plain_greedy(np.array([], dtype=np.int64), None)
    assert not s.plain_greedy(np.array([0]), TokenMasks(np.array([0]), np.ones((1, 2), np.uint32)))
    for slot, other in enumerate([{"temperature": 0.8}, {"repetition_penalty": 1.1},
                                  {"top_logprobs": 1}, {"frequency_penalty": 0.5}], start=2):
        s.add(slot, params(**{"temperature": 0.0, **other}))
        assert not s.plain_greedy(np.array([0, slot]), None), other
    s.add(9, params(temperature=0.0), logit_bias_ids=[3], logit_bias_values=[1.0])
    assert not s.plain_greedy(np.array([9]), None)
    s.add(10, params(temperature=0.0, min_tokens=2), stop_ids=[1])
    assert not s.plain_greedy(np.array([10]), None)
