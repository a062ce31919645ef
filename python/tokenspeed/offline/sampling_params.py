"""`SamplingParams` in vLLM's shape, turned into the fields of a completions or chat request body,
which the engine validates exactly as the HTTP server does (so a bad value is the same error,
naming the same field)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any


@dataclass
class StructuredOutputsParams:
    """vLLM's structured outputs: set exactly one of them."""

    json: str | dict | None = None  # a JSON schema (an object, or its JSON text)
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # GBNF or Lark
    json_object: bool | None = None  # any JSON object

    def to_request(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}


# vLLM's older name for the same thing (`SamplingParams(guided_decoding=...)`).
GuidedDecodingParams = StructuredOutputsParams

# Fields sent under the same name in both request kinds; None leaves the server's default
# (the model's generation_config.json with `sampling_defaults="model"`, else OpenAI's).
_SHARED = ("n", "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
           "repetition_penalty", "seed", "stop", "stop_token_ids", "ignore_eos", "min_tokens",
           "skip_special_tokens", "spaces_between_special_tokens", "include_stop_str_in_output",
           "prompt_logprobs", "max_tokens")

# vLLM fields TokenSpeed does not implement: refused unless left at their neutral value.
_REFUSED = ("bad_words", "allowed_token_ids", "truncate_prompt_tokens", "logits_processors")


@dataclass
class SamplingParams:
    """vLLM's `SamplingParams`. `max_tokens` defaults to 16 as in vLLM; every other field left
    None takes the server's default. `logprobs=k` returns each token's logprob and its top k
    alternatives (0: the token's own only); `prompt_logprobs=k` does the same for the prompt."""

    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    max_tokens: int | None = 16
    min_tokens: int | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    logit_bias: dict[int, float] | None = None
    structured_outputs: StructuredOutputsParams | dict | None = None
    guided_decoding: StructuredOutputsParams | dict | None = None
    detokenize: bool = True
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None
    truncate_prompt_tokens: int | None = None
    logits_processors: list[Any] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        for name in _REFUSED:
            if getattr(self, name) is not None:
                raise ValueError(f"SamplingParams.{name} is not supported yet by TokenSpeed")
        if not self.detokenize:
            raise ValueError("SamplingParams.detokenize=False is not supported yet by TokenSpeed")
        if self.structured_outputs is not None and self.guided_decoding is not None:
            raise ValueError("give structured_outputs or guided_decoding, not both")

    def _constraint(self) -> dict[str, Any] | None:
        spec = self.structured_outputs if self.structured_outputs is not None else self.guided_decoding
        if spec is None:
            return None
        return spec.to_request() if isinstance(spec, StructuredOutputsParams) else dict(spec)

    def _common(self) -> dict[str, Any]:
        body = {k: getattr(self, k) for k in _SHARED if getattr(self, k) is not None}
        if self.logit_bias:
            body["logit_bias"] = {str(k): float(v) for k, v in self.logit_bias.items()}
        constraint = self._constraint()
        if constraint is not None:
            body["structured_outputs"] = constraint
        return body

    def completion_fields(self) -> dict[str, Any]:
        """The fields of a `/v1/completions` body."""
        body = self._common()
        if self.logprobs is not None:
            body["logprobs"] = self.logprobs
        return body

    def chat_fields(self) -> dict[str, Any]:
        """The fields of a `/v1/chat/completions` body."""
        body = self._common()
        if self.logprobs is not None:
            body["logprobs"] = True
            body["top_logprobs"] = self.logprobs
        return body
