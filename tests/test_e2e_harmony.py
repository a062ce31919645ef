"""GPT-OSS's harmony output end to end (issue 34): `tokenspeed serve` on CPU with a tiny random
GPT-OSS checkpoint whose tokenizer (SmolLM2's) has harmony's special tokens added and whose
generation config stops on `<|return|>` and `<|call|>`, as GPT-OSS's does; started with
`--reasoning-parser gpt-oss --tool-call-parser gpt-oss --enable-auto-tool-choice`, queried
through the official `openai` client.

A random model writes no harmony, so the splitting of real answers into reasoning, content and
calls is tested on scripted token streams through the same route in Rust
(rust/server/tests/chat_harmony.rs) and on every split of recorded outputs
(rust/structured/tests/harmony.rs). Here `logit_bias` forces the tokens that matter: the stop
tokens end generation, the markers survive detokenization and reach the parser, and an output
of markers in random order (what a confused or truncated model writes) answers, streamed the
same as not."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from test_e2e_model_families import VOCAB
from test_models_families import GPT_OSS
from test_models_numerics import save_tiny_checkpoint
from tokenizers import AddedToken, Tokenizer

from server_harness import Server, free_port, start_server, stop_server

MARKERS = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>",
           "<|call|>"]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now",
                                          "parameters": {"type": "object",
                                                         "properties": {"city": {"type": "string"}}}}}]
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]


def harmony_checkpoint(path: Path) -> dict[str, int]:
    """A tiny GPT-OSS at `path` with harmony's special tokens; returns their ids."""
    cfg = GPT_OSS.__class__.from_dict({**GPT_OSS.to_dict(), "vocab_size": VOCAB + len(MARKERS),
                                       "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0})
    save_tiny_checkpoint(cfg, path, seed=5)
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(m, special=True, normalized=False) for m in MARKERS])
    tok.save(str(path / "tokenizer.json"))
    ids = {m: tok.token_to_id(m) for m in MARKERS}
    assert sorted(ids.values()) == list(range(VOCAB, VOCAB + len(MARKERS))), ids
    generation = {"bos_token_id": 1, "eos_token_id": [ids["<|return|>"], 2, ids["<|call|>"]]}
    (path / "generation_config.json").write_text(json.dumps(generation))
    return ids


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, int]]:
    path = tmp_path_factory.mktemp("gpt_oss_harmony")
    return path, harmony_checkpoint(path)


@pytest.fixture(scope="module")
def server(checkpoint: tuple[Path, dict[str, int]], tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[Server]:
    path, _ = checkpoint
    srv = start_server(str(tmp_path_factory.mktemp("harmony")), str(path), "--max-total-tokens",
                       "2048", "--context-length", "256", "--reasoning-parser", "gpt-oss",
                       "--tool-call-parser", "gpt-oss", "--enable-auto-tool-choice")
    try:
        yield srv
    finally:
        stop_server(srv)


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def create(client: openai.OpenAI, **kwargs: object) -> openai.types.chat.ChatCompletion:
    args: dict = {"model": client.models.list().data[0].id, "messages": MESSAGES, "tools": TOOLS,
                  "max_tokens": 8, "temperature": 0}
    return client.chat.completions.create(**{**args, **kwargs})


def streamed(client: openai.OpenAI, **kwargs: object) -> tuple[dict, str | None]:
    """The stream reassembled as an OpenAI client does (calls by index), and its finish."""
    out: dict = {"content": "", "reasoning_content": "", "tool_calls": []}
    finish = None
    for chunk in create(client, stream=True, **kwargs):
        choice = chunk.choices[0]
        out["content"] += choice.delta.content or ""
        out["reasoning_content"] += getattr(choice.delta, "reasoning_content", None) or ""
        for c in choice.delta.tool_calls or []:
            if c.index == len(out["tool_calls"]):
                out["tool_calls"].append({"name": c.function.name, "arguments": ""})
            out["tool_calls"][c.index]["arguments"] += c.function.arguments or ""
        finish = choice.finish_reason or finish
    return {k: v or None if k != "tool_calls" else v for k, v in out.items()}, finish


def whole(r: openai.types.chat.ChatCompletion) -> dict:
    m = r.choices[0].message
    return {"content": m.content, "reasoning_content": getattr(m, "reasoning_content", None),
            "tool_calls": [{"name": c.function.name, "arguments": c.function.arguments}
                           for c in m.tool_calls or []]}


@pytest.mark.parametrize("stop", ["<|return|>", "<|call|>"])
def test_harmony_stop_tokens_end_generation(client: openai.OpenAI, checkpoint: tuple,
                                            stop: str) -> None:
    ids = checkpoint[1]
    r = create(client, max_tokens=16, logit_bias={str(ids[stop]): 100})
    assert r.usage.completion_tokens == 1, r
    assert r.choices[0].finish_reason == "stop"
    # The stop token is no part of the answer.
    assert whole(r) == {"content": None, "reasoning_content": None, "tool_calls": []}


def test_markers_survive_detokenization_and_never_show_as_text(client: openai.OpenAI,
                                                                checkpoint: tuple) -> None:
    ids = checkpoint[1]
    for marker in ("<|channel|>", "<|message|>"):
        bias = {str(ids[marker]): 100}
        # Kept by the completions route when asked: the marker is the text.
        text = client.completions.create(model=client.models.list().data[0].id, prompt="Hi",
                                         max_tokens=3, temperature=0, logit_bias=bias,
                                         extra_body={"skip_special_tokens": False}).choices[0].text
        assert text == marker * 3
        # Chat reads them as harmony's structure (headers, empty bodies): nothing to show.
        r = create(client, max_tokens=3, logit_bias=bias)
        assert whole(r) == {"content": None, "reasoning_content": None, "tool_calls": []}
        assert r.choices[0].finish_reason == "length"


def test_harmony_in_random_order_answers_the_same_streamed_or_not(client: openai.OpenAI,
                                                                  checkpoint: tuple) -> None:
    path, ids = checkpoint
    # Markers (not the stop tokens) and the words of a call, sampled in random order: what a
    # confused or truncated model writes.
    words = Tokenizer.from_file(str(path / "tokenizer.json")).encode(
        'analysis final commentary to=functions.get_weather json {"city": "Paris"}').ids
    bias = {str(i): 100 for i in words}
    bias.update({str(ids[m]): 100 for m in MARKERS if m not in ("<|return|>", "<|call|>")})
    for seed, max_tokens in [(7, 6), (8, 24), (9, 48)]:
        args = {"max_tokens": max_tokens, "logit_bias": bias, "temperature": 1.0, "seed": seed}
        r = create(client, **args)
        s, finish = streamed(client, **args)
        assert r.choices[0].finish_reason == finish
        assert s == whole(r)
        for text in (r.choices[0].message.content or "", s["reasoning_content"] or ""):
            assert "<|" not in text, text


def test_mixing_harmony_with_another_format_fails_at_start(checkpoint: tuple,
                                                          tmp_path: Path) -> None:
    path, _ = checkpoint
    cmd = [sys.executable, "-m", "tokenspeed.launch.cli", "serve", "--device", "cpu", str(path),
           "--reasoning-parser", "gpt-oss", "--tool-call-parser", "hermes",
           "--port", str(free_port())]
    out = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=300)
    assert out.returncode != 0
    assert "--tool-call-parser" in out.stdout + out.stderr
