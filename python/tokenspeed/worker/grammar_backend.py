"""Worker-side structured output (`--grammar-backend xgrammar`): one xgrammar matcher per slot,
admitted from the plan's `grammar` rows, masking each sample and advanced with each sampled token.

The server validates every grammar (llguidance, so a bad one is the same 400 under either
backend) and sends it once, when the request takes a slot (rust/engine/src/plan.rs
`GrammarRow`). From then on the worker has all it needs: it samples the tokens itself, so no mask
crosses the plan and no mask completion round trip is needed. One-step-ahead scheduling keeps
working: the next plan's forward pass is queued on the GPU first, then the worker waits for the
step in flight's tokens, advances the matchers, fills the masks and queues the sample (loop.py).
The masks reach the sampler as the same `TokenMasks` the llguidance backend sends (xgrammar's
bitmask has the same layout: bit i % 32 of word i // 32 allows token i), so only where masks are
computed differs between the backends.

Under tensor parallelism only rank 0 runs matchers: it samples for the replica and every rank
takes its ids (distributed.sync_sampled_tokens), so masks elsewhere would change nothing.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from tokenspeed.worker.sampler import TokenMasks

if TYPE_CHECKING:
    from tokenspeed.worker.plan import StepOutput, StepPlan

logger = logging.getLogger("tokenspeed.grammar")

# `RequestEvent::error` of a request whose grammar the worker could not enforce (plan.rs
# event_error::GRAMMAR): xgrammar could not compile it, or a sampled token broke it.
GRAMMAR_ERROR = 2


@dataclass(frozen=True)
class XGrammarConfig:
    """What a worker needs to build its matchers (picklable: it travels in the WorkerSpec)."""

    tokenizer_path: str
    vocab_size: int  # the model's (the logits' width), may exceed the tokenizer's
    any_whitespace: bool
    separators: tuple[str, str] | None


def xgrammar_json_options(pattern: str | None, compact: bool, default_pattern: str | None
                          ) -> tuple[bool, tuple[str, str] | None]:
    """(any_whitespace, separators) for xgrammar's JSON schemas from the JSON whitespace flags.

    xgrammar has no whitespace regex, so only three settings map: 'any' (any run of whitespace),
    --constrained-json-disable-any-whitespace (compact JSON), and the default pattern (one space
    or a newline and an indent), which maps to xgrammar's fixed separators ", " and ": " — a
    subset of what the pattern allows, bounded as the pattern is meant to be. Any other pattern
    is refused (ValueError naming the flag)."""
    if compact:
        return False, (",", ":")
    if pattern is None or pattern == "any":
        return True, None
    if pattern == default_pattern:
        return False, None
    raise ValueError(
        f"--constrained-json-whitespace-pattern {pattern!r} cannot be used with --grammar-backend "
        "xgrammar, which has no whitespace regex: use 'any', the default, or "
        "--constrained-json-disable-any-whitespace, or --grammar-backend llguidance")


def xgrammar_config(backend: str, pattern: str | None, compact: bool, tokenizer_path: str,
                    vocab_size: int) -> XGrammarConfig | None:
    """The workers' xgrammar settings for `--grammar-backend` (None unless xgrammar), checked
    at start: ImportError when xgrammar does not import, ValueError for an unmappable flag."""
    if backend != "xgrammar":
        return None
    from tokenspeed.config.table import BY_DEST

    check_xgrammar_importable()
    default = BY_DEST["constrained_json_whitespace_pattern"].default
    any_whitespace, separators = xgrammar_json_options(pattern, compact, default)
    return XGrammarConfig(tokenizer_path, vocab_size, any_whitespace, separators)


def check_xgrammar_importable() -> None:
    """Raises ImportError with a clear message when xgrammar cannot be imported here."""
    try:
        import xgrammar  # noqa: F401
    except Exception as e:
        raise ImportError(
            f"--grammar-backend xgrammar needs the xgrammar package, which does not import here "
            f"({type(e).__name__}: {e}); install it (pip install xgrammar) or use "
            "--grammar-backend llguidance") from e


class _SlotGrammar:
    """One request's matcher, and the reasoning it waits out before the grammar starts."""

    def __init__(self, matcher: Any, stop_ids: list[int], starts_after: int | None) -> None:
        self.matcher = matcher
        self.stop_ids = stop_ids
        self.starts_after = starts_after  # the think-end token still to come, or None
        self.error: str | None = None

    @property
    def active(self) -> bool:
        """Its next token is constrained."""
        return self.starts_after is None and self.error is None

    def accept(self, token: int) -> None:
        if self.error is not None:
            return
        if self.starts_after is not None:
            if token == self.starts_after:
                self.starts_after = None
            return
        if self.matcher.is_terminated():
            return  # a token past the end (ignore_eos): only stop ids were allowed
        if not self.matcher.accept_token(token):
            self.error = f"token {token} does not continue the grammar"


class XGrammarSlots:
    """The matchers of one worker's slots (see the module doc)."""

    def __init__(self, config: XGrammarConfig, max_slots: int) -> None:
        import torch
        import xgrammar as xgr
        from transformers import AutoTokenizer

        from tokenspeed._core import GRAMMAR_KINDS

        self._xgr = xgr
        self._kinds = {v: k for k, v in GRAMMAR_KINDS.items()}
        self.config = config
        tokenizer = AutoTokenizer.from_pretrained(config.tokenizer_path)
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=config.vocab_size)
        # Compiled grammars are cached by xgrammar, keyed by their text and options.
        self.compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=True)
        self.words = (config.vocab_size + 31) // 32
        self._bitmask = torch.zeros((max(1, max_slots), self.words), dtype=torch.int32)
        self.slots: dict[int, _SlotGrammar] = {}
        # Per launched step: the matcher behind each constrained slot it sampled for, so the
        # step's tokens reach that request's matcher even if the slot changed hands since.
        self._launched: dict[int, dict[int, _SlotGrammar]] = {}

    # --- plan → matchers ------------------------------------------------------------------

    def apply_plan(self, plan: StepPlan) -> bool:
        """Drops the matchers of finished and re-taken slots, admits the plan's grammar rows,
        and says whether the plan samples for a constrained slot (it then needs `masks`)."""
        for slot in plan.finished_slot.tolist():
            self.slots.pop(int(slot), None)
        for slot in plan.new_slot.tolist():
            self.slots.pop(int(slot), None)
        if len(plan.grammar_slot):
            self._admit(plan)
        if not self.slots:
            return False
        sampled = plan.sched_slot[plan.sched_sample.astype(bool)].tolist()
        return any(int(s) in self.slots for s in sampled)

    def _admit(self, plan: StepPlan) -> None:
        def rows(name: str) -> list[np.ndarray]:
            ends = np.cumsum(getattr(plan, f"grammar_{name}_len").astype(np.int64))
            flat = getattr(plan, f"grammar_{name}")
            return [np.array(flat[e - n:e]) for n, e in zip(getattr(plan, f"grammar_{name}_len"), ends)]

        for slot, kind, after, text, stops, generated in zip(
                plan.grammar_slot.tolist(), plan.grammar_kind.tolist(),
                plan.grammar_starts_after.tolist(), rows("text"), rows("stop_ids"), rows("generated")):
            self.admit(int(slot), self._kinds.get(int(kind), f"kind {kind}"),
                       bytes(text.astype(np.uint8)).decode("utf-8"),
                       [int(t) for t in stops], None if after < 0 else int(after),
                       [int(t) for t in generated])

    def admit(self, slot: int, kind: str, text: str, stop_ids: list[int],
              starts_after: int | None = None, generated: list[int] | None = None) -> None:
        """A request with this grammar takes `slot`; `generated`: its tokens so far (a
        readmission), fed to the new matcher."""
        try:
            compiled = self._compile(kind, text)
            matcher = self._xgr.GrammarMatcher(compiled, override_stop_tokens=stop_ids or None)
            state = _SlotGrammar(matcher, stop_ids, starts_after)
        except Exception as e:  # noqa: BLE001  (xgrammar raises RuntimeError, ValueError, ...)
            # The server's llguidance accepted it; xgrammar's dialect may not. The request ends
            # with an error at its first sample rather than running unconstrained.
            logger.warning("slot %d: xgrammar cannot compile this %s: %s", slot, kind, e)
            state = _SlotGrammar(None, stop_ids, None)
            state.error = f"xgrammar cannot compile this {kind}: {e}"
        for token in generated or ():
            state.accept(token)
        self.slots[slot] = state

    def _compile(self, kind: str, text: str) -> Any:
        c, cfg = self.compiler, self.config
        if kind == "json_schema":
            return c.compile_json_schema(text, any_whitespace=cfg.any_whitespace,
                                         separators=cfg.separators)
        if kind == "regex":
            return c.compile_regex(text)
        if kind == "grammar":  # GBNF/EBNF (`::=` rules, a `root`) or Lark (a `start`)
            return c.compile_grammar(text) if "::=" in text else c.compile_lark(text)
        if kind == "choice":
            return c.compile_grammar("root ::= " + " | ".join(json.dumps(s) for s in json.loads(text)))
        if kind == "structural_tag":
            tag = json.loads(text)
            items = [self._xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]),
                                                 end=s["end"]) for s in tag["structures"]]
            return c.compile_structural_tag(items, list(tag["triggers"]))
        raise ValueError(f"unknown grammar kind {kind!r}")

    # --- masks and tokens -----------------------------------------------------------------

    def masks(self, plan: StepPlan) -> TokenMasks | None:
        import torch

        """The masks of the plan's sampled rows whose slot is constrained now (every step before
        this one must have been `advance`d: a mask depends on all earlier tokens). Remembers
        which matchers this step's tokens go to."""
        sampled = plan.sched_slot[plan.sched_sample.astype(bool)].tolist()
        launched: dict[int, _SlotGrammar] = {}
        rows: list[int] = []
        for row, slot in enumerate(sampled):
            state = self.slots.get(int(slot))
            if state is None:
                continue
            launched[int(slot)] = state
            if not state.active:
                continue  # reasoning (or failed): unconstrained
            i = len(rows)
            if state.matcher.is_terminated():  # only its stop ids (ignore_eos runs on)
                only = np.zeros(self.words, np.uint32)
                for t in state.stop_ids:
                    only[t // 32] |= np.uint32(1 << (t % 32))
                self._bitmask[i] = torch.from_numpy(only.view(np.int32))
            else:
                state.matcher.fill_next_token_bitmask(self._bitmask, i)
            rows.append(row)
        self._launched[int(plan.step_id)] = launched
        if not rows:
            return None
        words = self._bitmask[:len(rows)].numpy().view(np.uint32).copy()
        return TokenMasks(np.asarray(rows, np.int64), words)

    def advance(self, step_id: int, out: StepOutput) -> None:
        """Feeds step `step_id`'s sampled tokens to the matchers it was masked with, and marks
        the events of requests whose grammar failed (`GRAMMAR_ERROR`: the server ends them)."""
        launched = self._launched.pop(int(step_id), None)
        if not launched:
            return
        errors = np.zeros(len(out.slots), np.uint32)
        # An event's first token (constrained requests never carry drafts: one token each).
        firsts = np.cumsum(out.counts) - out.counts
        for i, (slot, token) in enumerate(zip(out.slots.tolist(), out.tokens[firsts].tolist())):
            state = launched.get(int(slot))
            if state is None:
                continue
            state.accept(int(token))
            if state.error is not None:
                logger.warning("slot %d: structured output failed: %s", slot, state.error)
                errors[i] = GRAMMAR_ERROR
        if errors.any():
            out.errors = errors
