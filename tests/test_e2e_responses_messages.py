"""`/v1/responses` (OpenAI's Responses API) and `/v1/messages` (Anthropic's Messages API), issue 31,
through the official `openai` and `anthropic` clients against `tokenspeed serve` on CPU with the default
model. Both routes are adapters over the chat pipeline, so forced tool calls and JSON schemas are grammar-
constrained and validate even from a 135M model. Reasoning items, calls parsed from the model's own markup
(tool_choice auto) and the `x-api-key` header are tested in Rust on scripted model output
(rust/server/tests/chat_tools.rs): the default model writes neither think tags nor tool-call markup."""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import openai
import pytest

from server_harness import Server

# Small schemas keep the constrained answers (and the CPU test) short.
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"],
        "additionalProperties": False}
WEATHER = CITY
QUESTION = "What is the weather like in Paris right now?"
TOOL = {"type": "function", "name": "get_weather", "description": "Current weather in a city",
        "parameters": WEATHER}
FORCED = {"type": "function", "name": "get_weather"}
ANTHROPIC_TOOL = {"name": "get_weather", "description": "Current weather in a city", "input_schema": WEATHER}
TEXT_EVENTS = ["response.created", "response.in_progress", "response.output_item.added",
               "response.content_part.added"]
TEXT_END = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]


@pytest.fixture(scope="module")
def claude(server: Server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=120)


def respond(client: openai.OpenAI, model: str, **kwargs: object) -> openai.types.responses.Response:
    args: dict = {"model": model, "input": QUESTION, "max_output_tokens": 16, "temperature": 0}
    return client.responses.create(**{**args, **kwargs})


# --- /v1/responses ------------------------------------------------------------------------------------


def test_text_with_instructions(client: openai.OpenAI, model: str) -> None:
    r = respond(client, model, instructions="Answer in one word.", input="Say hello", max_output_tokens=6)
    assert r.object == "response" and r.id.startswith("resp_"), r
    assert r.status in ("completed", "incomplete") and r.output_text, r
    assert r.instructions == "Answer in one word." and r.model == model
    item = r.output[0]
    assert item.type == "message" and item.role == "assistant" and item.content[0].type == "output_text"
    u = r.usage
    assert u.output_tokens > 0 and u.total_tokens == u.input_tokens + u.output_tokens
    if r.status == "incomplete":
        assert r.incomplete_details.reason == "max_output_tokens"
    # The instructions reach the model (as the system message): longer ones make a longer prompt.
    longer = respond(client, model, instructions="Answer in one word, politely and briefly.", input="Say hello",
                     max_output_tokens=1)
    assert longer.usage.input_tokens > r.usage.input_tokens
    bare = respond(client, model, input="Say hello", max_output_tokens=1)
    # Message items (typed parts) are the same input as the string.
    items = respond(client, model, max_output_tokens=1,
                    input=[{"role": "user", "content": [{"type": "input_text", "text": "Say hello"}]}])
    assert items.usage.input_tokens == bare.usage.input_tokens


def test_json_schema_text_format(client: openai.OpenAI, model: str) -> None:
    fmt = {"format": {"type": "json_schema", "name": "city", "schema": CITY, "strict": True}}
    r = respond(client, model, text=fmt, max_output_tokens=64)
    assert r.status == "completed", r
    jsonschema.validate(json.loads(r.output_text), CITY)
    assert r.text.format.type == "json_schema"


def test_forced_tool_call_and_its_output(client: openai.OpenAI, model: str) -> None:
    r = respond(client, model, tools=[TOOL], tool_choice=FORCED, max_output_tokens=64)
    calls = [i for i in r.output if i.type == "function_call"]
    assert r.status == "completed" and len(calls) == 1, r
    call = calls[0]
    assert call.name == "get_weather" and call.call_id.startswith("call_"), call
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    # The result goes back as a function_call_output item, continuing the stored response.
    follow = respond(client, model, previous_response_id=r.id, tools=[TOOL], tool_choice="none",
                     input=[{"type": "function_call_output", "call_id": call.call_id,
                             "output": "18 degrees and sunny"}], max_output_tokens=4)
    assert follow.output[0].type == "message" and follow.output_text, follow
    assert follow.usage.input_tokens > r.usage.input_tokens


def test_previous_response_chain_get_and_delete(client: openai.OpenAI, model: str) -> None:
    first = respond(client, model, input="My name is Ada.", max_output_tokens=4)
    second = respond(client, model, input="What is my name?", previous_response_id=first.id,
                     max_output_tokens=4)
    assert second.previous_response_id == first.id
    # The second prompt holds the first turn (its input and output) and the new input.
    alone = respond(client, model, input="What is my name?", max_output_tokens=1)
    assert second.usage.input_tokens > alone.usage.input_tokens + first.usage.output_tokens + 4
    got = client.responses.retrieve(first.id)
    assert got.id == first.id and got.output_text == first.output_text
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.BadRequestError) as e:
        respond(client, model, input="again", previous_response_id=first.id)
    assert e.value.body["param"] == "previous_response_id"
    unstored = respond(client, model, input="hi", store=False, max_output_tokens=1)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_stream_events_reassemble_to_the_response(client: openai.OpenAI, model: str) -> None:
    events = list(respond(client, model, input="Say hello", max_output_tokens=8, stream=True))
    kinds = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert kinds[:4] == TEXT_EVENTS, kinds
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert deltas and kinds[4:4 + len(deltas)] == ["response.output_text.delta"] * len(deltas)
    assert kinds[4 + len(deltas):] == [*TEXT_END, kinds[-1]], kinds
    assert kinds[-1] in ("response.completed", "response.incomplete")
    final = events[-1].response
    assert "".join(d.delta for d in deltas) == final.output_text == events[-4].text
    assert final.usage.output_tokens > 0


def test_sdk_stream_helper(client: openai.OpenAI, model: str) -> None:
    fmt = {"format": {"type": "json_schema", "name": "city", "schema": CITY, "strict": True}}
    with client.responses.stream(model=model, input=QUESTION, text=fmt, max_output_tokens=64,
                                 temperature=0) as stream:
        text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert final.status == "completed" and final.output_text == text
    jsonschema.validate(json.loads(text), CITY)
    with client.responses.stream(model=model, input=QUESTION, tools=[TOOL], tool_choice=FORCED,
                                 max_output_tokens=64, temperature=0) as stream:
        args = "".join(e.delta for e in stream if e.type == "response.function_call_arguments.delta")
        final = stream.get_final_response()
    call = final.output[0]
    assert call.type == "function_call" and call.name == "get_weather" and call.arguments == args
    jsonschema.validate(json.loads(args), WEATHER)


def test_unbuilt_fields_are_refused_by_name(client: openai.OpenAI, model: str) -> None:
    for extra, param in [({"background": True}, "background"), ({"truncation": "auto"}, "truncation"),
                         ({"reasoning": {"effort": "high"}}, "reasoning"),
                         ({"tools": [{"type": "web_search"}]}, "tools"),
                         ({"max_output_tokens": 0}, "max_output_tokens")]:
        with pytest.raises(openai.BadRequestError) as e:
            respond(client, model, **extra)
        assert e.value.body["param"] == param, (extra, e.value.body)
    # Their neutral values are accepted.
    r = respond(client, model, max_output_tokens=1, extra_body={"background": False, "truncation": "disabled"})
    assert r.status in ("completed", "incomplete")




LOGPROBS = ["message.output_text.logprobs"]


def _entries(logprobs: list) -> list[tuple]:
    return [(e.token, e.logprob, [(t.token, t.logprob) for t in e.top_logprobs]) for e in logprobs]


def _same(got: list[tuple], want: list[tuple]) -> None:
    """Equal tokens; logprobs within 1e-4 (a cached and an uncached prefill may round apart)."""
    assert [(t, [a for a, _ in top]) for t, _, top in got] == [(t, [a for a, _ in top]) for t, _, top in want]
    flat = [(lp, *[b for _, b in top]) for _, lp, top in got]
    ref = [(lp, *[b for _, b in top]) for _, lp, top in want]
    assert all(x == pytest.approx(y, abs=1e-4) for a, b in zip(flat, ref) for x, y in zip(a, b)), (got, want)


def test_output_text_logprobs_are_the_chat_routes(client: openai.OpenAI, model: str) -> None:
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Say hello"}],
                                          max_tokens=6, temperature=0, logprobs=True, top_logprobs=3)
    want = _entries(chat.choices[0].logprobs.content)
    assert len(want) == chat.usage.completion_tokens and all(len(top) == 3 for *_, top in want)
    r = respond(client, model, input="Say hello", max_output_tokens=6, include=LOGPROBS, top_logprobs=3)
    assert r.output_text == chat.choices[0].message.content and r.top_logprobs == 3
    _same(_entries(r.output[0].content[0].logprobs), want)
    events = list(respond(client, model, input="Say hello", max_output_tokens=6, include=LOGPROBS,
                          top_logprobs=3, stream=True))
    deltas = [lp for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    _same(_entries(deltas), want)
    _same(_entries(events[-1].response.output[0].content[0].logprobs), want)
    assert respond(client, model, input="Say hello", max_output_tokens=2).output[0].content[0].logprobs == []
    for extra, param in [({"top_logprobs": 2}, "top_logprobs"), ({"include": ["reasoning.encrypted_content"]},
                                                                 "include")]:
        with pytest.raises(openai.BadRequestError) as e:
            respond(client, model, **extra)
        assert e.value.body["param"] == param, e.value.body


# --- /v1/messages -------------------------------------------------------------------------------------


def ask(claude: anthropic.Anthropic, model: str, **kwargs: object) -> anthropic.types.Message:
    # This SDK has no sampling parameters: they go in the body, as Anthropic's API defines them.
    args: dict = {"model": model, "max_tokens": 16, "extra_body": {"temperature": 0, "top_k": 1},
                  "messages": [{"role": "user", "content": QUESTION}]}
    return claude.messages.create(**{**args, **kwargs})


def test_messages_text(claude: anthropic.Anthropic, model: str) -> None:
    m = ask(claude, model, system="Answer briefly.", max_tokens=6)
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_"), m
    assert m.content[0].type == "text" and m.content[0].text, m
    assert m.stop_reason in ("end_turn", "max_tokens") and m.usage.output_tokens > 0
    stopped = ask(claude, model, stop_sequences=[" "], max_tokens=32,
                  system=[{"type": "text", "text": "Answer briefly."}])
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == " ", stopped
    assert " " not in stopped.content[0].text


def test_messages_tool_use_and_result(claude: anthropic.Anthropic, model: str) -> None:
    m = ask(claude, model, tools=[ANTHROPIC_TOOL], tool_choice={"type": "tool", "name": "get_weather"},
            max_tokens=64)
    assert m.stop_reason == "tool_use", m
    use = [b for b in m.content if b.type == "tool_use"]
    assert len(use) == 1 and use[0].name == "get_weather" and use[0].id.startswith("toolu_"), m
    jsonschema.validate(use[0].input, WEATHER)
    follow = ask(claude, model, tools=[ANTHROPIC_TOOL], messages=[
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": [{"type": "tool_use", "id": use[0].id, "name": "get_weather",
                                           "input": use[0].input}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use[0].id,
                                      "content": "18 degrees and sunny"}]}],
        tool_choice={"type": "none"}, max_tokens=4)
    assert follow.content[0].type == "text" and follow.content[0].text, follow
    assert follow.usage.input_tokens > m.usage.input_tokens


def test_messages_stream(claude: anthropic.Anthropic, model: str) -> None:
    with claude.messages.stream(model=model, max_tokens=8, extra_body={"temperature": 0},
                                messages=[{"role": "user", "content": "Say hello"}]) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text and final.content[0].text == text, final
    assert final.stop_reason in ("end_turn", "max_tokens") and final.usage.output_tokens > 0
    with claude.messages.stream(model=model, max_tokens=64, extra_body={"temperature": 0}, tools=[ANTHROPIC_TOOL],
                                tool_choice={"type": "any", "disable_parallel_tool_use": True},
                                messages=[{"role": "user", "content": QUESTION}]) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use" and final.content[0].type == "tool_use", final
    jsonschema.validate(final.content[0].input, WEATHER)
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"], kinds
    assert "input_json" in kinds and "content_block_stop" in kinds, kinds


def test_messages_count_tokens_is_the_prompt_messages_renders(claude: anthropic.Anthropic, model: str) -> None:
    body = {"system": "Answer briefly.", "tools": [ANTHROPIC_TOOL],
            "tool_choice": {"type": "tool", "name": "get_weather"},
            "messages": [{"role": "user", "content": QUESTION}]}
    counted = claude.messages.count_tokens(model=model, **body)
    assert counted.input_tokens == ask(claude, model, max_tokens=1, **body).usage.input_tokens
    longer = claude.messages.count_tokens(model=model, **{**body, "system": "Answer briefly and politely."})
    assert longer.input_tokens > counted.input_tokens
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.count_tokens(model="no-such-model", **body)


def test_messages_errors_take_anthropics_shape(server: Server, claude: anthropic.Anthropic,
                                               model: str) -> None:
    r = httpx.post(f"{server.url}/v1/messages", json={"model": model, "messages": [
        {"role": "user", "content": "hi"}]}, timeout=30)
    assert r.status_code == 400, r.text
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error", body
    assert "max_tokens" in body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as e:
        ask(claude, model, messages=[{"role": "user", "content": [{"type": "image", "source": {}}]}])
    assert e.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.BadRequestError) as e:
        ask(claude, model, thinking={"type": "enabled", "budget_tokens": 1024})
    assert "thinking" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError):
        ask(claude, model="no-such-model")

