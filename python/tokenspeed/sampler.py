"""On-device batched sampler with per-slot parameters, seeded generators and penalties."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

_GREEDY_EPS = 1e-5


@dataclass
class SlotSampling:
    """A slot's sampling parameters (set when the request arrives) and penalty history."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # <= 0: disabled
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    top_logprobs: int = 0
    generator: torch.Generator | None = None  # None: the sampler's shared generator
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
    """

    def __init__(self, device: torch.device | str, seed: int = 0) -> None:
        self.device = torch.device(device)
        self.slots: dict[int, SlotSampling] = {}
        self.shared_generator = torch.Generator(device=self.device)
        self.shared_generator.manual_seed(seed)

    def add(self, slot: int, *, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
            min_p: float = 0.0, repetition_penalty: float = 1.0, frequency_penalty: float = 0.0,
            presence_penalty: float = 0.0, seed: int = -1, top_logprobs: int = 0) -> None:
        gen = None
        if seed >= 0:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(int(seed))
        self.slots[slot] = SlotSampling(
            temperature=float(temperature), top_p=float(top_p) if top_p > 0 else 1.0,
            top_k=int(top_k), min_p=float(min_p),
            # 0 means "unset" on the wire; a penalty of 0 would divide by zero.
            repetition_penalty=float(repetition_penalty) if repetition_penalty > 0 else 1.0,
            frequency_penalty=float(frequency_penalty), presence_penalty=float(presence_penalty),
            top_logprobs=int(top_logprobs), generator=gen)

    def drop(self, slot: int) -> None:
        self.slots.pop(slot, None)

    def observe_inputs(self, slot: int, tokens: list[int]) -> None:
        """Record tokens fed to a slot (the repetition penalty covers prompt and output)."""
        state = self.slots.get(slot)
        if state is not None and state.penalized:
            state.seen.extend(tokens)

    def _state(self, slot: int) -> SlotSampling:
        state = self.slots.get(slot)
        if state is None:
            raise KeyError(f"slot {slot} samples but was never announced as a new request")
        return state

    def sample(self, slots: list[int], logits: torch.Tensor) -> SampleResult:
        states = [self._state(s) for s in slots]
        logits = logits.float()
        logprobs = torch.log_softmax(logits, dim=-1)
        if any(s.penalized for s in states):
            logits = self._apply_penalties(logits, states)
        tokens = logits.argmax(dim=-1)
        rows = [i for i, s in enumerate(states) if not s.greedy]
        if rows:
            idx = torch.tensor(rows, device=logits.device)
            tokens[idx] = self._sample_rows(logits[idx], [states[i] for i in rows])
        chosen = logprobs.gather(1, tokens[:, None]).squeeze(1)
        k = max((s.top_logprobs for s in states), default=0)
        top_lp, top_ids = logprobs.topk(k, dim=-1) if k else (
            logprobs.new_zeros(len(slots), 0), tokens.new_zeros(len(slots), 0))
        if any(s.penalized for s in states):
            for state, tok in zip(states, tokens.tolist()):
                if state.penalized:
                    state.outputs.append(tok)
        return SampleResult(tokens, chosen, top_ids, top_lp)

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

    def _sample_rows(self, logits: torch.Tensor, states: list[SlotSampling]) -> torch.Tensor:
        """Temperature, then top-k / top-p / min-p on the sorted distribution, then a draw."""
        dev = logits.device
        vocab = logits.shape[-1]
        temp = torch.tensor([s.temperature for s in states], device=dev)
        top_k = torch.tensor([s.top_k if s.top_k > 0 else vocab for s in states], device=dev)
        # top_p = 1 must keep everything despite cumsum rounding.
        top_p = torch.tensor([s.top_p if s.top_p < 1.0 else float("inf") for s in states],
                             device=dev)
        min_p = torch.tensor([s.min_p for s in states], device=dev)

        sorted_logits, sorted_ids = (logits / temp[:, None]).sort(dim=-1, descending=True,
                                                                  stable=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        ranks = torch.arange(vocab, device=dev)[None, :]
        drop = ranks >= top_k[:, None]
        drop |= (probs.cumsum(dim=-1) - probs) > top_p[:, None]
        drop |= probs < min_p[:, None] * probs[:, :1]
        probs = probs.masked_fill(drop, 0.0)

        noise = torch.empty_like(probs)
        shared = [i for i, s in enumerate(states) if s.generator is None]
        if shared:
            noise[shared] = torch.empty(len(shared), vocab, device=dev).exponential_(
                generator=self.shared_generator)
        for i, s in enumerate(states):
            if s.generator is not None:
                noise[i].exponential_(generator=s.generator)
        choice = (probs / noise.clamp_min(1e-20)).argmax(dim=-1)
        return sorted_ids.gather(1, choice[:, None]).squeeze(1)
