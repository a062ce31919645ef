"""`tokenspeed.LLM`: batch generation in this process, vLLM's offline API over the server's engine.

    from tokenspeed import LLM, SamplingParams
    with LLM(model="/models/llama", max_model_len=4096) as llm:
        outs = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=32))
        print(outs[0].outputs[0].text)
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from tokenspeed.config import ServeConfig
from tokenspeed.offline.engine import EngineCore, make_config
from tokenspeed.offline.outputs import Assembler, RequestOutput
from tokenspeed.offline.pooling import (
    ClassificationRequestOutput,
    EmbeddingRequestOutput,
    ScoringRequestOutput,
    classification_outputs,
    embedding_outputs,
    scoring_outputs,
)
from tokenspeed.offline.sampling_params import SamplingParams

Message = dict[str, Any]
PromptInput = str | list[int] | dict[str, Any]

if TYPE_CHECKING:
    from typing_extensions import Self


class LLM:
    """Starts the workers and the engine (as `tokenspeed serve` would, without HTTP); keyword
    arguments are `tokenspeed serve`'s flags by their dests (`max_model_len`, `tp_size`,
    `dtype`, ...). One engine per process: `shutdown()` it (or use `with`) before another."""

    def __init__(self, model: str | os.PathLike[str] | None = None, **kwargs: Any) -> None:
        self._start(make_config(model, kwargs))

    @classmethod
    def from_config(cls, config: ServeConfig) -> LLM:
        """From a resolved `tokenspeed serve` configuration (`parse_serve_args(argv)`)."""
        llm = cls.__new__(cls)
        llm._start(config)
        return llm

    def _start(self, config: ServeConfig) -> None:
        self.config = config
        self.engine = EngineCore(config)
        self._ids = itertools.count()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def shutdown(self) -> None:
        self.engine.shutdown()

    def generate(self, prompts: PromptInput | Sequence[PromptInput],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Completes each prompt (text, token ids, or vLLM's `{"prompt": ...}` /
        `{"prompt_token_ids": [...]}`) with its own or a shared `SamplingParams`; the outputs
        in the prompts' order."""
        items = _prompt_list(prompts)
        params = _params_list(sampling_params, len(items))
        bodies = []
        for prompt, sp in zip(items, params):
            text, field = _prompt_field(prompt)
            bodies.append((text, {"prompt": field} | sp.completion_fields()))
        return self._run("completion", bodies, params, use_tqdm)

    def chat(self, messages: list[Message] | Sequence[list[Message]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, chat_template_kwargs: dict[str, Any] | None = None,
             tools: list[dict[str, Any]] | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False) -> list[RequestOutput]:
        """One conversation (a list of messages) or several; each rendered by the model's chat
        template (with `tools` and `chat_template_kwargs`) as `/v1/chat/completions` renders it.
        The outputs' text is the raw generated text (tool calls are not parsed)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        params = _params_list(sampling_params, len(conversations))
        bodies = []
        for conv, sp in zip(conversations, params):
            body: dict[str, Any] = {"messages": conv, "add_generation_prompt": add_generation_prompt,
                                    "continue_final_message": continue_final_message}
            if chat_template_kwargs:
                body["chat_template_kwargs"] = chat_template_kwargs
            if tools:
                body["tools"] = tools
            bodies.append((None, body | sp.chat_fields()))
        outs = self._run("chat", bodies, params, use_tqdm)
        for out in outs:  # vLLM's chat outputs carry the rendered prompt
            out.prompt = self.engine.decode(out.prompt_token_ids or [])
        return outs

    def embed(self, prompts: str | list[int] | Sequence[str | list[int]],
              dimensions: int | None = None) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (text or token ids), as `/v1/embeddings` computes it
        (`dimensions`: Matryoshka truncation); needs `is_embedding=True`."""
        items = [prompts] if isinstance(prompts, str) or _is_ids(prompts) else list(prompts)
        if not items:
            return []
        if all(isinstance(p, str) for p in items) or all(_is_ids(p) for p in items):
            body: dict[str, Any] = {"input": items}
            if dimensions is not None:
                body["dimensions"] = dimensions
            return self._pool("embeddings", body, embedding_outputs)
        return [out for p in items for out in self.embed([p], dimensions)]  # mixed kinds

    def score(self, data_1: str | Sequence[str], data_2: str | Sequence[str]
              ) -> list[ScoringRequestOutput]:
        """`/v1/score`: `data_1` against each of `data_2` (or pairwise for two lists of one
        length): a cross-encoder's relevance, or an embedding model's cosine."""
        return self._pool("score", {"text_1": data_1, "text_2": data_2}, scoring_outputs)

    def classify(self, prompts: str | Sequence[str]) -> list[ClassificationRequestOutput]:
        """`/classify`: a classifier's label probabilities per text."""
        texts = [prompts] if isinstance(prompts, str) else list(prompts)
        return self._pool("classify", {"input": texts}, classification_outputs)

    def _pool(self, kind: str, body: dict[str, Any], shape: Any) -> list[Any]:
        """One pooling route's answer (its inputs batched by the scheduler), in vLLM's shape."""
        rid = str(next(self._ids))
        self.engine.submit(rid, kind, body)
        response = None
        try:
            while True:
                events = self.engine.recv(0.5)
                if not events:
                    self.engine.check_alive()
                for event in events:
                    if event["request_id"] != rid:
                        continue
                    if "error" in event:
                        raise self.engine.error(event)
                    if event.get("done"):
                        return shape(rid, response)
                    response = event["response"]
        except BaseException:
            self.engine.abort(rid)
            raise

    def _run(self, kind: str, bodies: list[tuple[str | None, dict[str, Any]]],
             params: list[SamplingParams], use_tqdm: bool) -> list[RequestOutput]:
        """Submits every request, then gathers their events until each is done."""
        order: list[str] = []
        pending: dict[str, Assembler] = {}
        try:
            for (text, body), sp in zip(bodies, params):
                rid = str(next(self._ids))
                self.engine.submit(rid, kind, body)
                wants = sp.logprobs is not None or sp.prompt_logprobs is not None
                pending[rid] = Assembler(rid, text, sp.n, sp.logprobs is not None,
                                         decode=self.engine.decode if wants else None)
                order.append(rid)
            results = {rid: pending[rid] for rid in order}
            self._gather(pending, _progress(len(order), use_tqdm))
        except BaseException:  # Ctrl-C or an error: nothing of this batch keeps running
            for rid in pending:
                self.engine.abort(rid)
            raise
        return [results[rid].out for rid in order]

    def _gather(self, pending: dict[str, Assembler], bar: Any) -> None:
        try:
            while pending:
                events = self.engine.recv(0.5)
                if not events:
                    self.engine.check_alive()
                for event in events:
                    asm = pending.get(event["request_id"])
                    if asm is None:
                        continue  # a request aborted earlier
                    if "error" in event:
                        raise self.engine.error(event)
                    if event.get("done"):
                        if event.get("aborted"):
                            asm.aborted()
                        del pending[event["request_id"]]
                        if bar is not None:
                            bar.update(1)
                    else:
                        asm.add(event)
        finally:
            if bar is not None:
                bar.close()


def _is_ids(x: Any) -> bool:
    return isinstance(x, list) and bool(x) and all(isinstance(t, int) for t in x)


def _prompt_list(prompts: PromptInput | Sequence[PromptInput]) -> list[PromptInput]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    items = list(prompts)
    if items and all(isinstance(t, int) for t in items):
        return [items]  # one prompt of token ids
    return items


def _prompt_field(prompt: PromptInput) -> tuple[str | None, str | list[int]]:
    """The prompt's text (for `RequestOutput.prompt`) and its completions `prompt` field."""
    if isinstance(prompt, str):
        return prompt, prompt
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        if "prompt" in prompt:
            return str(prompt["prompt"]), str(prompt["prompt"])
        raise ValueError(f"a prompt dict needs 'prompt' or 'prompt_token_ids', got {sorted(prompt)}")
    return None, list(prompt)


def _params_list(sp: SamplingParams | Sequence[SamplingParams] | None, n: int) -> list[SamplingParams]:
    if sp is None:
        return [SamplingParams()] * n
    if isinstance(sp, SamplingParams):
        return [sp] * n
    sps = list(sp)
    if len(sps) != n:
        raise ValueError(f"{len(sps)} sampling params for {n} prompts: give one, or one per prompt")
    return sps


def _progress(total: int, use_tqdm: bool) -> Any:
    if not use_tqdm:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc="Processed prompts", dynamic_ncols=True)
