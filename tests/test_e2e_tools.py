"""Tool calling and reasoning output in /v1/chat/completions (issue 11, items 3-5), through the
official `openai` client against `tokenspeed serve` on CPU with the default model.

`tool_choice` "required" and a named function are forced with a grammar, so even a 135M model
returns calls whose arguments validate against the function's schema (checked with `jsonschema`).
The default model never writes `<think>` tags or its own tool-call markup, so splitting those out of
real model text is tested in Rust on recorded outputs (rust/server/src/http/chat_output.rs and
rust/server/tests/chat_tools.rs); here the reasoning server checks what the real model's text
becomes: all reasoning while thinking is on (no think-end was written), all content when off."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import jsonschema
import openai
import pytest

from server_harness import Server, start_server, stop_server

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"utc_offset": {"type": "integer", "minimum": -12, "maximum": 14}},
    "required": ["utc_offset"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "Current time at a UTC offset",
                                      "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
MESSAGES = [{"role": "user", "content": "What is the weather like in Paris right now?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def model_of(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def create(client: openai.OpenAI, **kwargs: object) -> openai.types.chat.ChatCompletion:
    args: dict = {"model": model_of(client), "messages": MESSAGES, "max_tokens": 64, "temperature": 0}
    return client.chat.completions.create(**{**args, **kwargs})


def stream_message(client: openai.OpenAI, **kwargs: object) -> tuple[dict, str | None]:
    """A streamed completion reassembled the way OpenAI clients do (tool calls by index)."""
    content, reasoning, calls, finish = "", "", [], None
    args: dict = {"model": model_of(client), "messages": MESSAGES, "max_tokens": 64, "temperature": 0}
    for chunk in client.chat.completions.create(stream=True, **{**args, **kwargs}):
        choice = chunk.choices[0]
        delta = choice.delta
        content += delta.content or ""
        reasoning += getattr(delta, "reasoning_content", None) or ""
        for c in delta.tool_calls or []:
            if c.index == len(calls):  # the first delta of a call: id, type, name
                assert c.id and c.id.startswith("call_") and c.type == "function", c
                calls.append({"name": c.function.name, "arguments": ""})
            else:
                assert c.id is None and c.function.name is None, c
            calls[c.index]["arguments"] += c.function.arguments or ""
        finish = choice.finish_reason or finish
    return {"content": content or None, "reasoning_content": reasoning or None, "tool_calls": calls}, finish


def whole_message(r: openai.types.chat.ChatCompletion) -> dict:
    m = r.choices[0].message
    return {"content": m.content, "reasoning_content": getattr(m, "reasoning_content", None),
            "tool_calls": [{"name": c.function.name, "arguments": c.function.arguments}
                           for c in m.tool_calls or []]}


def check_calls(r: openai.types.chat.ChatCompletion, names: set[str]) -> None:
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.content is None, choice.message
    assert choice.message.tool_calls, choice.message
    ids = [c.id for c in choice.message.tool_calls]
    assert len(set(ids)) == len(ids) and all(i.startswith("call_") for i in ids), ids
    for call in choice.message.tool_calls:
        assert call.type == "function"
        assert call.function.name in names, call
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_required_returns_calls_valid_against_the_schemas(client: openai.OpenAI) -> None:
    r = create(client, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    check_calls(r, {"get_weather", "get_time"})
    assert len(r.choices[0].message.tool_calls) == 1  # parallel_tool_calls=False: one call


def test_named_function_returns_its_call(client: openai.OpenAI) -> None:
    r = create(client, tools=TOOLS, tool_choice=NAMED)
    check_calls(r, {"get_weather"})
    assert len(r.choices[0].message.tool_calls) == 1


@pytest.mark.parametrize("tool_choice", ["required", NAMED], ids=["required", "named"])
def test_streamed_tool_calls_reassemble_to_the_whole(client: openai.OpenAI, tool_choice: object) -> None:
    args = {"tools": TOOLS, "tool_choice": tool_choice, "parallel_tool_calls": False}
    whole = create(client, **args)
    streamed, finish = stream_message(client, **args)
    assert finish == whole.choices[0].finish_reason == "tool_calls"
    assert streamed == whole_message(whole)


def test_tool_results_render_through_the_template(client: openai.OpenAI) -> None:
    messages = [
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees and sunny"},
    ]
    r = create(client, messages=messages, tools=TOOLS, tool_choice="none", max_tokens=8)
    assert r.choices[0].message.content, r
    assert not r.choices[0].message.tool_calls
    # A tool result without its call id is refused.
    with pytest.raises(openai.BadRequestError) as e:
        create(client, messages=[*messages[:2], {"role": "tool", "content": "18"}], max_tokens=2)
    assert e.value.body["param"] == "messages"


@pytest.mark.parametrize("tool_choice", [None, "auto"])
def test_auto_needs_the_server_flags(server: Server, tool_choice: str | None) -> None:
    body = {"messages": MESSAGES, "tools": TOOLS, "max_tokens": 2}
    if tool_choice:
        body["tool_choice"] = tool_choice
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "tool_choice"
    assert "--enable-auto-tool-choice" in r.json()["error"]["message"]


# --- a server with --reasoning-parser -----------------------------------------------------------

@pytest.fixture(scope="module")
def reasoning_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = start_server(str(tmp_path_factory.mktemp("reasoning")), "--reasoning-parser", "qwen3",
                       "--tool-call-parser", "hermes", "--enable-auto-tool-choice")
    try:
        yield srv
    finally:
        stop_server(srv)


@pytest.fixture(scope="module")
def rclient(reasoning_server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{reasoning_server.url}/v1", api_key="unused", max_retries=0,
                         timeout=120)


def raw_text(server: Server, max_tokens: int) -> str:
    """The model's own text for MESSAGES: the rendered prompt through /v1/completions."""
    ids = httpx.post(f"{server.url}/tokenize", json={"messages": MESSAGES, "add_generation_prompt": True},
                     timeout=30).json()["tokens"]
    r = httpx.post(f"{server.url}/v1/completions", timeout=60,
                   json={"prompt": ids, "max_tokens": max_tokens, "temperature": 0})
    return r.json()["choices"][0]["text"]


def test_reasoning_split_follows_enable_thinking(reasoning_server: Server, rclient: openai.OpenAI) -> None:
    raw = raw_text(reasoning_server, 16)
    assert raw and "</think>" not in raw
    # Thinking on (qwen3's default) and no think-end written: the whole text is reasoning.
    r = create(rclient, max_tokens=16)
    assert whole_message(r) == {"content": None, "reasoning_content": raw, "tool_calls": []}
    assert stream_message(rclient, max_tokens=16)[0] == whole_message(r)
    # Thinking off: the whole text is the answer.
    off = {"max_tokens": 16, "extra_body": {"chat_template_kwargs": {"enable_thinking": False}}}
    r = create(rclient, **off)
    assert whole_message(r) == {"content": raw, "reasoning_content": None, "tool_calls": []}
    assert stream_message(rclient, **off)[0] == whole_message(r)
    # SGLang's separate_reasoning: false leaves the reasoning in the content.
    kept = {"max_tokens": 16, "extra_body": {"separate_reasoning": False}}
    r = create(rclient, **kept)
    assert whole_message(r) == {"content": raw, "reasoning_content": None, "tool_calls": []}
    assert stream_message(rclient, **kept)[0] == whole_message(r)


def test_grammar_after_reasoning(rclient: openai.OpenAI) -> None:
    # This tokenizer has no single </think> token, so a grammar cannot wait for the reasoning
    # to end: refused, naming the field.
    with pytest.raises(openai.BadRequestError) as e:
        create(rclient, tools=TOOLS, tool_choice=NAMED)
    assert e.value.body["param"] == "tool_choice"
    # Thinking off: the grammar applies from the first token and the call comes back.
    r = create(rclient, tools=TOOLS, tool_choice=NAMED,
               extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    check_calls(r, {"get_weather"})


def test_auto_with_the_flags_returns_the_models_text(rclient: openai.OpenAI) -> None:
    # The default model writes no tool-call markup: "auto" leaves its answer as content.
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    r = create(rclient, tools=TOOLS, tool_choice="auto", max_tokens=8, extra_body=off)
    assert r.choices[0].message.content and not r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason in ("stop", "length")
