"""vLLM-shaped outputs (`RequestOutput`, `CompletionOutput`, `Logprob`), assembled from the
engine's events (`tokenspeed._core.Engine.recv`)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

Decode = Callable[[list[int]], str]


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per position: the chosen token's Logprob first, then its top alternatives.
SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None  # "stop", "length" or "abort"
    stop_reason: int | str | None = None  # the stop token id or string that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int] | None
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int | None = None


def position(entry: list[Any], decode: Decode | None) -> dict[int, Logprob]:
    """One engine logprob entry `[token, logprob, rank, [[token, logprob], ...]]`."""
    token, lp, rank, top = entry
    ranks = {t: r for r, (t, _) in enumerate(top, start=1)}
    out = {token: Logprob(_num(lp), rank if rank is not None else ranks.get(token))}
    for t, tlp in top:
        out.setdefault(t, Logprob(_num(tlp), ranks[t]))
    if decode is not None:
        for t, logprob in out.items():
            logprob.decoded_token = decode([t])
    return out


def _num(x: float | None) -> float:
    return float("nan") if x is None else float(x)


class Assembler:
    """Builds one request's `RequestOutput` from its events. With `delta` (streaming), each
    event's text and tokens replace the previous ones (vLLM's DELTA output kind); else they
    accumulate."""

    def __init__(self, request_id: str, prompt: str | None, n: int, want_logprobs: bool,
                 decode: Decode | None = None, delta: bool = False) -> None:
        self.out = RequestOutput(request_id, prompt, None, None,
                                 [CompletionOutput(i) for i in range(n)])
        self.want_logprobs = want_logprobs
        self.decode = decode
        self.delta = delta

    def add(self, event: dict[str, Any]) -> RequestOutput:
        out = self.out
        if "prompt_token_ids" in event:
            out.prompt_token_ids = event["prompt_token_ids"]
        if event.get("prompt_logprobs") and out.prompt_logprobs is None:
            out.prompt_logprobs = [None] + [position(e, self.decode) for e in event["prompt_logprobs"]]
        out.num_cached_tokens = event.get("usage", {}).get("cached_tokens", out.num_cached_tokens)
        c = out.outputs[event["index"]]
        if self.delta:
            c.text, c.token_ids = event["text"], list(event["token_ids"])
        else:
            c.text += event["text"]
            c.token_ids.extend(event["token_ids"])
        if self.want_logprobs:
            new = [position(e, self.decode) for e in event.get("logprobs", [])]
            c.logprobs = new if self.delta or c.logprobs is None else c.logprobs + new
            total = sum(e[1] for e in event.get("logprobs", []) if e[1] is not None)
            c.cumulative_logprob = (c.cumulative_logprob or 0.0) + total
            if c.cumulative_logprob is not None and math.isnan(c.cumulative_logprob):
                c.cumulative_logprob = None
        c.finish_reason = event.get("finish_reason")
        c.stop_reason = event.get("stop_reason")
        out.finished = all(o.finished() for o in out.outputs)
        return out

    def aborted(self) -> RequestOutput:
        for c in self.out.outputs:
            if c.finish_reason is None:
                c.finish_reason = "abort"
        self.out.finished = True
        return self.out
