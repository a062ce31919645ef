"""Streaming and non-streaming agree for every parameter of the OpenAI API (issue 10): each case
sends one request through the official `openai` client twice, with stream=False and with
stream=True, reassembles the stream the way clients do, and compares the two field by field
(text per choice index, finish_reason, matched_stop, logprobs, prompt logprobs, usage). Each
case also checks that its parameter visibly took effect, so a parameter the server ignored
cannot pass. Greedy or seeded, 6 tokens (8 in chat), against the shared CPU server with the default
model."""

from __future__ import annotations

import re
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest

from server_harness import Server

PROMPT = "The capital of France is"
REPEATS = "Count: one, two, one, two, one, two,"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
# The model ends this answer after "." and its end-of-turn token: stop and length are both
# reachable in a few tokens.
PREFILL = "The capital of France is Paris"
LOGPROB_TOL = 1e-4
# Tokens per completion and per chat answer (the chat answer to QUESTION ends after 8).
TOKENS = 6
CHAT_TOKENS = 8


@dataclass
class Ctx:
    """What a case's effect check needs: the server, and memoized baselines."""

    server: Server
    client: openai.OpenAI
    model: str
    _memo: dict

    def post(self, path: str, body: dict) -> dict:
        r = httpx.post(f"{self.server.url}{path}", json=body, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()

    def ids(self, text: str, special: bool = True) -> list[int]:
        return self.post("/tokenize", {"prompt": text, "add_special_tokens": special})["tokens"]

    def detok(self, ids: list[int], skip_special: bool = True) -> str:
        return self.post("/detokenize", {"tokens": ids, "skip_special_tokens": skip_special})["text"]

    def prefill_ids(self) -> list[int]:
        """QUESTION rendered by the chat template, then the start of the answer."""
        head = self.post("/tokenize", {"messages": QUESTION, "add_generation_prompt": True})["tokens"]
        return head + self.ids(PREFILL, special=False)

    def completion(self, **kw: Any) -> dict:
        key = ("completion", repr(sorted(kw.items())))
        if key not in self._memo:
            args = {"model": self.model, "prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0, **kw}
            self._memo[key] = self.client.completions.create(**args).model_dump()
        return self._memo[key]

    def chat(self, **kw: Any) -> dict:
        key = ("chat", repr(sorted(kw.items())))
        if key not in self._memo:
            args = {"model": self.model, "messages": QUESTION, "max_tokens": CHAT_TOKENS, "temperature": 0, **kw}
            self._memo[key] = self.client.chat.completions.create(**args).model_dump()
        return self._memo[key]

    def greedy_ids(self, prompt: str, n: int = TOKENS) -> list[int]:
        return self.post("/generate", {"text": prompt, "sampling_params": {
            "max_new_tokens": n, "temperature": 0}})["output_ids"]


@pytest.fixture(scope="module")
def ctx(server: Server, client: openai.OpenAI) -> Ctx:
    return Ctx(server, client, client.models.list().data[0].id, {})


# --- reassembly: a stream becomes the shape of the non-streamed response ---------------------


def whole_completion(r: dict) -> dict:
    return {"choices": {c["index"]: {
        "text": c["text"], "finish_reason": c["finish_reason"], "matched_stop": c.get("matched_stop"),
        "logprobs": c["logprobs"], "prompt_logprobs": c.get("prompt_logprobs")} for c in r["choices"]},
        "usage": r["usage"]}


def streamed_completion(chunks: list[dict]) -> dict:
    choices: dict[int, dict] = {}
    usage = None
    for chunk in chunks:
        if chunk.get("usage") is not None and not chunk["choices"]:
            assert usage is None, "one final usage chunk"
            usage = chunk["usage"]
        for c in chunk["choices"]:
            out = choices.setdefault(c["index"], {"text": "", "finish_reason": None, "matched_stop": None,
                                                  "logprobs": None, "prompt_logprobs": None})
            assert out["finish_reason"] is None, f"choice {c['index']} has a chunk after its finish"
            out["text"] += c["text"]
            out["finish_reason"] = c["finish_reason"]
            if c["finish_reason"] is not None:
                out["matched_stop"] = c.get("matched_stop")
            if c["logprobs"] is not None:
                lp = out["logprobs"] or {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
                for k in lp:
                    lp[k] += c["logprobs"][k]
                out["logprobs"] = lp
            if c.get("prompt_logprobs") is not None:
                assert out["prompt_logprobs"] is None, "prompt logprobs come once per choice"
                out["prompt_logprobs"] = c["prompt_logprobs"]
    return {"choices": choices, "usage": usage}


def whole_chat(r: dict) -> dict:
    return {"choices": {c["index"]: {
        "role": c["message"]["role"], "content": c["message"]["content"], "finish_reason": c["finish_reason"],
        "matched_stop": c.get("matched_stop"),
        "logprobs": c["logprobs"]["content"] if c["logprobs"] else None} for c in r["choices"]},
        "prompt_logprobs": r.get("prompt_logprobs"), "usage": r["usage"]}


def streamed_chat(chunks: list[dict]) -> dict:
    choices: dict[int, dict] = {}
    usage = prompt_logprobs = None
    for chunk in chunks:
        if chunk.get("usage") is not None and not chunk["choices"]:
            assert usage is None, "one final usage chunk"
            usage = chunk["usage"]
        if chunk.get("prompt_logprobs") is not None:
            assert prompt_logprobs is None, "the stream carries the prompt logprobs once"
            prompt_logprobs = chunk["prompt_logprobs"]
        for c in chunk["choices"]:
            delta = c["delta"]
            if c["index"] not in choices:
                # OpenAI's contract: a choice's first delta names the role.
                assert delta.get("role") == "assistant", c
                choices[c["index"]] = {"role": "assistant", "content": "", "finish_reason": None,
                                       "matched_stop": None, "logprobs": None}
            out = choices[c["index"]]
            assert out["finish_reason"] is None, f"choice {c['index']} has a chunk after its finish"
            out["content"] += delta.get("content") or ""
            out["finish_reason"] = c["finish_reason"]
            if c["finish_reason"] is not None:
                out["matched_stop"] = c.get("matched_stop")
            if c["logprobs"] is not None:
                out["logprobs"] = (out["logprobs"] or []) + c["logprobs"]["content"]
    return {"choices": choices, "prompt_logprobs": prompt_logprobs, "usage": usage}


# --- comparison -------------------------------------------------------------------------------


def close(a: float | None, b: float | None) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and abs(a - b) <= LOGPROB_TOL)


def assert_same(streamed: Any, whole: Any, path: str = "") -> None:
    """Equal, field by field; floats (logprobs) within LOGPROB_TOL."""
    if isinstance(whole, float) or isinstance(streamed, float):
        assert close(streamed, whole), f"{path}: streamed {streamed} != {whole}"
    elif isinstance(whole, dict):
        assert isinstance(streamed, dict) and streamed.keys() == whole.keys(), \
            f"{path}: keys {sorted(streamed) if isinstance(streamed, dict) else streamed} != {sorted(whole)}"
        for k in whole:
            assert_same(streamed[k], whole[k], f"{path}.{k}")
    elif isinstance(whole, list):
        assert isinstance(streamed, list) and len(streamed) == len(whole), \
            f"{path}: length {len(streamed) if isinstance(streamed, list) else streamed} != {len(whole)}"
        for i, (s, w) in enumerate(zip(streamed, whole)):
            assert_same(s, w, f"{path}[{i}]")
    else:
        assert streamed == whole, f"{path}: streamed {streamed!r} != {whole!r}"


def comparable_usage(u: dict) -> dict:
    # cached_tokens may differ: how much of the prompt each run finds in the radix cache depends
    # on which of the two concurrent runs got there first.
    return {k: u[k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")}


def both(ctx: Ctx, route: str, kw: dict) -> tuple[dict, dict, list[dict]]:
    """The request non-streamed and streamed: (whole, reassembled stream, raw chunks)."""
    kw = dict(kw)
    stream_options = {"include_usage": True, **kw.pop("stream_options", {})}
    if route == "completions":
        args = {"model": ctx.model, "prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0, **kw}
        create = ctx.client.completions.create
    else:
        args = {"model": ctx.model, "messages": QUESTION, "max_tokens": CHAT_TOKENS, "temperature": 0, **kw}
        create = ctx.client.chat.completions.create
    if args["temperature"] > 0:
        # Warm the prompt into the radix cache, so both runs prefill alike (a cached and an
        # uncached prefill may round differently, which could flip a sampled token).
        warm = {k: v for k, v in args.items() if k not in ("n", "logprobs", "top_logprobs", "echo")}
        create(**{**warm, "max_tokens": 1})
    # Both at once: they share steps.
    with ThreadPoolExecutor(2) as pool:
        streamed = pool.submit(lambda: [c.model_dump() for c in create(
            stream=True, stream_options=stream_options, **args)])
        whole = create(**args).model_dump()
        chunks = streamed.result()
    if route == "completions":
        w, s = whole_completion(whole), streamed_completion(chunks)
    else:
        w, s = whole_chat(whole), streamed_chat(chunks)
    assert s["usage"] is not None, "include_usage sends a final usage chunk"
    w["usage"], s["usage"] = comparable_usage(w["usage"]), comparable_usage(s["usage"])
    assert_same(s, w)
    return whole, s, chunks


# --- the effect each parameter must have ------------------------------------------------------


def texts(r: dict) -> list[str]:
    return [c["text"] for c in sorted(r["choices"], key=lambda c: c["index"])]


def contents(r: dict) -> list[str]:
    return [c["message"]["content"] for c in sorted(r["choices"], key=lambda c: c["index"])]


def baseline_text(ctx: Ctx, **kw: Any) -> str:
    return ctx.completion(**kw)["choices"][0]["text"]


def first_word(ctx: Ctx) -> str:
    """A stop string from the middle of the greedy answer."""
    return baseline_text(ctx).split()[1]


def n_samples_differ(ctx: Ctx, r: dict, chunks: list[dict]) -> None:
    assert [c["index"] for c in r["choices"]] == [0, 1, 2]
    assert len(set(texts(r))) > 1, "seeded samples must differ from one another"


def prompt_strings(ctx: Ctx, r: dict, chunks: list[dict]) -> None:
    # Prompt-major indexing: choice i*n + j is sample j of prompt i; mixed prompt lengths.
    assert len(r["choices"]) == 6
    t = texts(r)
    assert t[0] == t[1] == baseline_text(ctx)
    assert t[4] == t[5] == baseline_text(ctx, prompt="Hi")
    assert t[2] != t[0]


def prompt_id_lists(ctx: Ctx, r: dict, chunks: list[dict]) -> None:
    assert texts(r) == [baseline_text(ctx), baseline_text(ctx, prompt="Hi")]


def echo(ctx: Ctx, r: dict, chunks: list[dict]) -> None:
    assert texts(r) == [PROMPT + baseline_text(ctx)]


def logprobs(ctx: Ctx, r: dict, chunks: list[dict]) -> None:
    lp = r["choices"][0]["logprobs"]
    assert "".join(lp["tokens"]) == r["choices"][0]["text"] and len(lp["tokens"]) == TOKENS
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(TOKENS)]
    assert all(len(t) == 2 for t in lp["top_logprobs"])
    assert all(max(t.values()) >= v - LOGPROB_TOL for t, v in zip(lp["top_logprobs"], lp["token_logprobs"]))


def echo_logprobs(ctx: Ctx, r: dict, chunks: list[dict]) -> None:
    lp = r["choices"][0]["logprobs"]
    prompt_len = len(ctx.ids(PROMPT))
    assert len(lp["tokens"]) == prompt_len + TOKENS
    assert lp["token_logprobs"][0] is None and None not in lp["token_logprobs"][1:]
    assert lp["text_offset"][prompt_len] == len(ctx.detok(ctx.ids(PROMPT)))


def logit_bias(ctx: Ctx, r: dict, chunks: list[dict]) -> None:
    banana = ctx.ids(" banana", special=False)[0]
    assert texts(r) == [ctx.detok([banana] * TOKENS)]


def logit_bias_kw(ctx: Ctx) -> dict:
    return {"logit_bias": {str(ctx.ids(" banana", special=False)[0]): 100}}


def stop(ctx: Ctx, r: dict, chunks: list[dict]) -> None:
    word = first_word(ctx)
    c = r["choices"][0]
    assert c["finish_reason"] == "stop" and c["matched_stop"] == word
    assert c["text"] == baseline_text(ctx)[:baseline_text(ctx).index(word)]


def seed(ctx: Ctx, r: dict, chunks: list[dict]) -> None:
    other = ctx.completion(temperature=1.0, seed=6)
    assert texts(r) != texts(other), "another seed draws other tokens"
    assert texts(r) != [baseline_text(ctx)]


def differs_from_baseline(prompt: str) -> Callable[[Ctx, dict, list[dict]], None]:
    def check(ctx: Ctx, r: dict, chunks: list[dict]) -> None:
        assert texts(r) != [baseline_text(ctx, prompt=prompt)]
    return check


def user(ctx: Ctx, r: dict, chunks: list[dict]) -> None:
    # An opaque end-user id: no effect on the output, and known (not warned about as unknown).
    assert texts(r) == [baseline_text(ctx)]
    log = re.sub(r"\x1b\[[0-9;]*m", "", ctx.server.log())
    assert "field=user" not in log


def greedy_despite_temperature(ctx: Ctx, r: dict, chunks: list[dict]) -> None:
    # Only the most likely token survives the filter, so the hot sample is the greedy text;
    # without the filter the same seed draws something else.
    assert texts(r) == [baseline_text(ctx)]
    assert texts(ctx.completion(temperature=1.5, seed=5)) != texts(r)


def min_tokens(ctx: Ctx, r: dict, chunks: list[dict]) -> None:
    free = ctx.completion(prompt=ctx.prefill_ids())
    assert free["usage"]["completion_tokens"] < 4
    assert r["usage"]["completion_tokens"] >= 4


def ignore_eos(ctx: Ctx, r: dict, chunks: list[dict]) -> None:
    free = ctx.completion(prompt=ctx.prefill_ids())
    assert free["choices"][0]["finish_reason"] == "stop"
    assert r["choices"][0]["finish_reason"] == "length" and r["usage"]["completion_tokens"] == TOKENS


def stop_token_ids_kw(ctx: Ctx) -> dict:
    return {"extra_body": {"stop_token_ids": [ctx.greedy_ids(PROMPT)[3]]}}


def stop_token_ids(ctx: Ctx, r: dict, chunks: list[dict]) -> None:
    ids = ctx.greedy_ids(PROMPT)
    c = r["choices"][0]
    assert c["finish_reason"] == "stop" and c["matched_stop"] == ids[3]
    assert r["usage"]["completion_tokens"] == ids.index(ids[3]) + 1


def include_stop_str(ctx: Ctx, r: dict, chunks: list[dict]) -> None:
    word = first_word(ctx)
    cut = ctx.completion(stop=[word])["choices"][0]["text"]
    c = r["choices"][0]
    assert c["text"] == cut + word and c["matched_stop"] == word


def special_tokens_kept(ctx: Ctx, r: dict, chunks: list[dict]) -> None:
    eos = ctx.completion(prompt=ctx.prefill_ids())["choices"][0]["matched_stop"]
    marker = ctx.detok([eos], skip_special=False)
    assert marker and marker in texts(r)[0]
    assert marker not in texts(ctx.completion(prompt=ctx.prefill_ids(), extra_body={"ignore_eos": True}))[0]


def same_as_baseline(ctx: Ctx, r: dict, chunks: list[dict]) -> None:
    # spaces_between_special_tokens=true is the default.
    assert texts(r) == [baseline_text(ctx)]


def im_start_id(ctx: Ctx) -> int:
    (token,) = ctx.ids("<|im_start|>", special=False)
    return token


def only_special_tokens_kw(ctx: Ctx) -> dict:
    # Every generated token is <|im_start|> (a special token that ends nothing), kept in the text.
    return {"logit_bias": {str(im_start_id(ctx)): 100},
            "extra_body": {"skip_special_tokens": False, "spaces_between_special_tokens": False}}


def special_tokens_joined(ctx: Ctx, r: dict, chunks: list[dict]) -> None:
    # vLLM's rule: an added token right after another gets its raw text, with no separator.
    # SmolLM2's byte-level decoder puts none there anyway, so the text is the same as with the
    # default; tokenizers whose decoder does (WordPiece) are covered in rust/text/tests/detokenize.rs.
    marker = ctx.detok([im_start_id(ctx)], skip_special=False)
    assert marker == "<|im_start|>" and texts(r) == [marker * TOKENS]
    spaced = ctx.completion(logit_bias=only_special_tokens_kw(ctx)["logit_bias"],
                            extra_body={"skip_special_tokens": False})
    assert texts(spaced) == texts(r)


def prompt_logprobs(ctx: Ctx, r: dict, chunks: list[dict]) -> None:
    ids = ctx.ids(PROMPT)
    plp = r["choices"][0]["prompt_logprobs"]
    assert len(plp) == len(ids) and plp[0] is None
    for i, entry in enumerate(plp[1:], start=1):
        assert str(ids[i]) in entry and 2 <= len(entry) <= 3
        assert sorted(e["rank"] for e in entry.values())[:2] == [1, 2]


def continuous_usage(ctx: Ctx, r: dict, chunks: list[dict]) -> None:
    counts = [c["usage"]["completion_tokens"] for c in chunks if c["choices"]]
    assert None not in counts and counts == sorted(counts) and counts[-1] == TOKENS, counts
    assert r["usage"]["completion_tokens"] == TOKENS


def chat_continuous_usage(ctx: Ctx, r: dict, chunks: list[dict]) -> None:
    # vLLM's: every chunk with a choice carries the usage so far, the first (role) chunk too,
    # with no completion tokens yet.
    prompt = r["usage"]["prompt_tokens"]
    first = chunks[0]
    assert first["choices"][0]["delta"]["role"] == "assistant"
    assert comparable_usage(first["usage"]) == {"prompt_tokens": prompt, "completion_tokens": 0,
                                                "total_tokens": prompt}
    assert first["usage"]["prompt_tokens_details"] is None, "vLLM's role chunk counts the prompt only"
    with_choices = [c for c in chunks if c["choices"]]
    assert all(c["usage"] is not None and c["usage"]["prompt_tokens"] == prompt for c in with_choices)
    counts = [c["usage"]["completion_tokens"] for c in with_choices]
    assert counts == sorted(counts) and counts[-1] == r["usage"]["completion_tokens"] > 0, counts


def tokens_as_ids(ctx: Ctx, r: dict, chunks: list[dict]) -> None:
    lp = r["choices"][0]["logprobs"]
    assert lp["tokens"] == [f"token_id:{t}" for t in ctx.greedy_ids(PROMPT)]
    assert all(k.startswith("token_id:") for top in lp["top_logprobs"] for k in top)


def all_logprobs_despite_hold_back(ctx: Ctx, r: dict, chunks: list[dict]) -> None:
    # " Paris" could start the stop string, so its text waits for the next token; its logprob
    # must still reach the stream (it was dropped before).
    lp = r["choices"][0]["logprobs"]
    assert texts(r) == [baseline_text(ctx)] and r["choices"][0]["finish_reason"] == "length"
    assert len(lp["tokens"]) == TOKENS and "".join(lp["tokens"]) == texts(r)[0]
    assert any(c["choices"] and c["choices"][0]["text"] == "" for c in chunks), "no text was held back"


def prompt_logprobs_per_choice(ctx: Ctx, r: dict, chunks: list[dict]) -> None:
    first, second = (c["prompt_logprobs"] for c in r["choices"])
    assert len(first) == len(ctx.ids(PROMPT))
    assert [e and sorted(e) for e in first] == [e and sorted(e) for e in second]


def chat_n(ctx: Ctx, r: dict, chunks: list[dict]) -> None:
    assert [c["index"] for c in r["choices"]] == [0, 1]
    assert len(set(contents(r))) == 2, "seeded samples must differ from one another"


def chat_logprobs(ctx: Ctx, r: dict, chunks: list[dict]) -> None:
    content = r["choices"][0]["logprobs"]["content"]
    assert "".join(e["token"] for e in content).startswith(contents(r)[0])
    for e in content:
        assert e["bytes"] == list(e["token"].encode()) and len(e["top_logprobs"]) == 2
        assert all(t["bytes"] == list(t["token"].encode()) for t in e["top_logprobs"])


def chat_logprobs_despite_hold_back(ctx: Ctx, r: dict, chunks: list[dict]) -> None:
    assert contents(r) == contents(ctx.chat()) and r["choices"][0]["finish_reason"] == "stop"
    assert len(r["choices"][0]["logprobs"]["content"]) == r["usage"]["completion_tokens"]
    assert any(c["choices"] and not c["choices"][0]["delta"].get("content") and c["choices"][0]["logprobs"]
               for c in chunks), "no text was held back"


def chat_special_tokens_kept(ctx: Ctx, r: dict, chunks: list[dict]) -> None:
    eos = ctx.completion(prompt=ctx.prefill_ids())["choices"][0]["matched_stop"]
    marker = ctx.detok([eos], skip_special=False)
    skipped = ctx.chat(messages=QUESTION + [{"role": "assistant", "content": PREFILL}], extra_body={
        "continue_final_message": True, "add_generation_prompt": False, "ignore_eos": True})
    assert marker in contents(r)[0] and marker not in contents(skipped)[0]


def no_generation_prompt(ctx: Ctx, r: dict, chunks: list[dict]) -> None:
    assert r["usage"]["prompt_tokens"] < ctx.chat()["usage"]["prompt_tokens"]


def continue_final(ctx: Ctx, r: dict, chunks: list[dict]) -> None:
    # The prompt ends inside the assistant's turn: the reply continues it.
    assert r["usage"]["prompt_tokens"] == len(ctx.prefill_ids())
    assert contents(r) == [baseline_text(ctx, prompt=ctx.prefill_ids())]


def chat_echo(ctx: Ctx, r: dict, chunks: list[dict]) -> None:
    assert contents(r) == [PREFILL + baseline_text(ctx, prompt=ctx.prefill_ids())]


def template_kwargs(ctx: Ctx, r: dict, chunks: list[dict]) -> None:
    # The default model's template reads no variable, so the output is the baseline's; that a
    # template sees them is tested in rust/text (chat::tests) and, for enable_thinking, in
    # test_e2e_tools.py::test_reasoning_split_follows_enable_thinking.
    assert contents(r) == contents(ctx.chat())


def chat_stop(ctx: Ctx, r: dict, chunks: list[dict]) -> None:
    c = r["choices"][0]
    assert c["finish_reason"] == "stop" and c["matched_stop"] == "Paris"
    assert c["message"]["content"] == contents(ctx.chat())[0].split("Paris")[0]


def chat_eos(ctx: Ctx, r: dict, chunks: list[dict]) -> None:
    # The answer ends on the end-of-turn token: matched_stop names its id.
    eos = ctx.completion(prompt=ctx.prefill_ids())["choices"][0]["matched_stop"]
    c = r["choices"][0]
    assert isinstance(eos, int) and c["finish_reason"] == "stop" and c["matched_stop"] == eos
    assert r["usage"]["completion_tokens"] < 12


def chat_prompt_logprobs(ctx: Ctx, r: dict, chunks: list[dict]) -> None:
    plp = r["prompt_logprobs"]
    assert len(plp) == r["usage"]["prompt_tokens"] and plp[0] is None
    assert all(min(e["rank"] for e in entry.values()) == 1 for entry in plp[1:])


Kw = dict | Callable[[Ctx], dict]
CASES: list[tuple[str, str, Kw, Callable[[Ctx, dict, list[dict]], None]]] = [
    # /v1/completions
    ("n", "completions", {"n": 3, "temperature": 1.0, "seed": 11}, n_samples_differ),
    ("prompt_strings", "completions", {"prompt": [PROMPT, "1, 2, 3, 4, 5, 6, 7,", "Hi"], "n": 2},
     prompt_strings),
    ("prompt_token_id_lists", "completions", lambda c: {"prompt": [c.ids(PROMPT), c.ids("Hi")]},
     prompt_id_lists),
    ("echo", "completions", {"echo": True}, echo),
    ("logprobs_text_offset", "completions", {"logprobs": 2}, logprobs),
    ("echo_logprobs", "completions", {"echo": True, "logprobs": 1}, echo_logprobs),
    ("logit_bias", "completions", logit_bias_kw, logit_bias),
    ("stop", "completions", lambda c: {"stop": [first_word(c)]}, stop),
    ("seed", "completions", {"temperature": 1.0, "seed": 5}, seed),
    ("presence_penalty", "completions", {"presence_penalty": 2.0}, differs_from_baseline(PROMPT)),
    ("frequency_penalty", "completions", {"frequency_penalty": 2.0}, differs_from_baseline(PROMPT)),
    ("user", "completions", {"user": "user-1234"}, user),
    # vLLM / SGLang extras
    ("top_k", "completions", {"temperature": 1.5, "seed": 5, "extra_body": {"top_k": 1}},
     greedy_despite_temperature),
    ("min_p", "completions", {"temperature": 1.5, "seed": 5, "extra_body": {"min_p": 0.9}},
     greedy_despite_temperature),
    ("repetition_penalty", "completions", {"prompt": REPEATS, "extra_body": {"repetition_penalty": 1.5}},
     differs_from_baseline(REPEATS)),
    ("min_tokens", "completions", lambda c: {"prompt": c.prefill_ids(), "extra_body": {"min_tokens": 4}},
     min_tokens),
    ("ignore_eos", "completions", lambda c: {"prompt": c.prefill_ids(), "extra_body": {"ignore_eos": True}},
     ignore_eos),
    ("stop_token_ids", "completions", stop_token_ids_kw, stop_token_ids),
    ("include_stop_str_in_output", "completions",
     lambda c: {"stop": [first_word(c)], "extra_body": {"include_stop_str_in_output": True}}, include_stop_str),
    ("skip_special_tokens", "completions", lambda c: {"prompt": c.prefill_ids(), "extra_body": {
        "ignore_eos": True, "skip_special_tokens": False}}, special_tokens_kept),
    ("spaces_between_special_tokens", "completions", {"extra_body": {"spaces_between_special_tokens": True}},
     same_as_baseline),
    ("spaces_between_special_tokens_false", "completions", only_special_tokens_kw, special_tokens_joined),
    ("prompt_logprobs", "completions", {"extra_body": {"prompt_logprobs": 2}}, prompt_logprobs),
    ("prompt_logprobs_n", "completions", {"n": 2, "extra_body": {"prompt_logprobs": 1}},
     prompt_logprobs_per_choice),
    ("logprobs_of_held_back_text", "completions", {"logprobs": 1, "stop": [" Paris!"]},
     all_logprobs_despite_hold_back),
    ("continuous_usage_stats", "completions", {"stream_options": {"continuous_usage_stats": True}},
     continuous_usage),
    ("return_tokens_as_token_ids", "completions",
     {"logprobs": 2, "extra_body": {"return_tokens_as_token_ids": True}}, tokens_as_ids),
    # /v1/chat/completions
    ("chat_n", "chat", {"n": 2, "temperature": 1.0, "seed": 3}, chat_n),
    ("chat_logprobs_bytes", "chat", {"logprobs": True, "top_logprobs": 2}, chat_logprobs),
    ("chat_logprobs_of_held_back_text", "chat", {"logprobs": True, "stop": [" Paris!"]},
     chat_logprobs_despite_hold_back),
    ("chat_skip_special_tokens", "chat", {
        "messages": QUESTION + [{"role": "assistant", "content": PREFILL}],
        "extra_body": {"continue_final_message": True, "add_generation_prompt": False, "ignore_eos": True,
                       "skip_special_tokens": False}}, chat_special_tokens_kept),
    ("chat_add_generation_prompt", "chat", {"extra_body": {"add_generation_prompt": False}},
     no_generation_prompt),
    ("chat_continue_final_message", "chat", {
        "messages": QUESTION + [{"role": "assistant", "content": PREFILL}],
        "extra_body": {"continue_final_message": True, "add_generation_prompt": False}}, continue_final),
    ("chat_echo", "chat", {
        "messages": QUESTION + [{"role": "assistant", "content": PREFILL}],
        "extra_body": {"continue_final_message": True, "add_generation_prompt": False, "echo": True}},
     chat_echo),
    ("chat_template_kwargs", "chat", {"extra_body": {"chat_template_kwargs": {"unused_var": 1}}},
     template_kwargs),
    ("chat_stop_matched_stop", "chat", {"stop": ["Paris"]}, chat_stop),
    ("chat_eos_matched_stop", "chat", {"max_tokens": 12}, chat_eos),
    ("chat_prompt_logprobs", "chat", {"n": 2, "extra_body": {"prompt_logprobs": 1}}, chat_prompt_logprobs),
    ("chat_continuous_usage_stats", "chat", {"stream_options": {"continuous_usage_stats": True}},
     chat_continuous_usage),
]


@pytest.mark.parametrize(("route", "kw", "effect"), [pytest.param(r, k, e, id=i) for i, r, k, e in CASES])
def test_stream_matches_non_stream(ctx: Ctx, route: str, kw: Kw, effect: Callable) -> None:
    whole, _, chunks = both(ctx, route, kw(ctx) if callable(kw) else kw)
    effect(ctx, whole, chunks)
