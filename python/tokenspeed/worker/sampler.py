"""On-device batched sampler with per-slot parameters, seeded generators and penalties."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from tokenspeed.layers import batch_invariant
from tokenspeed.layers.host_copy import to_device_int64

if TYPE_CHECKING:
    from tokenspeed.worker.plan import StepPlan

_GREEDY_EPS = 1e-5


@dataclass
class SlotSampling:
    """A slot's sampling parameters (set when the request arrives) and its history."""

    temperature: float
    top_p: float
    top_k: int  # <= 0: disabled
    min_p: float
    repetition_penalty: float
    frequency_penalty: float
    presence_penalty: float
    top_logprobs: int
    generator: torch.Generator | None  # None: the sampler's shared generator
    # Report prompt tokens' logprobs until the slot first samples (model_runner computes them).
    prompt_logprobs: bool = False
    # `stop_ids` are masked until the slot has sampled `min_tokens` tokens.
    min_tokens: int = 0
    stop_ids: list[int] = field(default_factory=list)
    # OpenAI's logit_bias: added to these tokens' logits before sampling.
    bias_ids: list[int] = field(default_factory=list)
    bias_values: list[float] = field(default_factory=list)
    # Only kept when a penalty is active: every token fed to the slot, and the tokens sampled.
    seen: list[int] = field(default_factory=list)
    outputs: list[int] = field(default_factory=list)

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def penalized(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0
                or self.presence_penalty != 0.0)


@dataclass
class TokenMasks:
    """Allowed tokens of some rows of a batch (the plan's `mask` section): `rows` index the
    batch, `words` holds one bitmask per row (bit i % 32 of word i // 32 set: token i allowed)."""

    rows: np.ndarray  # [R] int64
    words: np.ndarray  # [R, W] uint32, W * 32 >= vocab

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` with every disallowed token of the masked rows at -inf (a new tensor: the
        raw logits stay intact for logprobs)."""
        if not len(self.rows):
            return logits
        dev, vocab = logits.device, logits.shape[-1]
        words = torch.from_numpy(np.ascontiguousarray(self.words).view(np.int32))
        if dev.type == "cuda":  # through pinned memory: a pageable copy would wait for the GPU
            words = words.pin_memory().to(dev, non_blocking=True)
        shifts = torch.arange(32, dtype=torch.int32, device=dev)
        allowed = ((words[:, :, None] >> shifts) & 1).reshape(len(self.rows), -1).bool()
        if allowed.shape[1] < vocab:  # columns past the mask (padded vocab) are never allowed
            allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]))
        rows = to_device_int64([self.rows], dev)[0]
        masked = logits[rows].masked_fill(~allowed[:, :vocab], float("-inf"))
        return logits.index_put((rows,), masked)


@dataclass
class SampleResult:
    tokens: torch.Tensor  # [B] int64
    logprobs: torch.Tensor  # [B] float32, log_softmax of the raw logits at the chosen token
    top_ids: torch.Tensor  # [B, k] int64
    top_logprobs: torch.Tensor  # [B, k] float32


class Sampler:
    """Samples one token per row of a [B, vocab] logits batch; row i belongs to slots[i].

    Logprobs are those of the model's distribution (raw logits, before penalties and
    temperature), like vLLM's default. Sampling draws exponential noise and takes
    argmax(p / noise), which is an exact categorical draw and lets each seeded request draw from
    its own generator so its tokens do not depend on the rest of the batch.

    Nothing here waits for the GPU (the worker queues the next step while this one runs): the
    per-slot parameters live in device tensors indexed by slot, and the host keeps only the flags
    that choose the code path. Penalties are the exception: they keep token history on the host.
    On CUDA a batch that only wants each row's argmax and its logprob (`plain_greedy`) takes one
    fused pass over the logits (tokenspeed_kernels.sampling.greedy_logprobs).
    """

    def __init__(self, device: torch.device | str, seed: int = 0, capacity: int = 256) -> None:
        self.device = torch.device(device)
        self.slots: dict[int, SlotSampling] = {}
        self.shared_generator = torch.Generator(device=self.device)
        self.shared_generator.manual_seed(seed)
        self._capacity = 0
        self._grow(max(1, capacity))

    def warm_up(self, vocab: int, dtype: torch.dtype) -> None:
        """Compiles the fused greedy pass now (CUDA), not in the first request's step: for
        float32 logits (the CUDA graphs' buffers) and the model's `dtype` (eager steps)."""
        if self.device.type == "cuda":
            from tokenspeed_kernels.sampling import greedy_logprobs

            for dt in {torch.float32, dtype}:
                greedy_logprobs(torch.zeros(1, vocab, dtype=dt, device=self.device))

    def _grow(self, capacity: int) -> None:
        """(Re)allocates the per-slot arrays for `capacity` slots, keeping their contents."""
        def keep(old: torch.Tensor | np.ndarray | None, new: torch.Tensor | np.ndarray):
            if old is not None:
                new[:len(old)] = old
            return new

        dev, n = self.device, capacity
        self._temperature = keep(getattr(self, "_temperature", None),
                                 torch.zeros(n, device=dev))
        self._top_p = keep(getattr(self, "_top_p", None), torch.ones(n, device=dev))
        self._top_k = keep(getattr(self, "_top_k", None),
                           torch.zeros(n, dtype=torch.int64, device=dev))
        self._min_p = keep(getattr(self, "_min_p", None), torch.zeros(n, device=dev))
        self._greedy = keep(getattr(self, "_greedy", None), np.ones(n, dtype=bool))
        self._penalized = keep(getattr(self, "_penalized", None), np.zeros(n, dtype=bool))
        self._top_logprobs = keep(getattr(self, "_top_logprobs", None), np.zeros(n, np.int64))
        # Samples each slot must still draw before its stop ids are allowed (min_tokens).
        self._min_left = keep(getattr(self, "_min_left", None), np.zeros(n, np.int64))
        self._biased = keep(getattr(self, "_biased", None), np.zeros(n, dtype=bool))
        self._prompt_logprobs = keep(getattr(self, "_prompt_logprobs", None), np.zeros(n, dtype=bool))
        self._capacity = capacity

    def add(self, slot: int, params: dict[str, Any], stop_ids: list[int] | None = None,
            logit_bias_ids: list[int] | None = None,
            logit_bias_values: list[float] | None = None) -> None:
        """A request enters `slot` with `params`: the scalar fields of the plan's new-request
        section by name (meanings in rust/engine/src/plan.rs::SamplingParams; every field, no
        defaults here), and its list fields as keyword arguments."""
        missing = [f for f in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                               "frequency_penalty", "presence_penalty", "seed", "top_logprobs",
                               "min_tokens", "prompt_logprobs") if f not in params]
        if missing:
            raise KeyError(f"sampling parameters miss {missing}")
        gen = None
        if params["seed"] >= 0:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(int(params["seed"]))
        top_p, rep = float(params["top_p"]), float(params["repetition_penalty"])
        state = SlotSampling(
            temperature=float(params["temperature"]), top_p=top_p if top_p > 0 else 1.0,
            top_k=int(params["top_k"]), min_p=float(params["min_p"]),
            # A penalty of 0 would divide by zero: 0 cannot come from validated requests.
            repetition_penalty=rep if rep > 0 else 1.0,
            frequency_penalty=float(params["frequency_penalty"]),
            presence_penalty=float(params["presence_penalty"]),
            top_logprobs=int(params["top_logprobs"]), generator=gen,
            prompt_logprobs=bool(params["prompt_logprobs"]),
            min_tokens=int(params["min_tokens"]), stop_ids=list(stop_ids or []),
            bias_ids=list(logit_bias_ids or []), bias_values=list(logit_bias_values or []))
        if len(state.bias_ids) != len(state.bias_values):
            raise ValueError(f"slot {slot}: {len(state.bias_ids)} logit bias ids but "
                             f"{len(state.bias_values)} values")
        self.slots[slot] = state
        if slot >= self._capacity:
            self._grow(max(2 * self._capacity, slot + 1))
        # fill_ passes the value as a kernel argument. `t[slot] = value` would copy it from a
        # pageable host scalar, which waits for every kernel queued on the stream: a new
        # request's step would wait for the step in flight before it could be launched.
        self._temperature[slot:slot + 1].fill_(state.temperature)
        # top_p = 1 must keep everything despite cumsum rounding.
        self._top_p[slot:slot + 1].fill_(state.top_p if state.top_p < 1.0 else float("inf"))
        self._top_k[slot:slot + 1].fill_(state.top_k)
        self._min_p[slot:slot + 1].fill_(state.min_p)
        self._greedy[slot] = state.greedy
        self._penalized[slot] = state.penalized
        self._top_logprobs[slot] = state.top_logprobs
        self._min_left[slot] = state.min_tokens if state.stop_ids else 0
        self._biased[slot] = bool(state.bias_ids)
        self._prompt_logprobs[slot] = state.prompt_logprobs

    def drop(self, slot: int) -> None:
        self.slots.pop(slot, None)
        if slot < self._capacity:
            self._prompt_logprobs[slot] = False

    def prompt_logprobs_pending(self, slots: np.ndarray) -> np.ndarray:
        """Indices of `slots` whose requests still report prompt logprobs (vectorized: this
        runs every step)."""
        return np.flatnonzero(self._prompt_logprobs[slots.astype(np.int64)])

    def prompt_logprobs_done(self, slot: int) -> None:
        """The slot's prompt is complete: its first sampled token follows."""
        self._prompt_logprobs[slot] = False
        self.slots[slot].prompt_logprobs = False

    def top_k_of(self, slots: np.ndarray) -> np.ndarray:
        """Top logprobs each of `slots` asked for."""
        return self._top_logprobs[np.asarray(slots, np.int64)].copy()

    def any_penalized(self, slots: np.ndarray) -> bool:
        return bool(len(slots)) and bool(self._penalized[slots.astype(np.int64)].any())

    def observe_inputs(self, slot: int, tokens: list[int]) -> None:
        """Record tokens fed to a slot (the repetition penalty covers prompt and output)."""
        state = self.slots.get(slot)
        if state is not None and state.penalized:
            state.seen.extend(tokens)

    def sample(self, slots: list[int], logits: torch.Tensor,
               slots_dev: torch.Tensor | None = None,
               masks: TokenMasks | None = None) -> SampleResult:
        """`slots_dev`: the same slots already on the device (saves a copy). `masks`: the
        grammar-constrained rows' allowed tokens (structured output)."""
        idx = np.asarray(slots, dtype=np.int64)
        missing = [s for s in slots if s not in self.slots]
        if missing:
            raise KeyError(f"slot {missing[0]} samples but was never announced as a new request")
        # The fused greedy pass reads each row in one program: batch-invariant as it is.
        if self.device.type == "cuda" and self.plain_greedy(idx, masks):
            from tokenspeed_kernels.sampling import greedy_logprobs

            tokens, chosen = greedy_logprobs(logits)
            return SampleResult(tokens, chosen, tokens.new_zeros(len(slots), 0),
                                chosen.new_zeros(len(slots), 0))
        logits = logits.float()
        raw = logits
        penalized = bool(self._penalized[idx].any()) if len(idx) else False
        if penalized:
            logits = self._apply_penalties(logits, [self.slots[s] for s in slots])
        logits = self._apply_logit_bias(logits, slots, idx)
        logits = self._mask_early_stops(logits, slots, idx)
        if masks is not None:
            logits = masks.apply(logits)
        tokens = logits.argmax(dim=-1)
        rows = np.flatnonzero(~self._greedy[idx])
        if len(rows):
            if slots_dev is None:
                slots_dev = to_device_int64([idx], self.device)[0]
            rows_dev = to_device_int64([rows], self.device)[0]
            seeded = [(i, self.slots[slots[r]].generator) for i, r in enumerate(rows.tolist())]
            tokens[rows_dev] = self._sample_rows(logits[rows_dev], slots_dev[rows_dev], seeded)
        # log_softmax at the chosen token without materializing the whole [B, vocab] result;
        # batch-invariant mode: a per-row log_softmax (layers/batch_invariant.py says why).
        if batch_invariant.enabled():
            chosen, logp = batch_invariant.chosen_logprobs(raw, tokens)
        else:
            lse = torch.logsumexp(raw, dim=-1)
            chosen = raw.gather(1, tokens[:, None]).squeeze(1) - lse
        # At most the logits' width: a request's -1 ("all") is the tokenizer's vocabulary, which
        # may exceed the model's (each event then reports the columns there are).
        k = min(int(self._top_logprobs[idx].max()), raw.shape[-1]) if len(idx) else 0
        if k:
            top_vals, top_ids = raw.topk(k, dim=-1)
            top_lp = (logp.gather(1, top_ids) if batch_invariant.enabled()
                      else top_vals - lse[:, None])
        else:
            top_lp, top_ids = raw.new_zeros(len(slots), 0), tokens.new_zeros(len(slots), 0)
        if penalized:  # history for the next step's penalties (waits for this step's tokens)
            for slot, tok in zip(slots, tokens.tolist()):
                state = self.slots[slot]
                if state.penalized:
                    state.outputs.append(tok)
        return SampleResult(tokens, chosen, top_ids, top_lp)

    def plain_greedy(self, idx: np.ndarray, masks: TokenMasks | None) -> bool:
        """Whether every row of the batch takes the argmax of its raw logits and reports only
        the chosen token's logprob: greedy, no penalty, logit bias, min_tokens countdown, grammar
        mask or top logprobs. Such a batch needs one pass over the logits (greedy_logprobs)."""
        return bool(len(idx)) and bool(self._greedy[idx].all()) and not (
            self._penalized[idx].any() or self._biased[idx].any() or self._min_left[idx].any()
            or self._top_logprobs[idx].any() or (masks is not None and len(masks.rows)))

    def _apply_logit_bias(self, logits: torch.Tensor, slots: list[int],
                          idx: np.ndarray) -> torch.Tensor:
        """Adds each biased slot's logit_bias to its row (one scatter for the whole batch)."""
        if not len(idx) or not self._biased[idx].any():
            return logits
        vocab = logits.shape[-1]
        rows, cols, vals = [], [], []
        for i in np.flatnonzero(self._biased[idx]).tolist():
            s = self.slots[slots[i]]
            for t, v in zip(s.bias_ids, s.bias_values):
                if t < vocab:
                    rows.append(i)
                    cols.append(t)
                    vals.append(v)
        if not rows:
            return logits
        r, c = to_device_int64([np.asarray(rows), np.asarray(cols)], self.device)
        values = torch.tensor(vals, dtype=logits.dtype)
        if self.device.type == "cuda":  # through pinned memory: a pageable copy waits for the GPU
            values = values.pin_memory().to(self.device, non_blocking=True)
        return logits.index_put((r, c), values, accumulate=True)

    def _mask_early_stops(self, logits: torch.Tensor, slots: list[int],
                          idx: np.ndarray) -> torch.Tensor:
        """Stop tokens cannot be sampled before `min_tokens` (vLLM's min_tokens). The host
        counts down each slot's remaining minimum, so this needs no device sync."""
        left = self._min_left[idx]
        if not left.any():
            return logits
        self._min_left[idx] = np.maximum(left - 1, 0)
        vocab = logits.shape[-1]
        pairs = [(i, t) for i in np.flatnonzero(left).tolist()
                 for t in self.slots[slots[i]].stop_ids if t < vocab]
        if not pairs:
            return logits
        rows, cols = to_device_int64([np.asarray([p[0] for p in pairs]),
                                      np.asarray([p[1] for p in pairs])], self.device)
        logits = logits.clone()
        logits[rows, cols] = float("-inf")
        return logits

    def _apply_penalties(self, logits: torch.Tensor, states: list[SlotSampling]) -> torch.Tensor:
        logits = logits.clone()
        vocab = logits.shape[-1]
        for i, s in enumerate(states):
            if not s.penalized:
                continue
            row = logits[i]
            out = torch.tensor(s.outputs, dtype=torch.long, device=logits.device)
            counts = torch.zeros(vocab, device=logits.device).index_add_(
                0, out, torch.ones(len(s.outputs), device=logits.device))
            if s.repetition_penalty != 1.0:
                seen = counts > 0
                seen[torch.tensor(s.seen, dtype=torch.long, device=logits.device)] = True
                rp = s.repetition_penalty
                row = torch.where(seen, torch.where(row > 0, row / rp, row * rp), row)
            row = row - s.frequency_penalty * counts - s.presence_penalty * (counts > 0).float()
            logits[i] = row
        return logits

    def _sample_rows(self, logits: torch.Tensor, slots: torch.Tensor,
                     seeded: list[tuple[int, torch.Generator | None]]) -> torch.Tensor:
        """Temperature, then top-k / top-p / min-p on the sorted distribution, then a draw.
        `seeded`: (row, the request's own generator or None for the shared one)."""
        vocab = logits.shape[-1]
        temp = self._temperature[slots]
        top_k = self._top_k[slots]
        top_k = torch.where(top_k > 0, top_k, vocab)
        top_p, min_p = self._top_p[slots], self._min_p[slots]

        sorted_logits, sorted_ids = (logits / temp[:, None]).sort(dim=-1, descending=True,
                                                                  stable=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        ranks = torch.arange(vocab, device=logits.device)[None, :]
        drop = ranks >= top_k[:, None]
        drop |= (probs.cumsum(dim=-1) - probs) > top_p[:, None]
        drop |= probs < min_p[:, None] * probs[:, :1]
        probs = probs.masked_fill(drop, 0.0)

        noise = torch.empty_like(probs).exponential_(generator=self.shared_generator)
        for i, gen in seeded:
            if gen is not None:
                noise[i].exponential_(generator=gen)
        choice = (probs / noise.clamp_min(1e-20)).argmax(dim=-1)
        return sorted_ids.gather(1, choice[:, None]).squeeze(1)


def has_pending_masks(plan: StepPlan) -> bool:
    """Whether some of the plan's mask rows come later, in a mask completion (plan.rs TokenMask)."""
    return bool(len(plan.mask_slot)) and bool((plan.mask_allowed_len == 0).any())


def token_masks(plan: StepPlan, sampled_slots: np.ndarray,
                completion: StepPlan | None = None) -> TokenMasks | None:
    """The grammar masks of the plan's sampled rows (`sampled_slots`, in plan order): the plan's
    own rows, with the pending ones taken from its mask `completion`."""
    if not len(plan.mask_slot):
        return None
    rows_by_slot: dict[int, np.ndarray] = {}
    for source in (plan, completion):
        if source is None:
            continue
        ends = np.cumsum(source.mask_allowed_len.astype(np.int64))
        for slot, n, end in zip(source.mask_slot.tolist(), source.mask_allowed_len.tolist(), ends.tolist()):
            if n:  # a copy: plan arrays die at the next recv
                rows_by_slot[int(slot)] = np.array(source.mask_allowed[end - n:end], np.uint32)
    row_of = {int(s): i for i, s in enumerate(sampled_slots.tolist())}
    missing = [s for s in plan.mask_slot.tolist() if int(s) not in rows_by_slot]
    if missing:
        raise ValueError(f"no token mask arrived for slot {missing[0]} of step {plan.step_id}")
    unknown = [s for s in rows_by_slot if s not in row_of]
    if unknown:
        raise ValueError(f"a token mask for slot {unknown[0]}, which does not sample this step")
    slots = list(rows_by_slot)
    return TokenMasks(np.asarray([row_of[s] for s in slots], np.int64),
                      np.stack([rows_by_slot[s] for s in slots]))
