"""Structured output (issue 11) through the official `openai` client against `tokenspeed serve` on
CPU with the default model: 25 JSON schemas (every output validated with `jsonschema`, streamed
and not), regex, choice and grammar outputs, `client.chat.completions.parse` with a Pydantic
model, SGLang's /generate form, and the 400s for invalid grammars."""

from __future__ import annotations

import json
import re
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import jsonschema
import openai
import pydantic
import pytest
from json_schemas import SCHEMAS

from server_harness import Server

MAX_TOKENS = 160


def schema_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}


def chat_json(client: openai.OpenAI, model: str, schema: dict[str, Any], stream: bool,
              temperature: float) -> tuple[str, str]:
    """(content, finish_reason) of one chat completion under `schema`."""
    kw: dict[str, Any] = {"model": model, "max_tokens": MAX_TOKENS, "temperature": temperature, "seed": 11,
                              "response_format": schema_format(schema),
                              "messages": [{"role": "user", "content": "Answer in JSON."}]}
    if not stream:
        r = client.chat.completions.create(**kw)
        return r.choices[0].message.content or "", r.choices[0].finish_reason
    text, finish = [], ""
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            text.append(c.delta.content or "")
            finish = c.finish_reason or finish
    return "".join(text), finish


@pytest.mark.parametrize("stream,temperature", [(False, 1.0), (True, 0.7)])
def test_25_json_schemas_every_output_validates(client: openai.OpenAI, model: str, stream: bool,
                                                temperature: float) -> None:
    # All at once: the server batches them (constrained requests share steps).
    with ThreadPoolExecutor(len(SCHEMAS)) as pool:
        outs = list(pool.map(lambda s: chat_json(client, model, s, stream, temperature), SCHEMAS))
    for i, (schema, (text, finish)) in enumerate(zip(SCHEMAS, outs)):
        assert finish == "stop", f"schema {i}: finish_reason {finish!r} for {text!r}"
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            raise AssertionError(f"schema {i}: not JSON ({e}): {text!r}") from None
        jsonschema.validate(value, schema)


def test_streamed_equals_non_streamed_under_a_schema(client: openai.OpenAI, model: str) -> None:
    schema = SCHEMAS[13]
    assert chat_json(client, model, schema, False, 0.0) == chat_json(client, model, schema, True, 0.0)


def test_without_a_grammar_the_same_prompt_is_not_json(client: openai.OpenAI, model: str) -> None:
    """The constraint is what makes the outputs above JSON (a test that could not fail otherwise)."""
    r = client.chat.completions.create(model=model, max_tokens=24, temperature=0,
                                       messages=[{"role": "user", "content": "Answer in JSON."}])
    with pytest.raises(json.JSONDecodeError):
        json.loads(r.choices[0].message.content or "")


def test_json_object_mode(client: openai.OpenAI, model: str) -> None:
    r = client.chat.completions.create(model=model, max_tokens=MAX_TOKENS, temperature=0,
                                       response_format={"type": "json_object"},
                                       messages=[{"role": "user", "content": "Describe a cat."}])
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content or ""), dict)


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=16)
    country: str = pydantic.Field(max_length=16)
    population_millions: int = pydantic.Field(ge=0, le=40)


def test_sdk_parse_returns_a_parsed_pydantic_object(client: openai.OpenAI, model: str) -> None:
    r = client.chat.completions.parse(model=model, max_tokens=MAX_TOKENS, temperature=0,
                                      response_format=City,
                                      messages=[{"role": "user", "content": "Name a big city."}])
    city = r.choices[0].message.parsed
    assert isinstance(city, City), r.choices[0].message.content
    assert 0 <= city.population_millions <= 40


@pytest.mark.parametrize("field", ["guided_regex", "regex"])
def test_regex_output_matches(client: openai.OpenAI, model: str, field: str) -> None:
    pattern = r"[0-9]{3}-[0-9]{4} (ok|fail)"
    r = client.completions.create(model=model, prompt="Phone number:", max_tokens=32, temperature=1.0,
                                  seed=3, extra_body={field: pattern})
    assert r.choices[0].finish_reason == "stop"
    assert re.fullmatch(pattern, r.choices[0].text), r.choices[0].text


def test_guided_choice_picks_one_of_the_choices(client: openai.OpenAI, model: str) -> None:
    choices = ["positive", "negative", "neutral"]
    for seed in range(3):
        r = client.chat.completions.create(
            model=model, max_tokens=16, temperature=1.0, seed=seed,
            messages=[{"role": "user", "content": "Sentiment of 'I love it'?"}],
            extra_body={"guided_choice": choices})
        assert r.choices[0].message.content in choices


def test_structured_outputs_and_ebnf_grammars(client: openai.OpenAI, model: str) -> None:
    r = client.completions.create(model=model, prompt="Pick:", max_tokens=16, temperature=1.0, seed=1,
                                  extra_body={"structured_outputs": {"choice": ["left", "right"]}})
    assert r.choices[0].text in ("left", "right")
    grammar = 'root ::= "(" num ("+" num)* ")"\nnum ::= [1-9]'
    r = client.completions.create(model=model, prompt="Sum:", max_tokens=24, temperature=1.0, seed=2,
                                  extra_body={"ebnf": grammar})
    assert re.fullmatch(r"\([1-9](\+[1-9])*\)", r.choices[0].text), r.choices[0].text


def test_sglang_generate_with_a_json_schema_string(server: Server) -> None:
    schema = SCHEMAS[6]
    r = httpx.post(f"{server.url}/generate", timeout=300, json={
        "text": "A point:", "sampling_params": {"max_new_tokens": MAX_TOKENS, "temperature": 0,
                                                "json_schema": json.dumps(schema)}})
    assert r.status_code == 200, r.text
    jsonschema.validate(json.loads(r.json()["text"]), schema)


def idle_engine(server: Server, timeout_s: float = 120) -> dict[str, Any]:
    """The server info once no request runs or waits (earlier tests' aborted streams may still be
    finishing their step)."""
    deadline = time.monotonic() + timeout_s
    while True:
        info = httpx.get(f"{server.url}/get_server_info").json()
        engine = info["engine"]
        if engine["running_requests"] == 0 and engine["waiting_requests"] == 0:
            time.sleep(0.2)  # a plan in flight still counts its step when its result lands
            again = httpx.get(f"{server.url}/get_server_info").json()
            if again["engine"]["steps"] == engine["steps"]:
                return again
        if time.monotonic() > deadline:
            raise AssertionError(f"the engine did not go idle: {engine}")
        time.sleep(0.2)


@pytest.mark.parametrize("body,field", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}},
     "response_format"),
    ({"guided_json": {"type": "object", "properties": {"a": {"type": "strin"}}}}, "guided_json"),
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"ebnf": "root ::= undefined_rule"}, "ebnf"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
])
def test_invalid_grammars_are_400s_naming_the_field(server: Server, model: str, body: dict[str, Any],
                                                    field: str) -> None:
    before = idle_engine(server)
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
        "model": model, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field, err
    assert err["type"] == "invalid_request_error"
    # Refused before the engine saw it: no step ran for it.
    assert httpx.get(f"{server.url}/get_server_info").json()["engine"]["steps"] == before["engine"]["steps"]


def test_constrained_and_free_requests_share_a_batch(client: openai.OpenAI, model: str) -> None:
    """Free requests keep running one step ahead beside constrained ones; both stay correct."""
    free_alone = client.completions.create(model=model, prompt="Once upon a time", max_tokens=24,
                                           temperature=0).choices[0].text

    def free() -> str:
        return client.completions.create(model=model, prompt="Once upon a time", max_tokens=24,
                                         temperature=0).choices[0].text

    with ThreadPoolExecutor(6) as pool:
        frees = [pool.submit(free) for _ in range(3)]
        constrained = [pool.submit(chat_json, client, model, SCHEMAS[i], False, 0.0) for i in (0, 9, 19)]
        assert [f.result() for f in frees] == [free_alone] * 3
        for i, fut in zip((0, 9, 19), constrained):
            text, finish = fut.result()
            assert finish == "stop"
            jsonschema.validate(json.loads(text), SCHEMAS[i])
