"""Issue 31's API fixes through the official `openai` client (raw HTTP where it cannot send the
request) against `tokenspeed serve` on CPU with the default model: forced tools over pydantic's
`$defs`, echoed prompt top logprobs, strict JSON objects by default, the vLLM fields implemented
or refused by name, JSON-only bodies, the shapes other servers send, and the vLLM metrics with
the Grafana dashboard that charts them."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import openai
import pydantic
import pytest

from server_harness import Server

PROMPT = "The capital of France is"
DASHBOARD = Path(__file__).resolve().parents[1] / "deploy" / "grafana" / "tokenspeed.json"


def ids_of(server: Server, text: str) -> list[int]:
    return httpx.post(f"{server.url}/tokenize", json={"prompt": text}).json()["tokens"]


def error_of(server: Server, route: str, body: dict, status: int = 400) -> dict:
    r = httpx.post(f"{server.url}{route}", json=body, timeout=60)
    assert r.status_code == status, r.text
    return r.json()["error"]


# --- 1. tool_choice "required" over pydantic's nested models ---------------------------------

class City(pydantic.BaseModel):
    name: str
    country: str


class Trip(pydantic.BaseModel):
    origin: City
    stops: list[City]


def test_required_tool_choice_keeps_the_schemas_defs_reachable(client: openai.OpenAI,
                                                                model: str) -> None:
    schema = Trip.model_json_schema()
    assert "$defs" in schema, "pydantic nests City under $defs: the case under test"
    tools = [{"type": "function", "function": {"name": n, "parameters": schema}} for n in ("plan", "book")]
    r = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Plan a trip from Paris."}], tools=tools,
        tool_choice="required", max_tokens=200, temperature=0, parallel_tool_calls=False)
    calls = r.choices[0].message.tool_calls
    assert calls and calls[0].function.name in ("plan", "book")
    if r.choices[0].finish_reason == "tool_calls":
        Trip.model_validate_json(calls[0].function.arguments)


# --- 2. echo with logprobs: the prompt's top alternatives -----------------------------------

def test_echo_logprobs_have_top_alternatives_for_the_prompt(server: Server, client: openai.OpenAI,
                                                            model: str) -> None:
    ids = ids_of(server, PROMPT)
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=1, temperature=0, echo=True,
                                  logprobs=3)
    lp = r.choices[0].logprobs
    assert lp.top_logprobs[0] is None and lp.token_logprobs[0] is None
    for own, top in zip(lp.token_logprobs[1:len(ids)], lp.top_logprobs[1:len(ids)]):
        assert len(top) == 3, top
        # lm-evaluation-harness's loglikelihood reads max(top.values()).
        assert max(top.values()) >= own - 1e-4


# --- 3. strict JSON objects by default -------------------------------------------------------

CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


@pytest.fixture(scope="module")
def no_close_brace(server: Server) -> dict[str, int]:
    """A bias against every token holding "}": only a grammar that requires the object to close
    there gets one (an open object would rather run on with invented properties)."""
    from transformers import AutoTokenizer

    from tokenspeed.launch.assets import ensure_default_model

    tok = AutoTokenizer.from_pretrained(str(ensure_default_model()))
    banned = [i for t, i in tok.get_vocab().items() if "}" in tok.convert_tokens_to_string([t])]
    assert 0 < len(banned) <= 1024
    return {str(i): -100 for i in banned}


def test_undeclared_properties_are_refused_on_every_route(client: openai.OpenAI, model: str,
                                                          no_close_brace: dict[str, int]) -> None:
    ask = [{"role": "user", "content": "Where is the Eiffel tower? Answer in JSON."}]
    common = {"model": model, "max_tokens": 40, "temperature": 0, "logit_bias": no_close_brace}
    outputs = {
        "response_format": client.chat.completions.create(
            messages=ask, response_format={"type": "json_schema", "json_schema": {
                "name": "where", "schema": CITY}}, **common).choices[0].message.content,
        "tools": client.chat.completions.create(
            messages=ask, tools=[{"type": "function", "function": {"name": "where", "parameters": CITY}}],
            tool_choice={"type": "function", "function": {"name": "where"}},
            **common).choices[0].message.tool_calls[0].function.arguments,
        "guided_json": client.completions.create(
            prompt='{"city": "Paris"} is', extra_body={"guided_json": CITY}, **common).choices[0].text,
    }
    for route, text in outputs.items():
        assert list(json.loads(text)) == ["city"], (route, text)


# --- 4. vLLM's fields: implemented, or refused by name ---------------------------------------

def test_allowed_token_ids_and_return_token_ids(server: Server, client: openai.OpenAI, model: str) -> None:
    allowed = ids_of(server, " one two three")[-3:]
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=1.0, seed=1,
                                  extra_body={"allowed_token_ids": allowed, "return_token_ids": True})
    c = r.choices[0].model_extra
    assert c["prompt_token_ids"] == ids_of(server, PROMPT)
    assert c["token_ids"] and set(c["token_ids"]) <= set(allowed), c["token_ids"]
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=3, temperature=0,
                                          extra_body={"return_token_ids": True})
    assert len(chat.choices[0].model_extra["token_ids"]) == chat.usage.completion_tokens
    assert len(chat.model_extra["prompt_token_ids"]) == chat.usage.prompt_tokens


def test_truncate_prompt_tokens_keeps_the_last_tokens(server: Server, client: openai.OpenAI,
                                                      model: str) -> None:
    ids = ids_of(server, PROMPT * 4)
    r = client.completions.create(model=model, prompt=PROMPT * 4, max_tokens=3, temperature=0,
                                  extra_body={"truncate_prompt_tokens": 5})
    assert r.usage.prompt_tokens == 5
    alone = client.completions.create(model=model, prompt=ids[-5:], max_tokens=3, temperature=0)
    assert r.choices[0].text == alone.choices[0].text
    assert error_of(server, "/v1/completions", {"prompt": "x", "truncate_prompt_tokens": 0})["param"] \
        == "truncate_prompt_tokens"


@pytest.mark.parametrize(("field", "value", "neutral"), [
    ("use_beam_search", True, False),
    ("logprob_token_ids", [1, 2], []),
    ("kv_transfer_params", {"do_remote_decode": True}, None),
])
def test_unimplemented_vllm_fields_are_refused_by_name(server: Server, field: str, value: object,
                                                       neutral: object) -> None:
    body = {"prompt": "x", "max_tokens": 1}
    assert error_of(server, "/v1/completions", {**body, field: value})["param"] == field
    ok = httpx.post(f"{server.url}/v1/completions", json={**body, field: neutral}, timeout=60)
    assert ok.status_code == 200, ok.text


def test_stop_regex_cuts_the_output_before_its_match(server: Server, client: openai.OpenAI,
                                                     model: str) -> None:
    """SGLang's stop_regex: the output ends right before the first match (found on the
    detokenized text, held back while a match could still start), streamed or not; the
    pattern is reported as matched_stop, as a stop string is."""
    args = {"model": model, "prompt": PROMPT, "max_tokens": 24, "temperature": 0}
    free = client.completions.create(**args).choices[0].text
    word = free.split()[2]  # a word some tokens in: the match spans tokens and ends mid-output
    pattern = r"\s" + re.escape(word[:2]) + "[a-z]*"
    want = free[:re.search(pattern, free).start()]
    r = client.completions.create(**args, extra_body={"stop_regex": pattern})
    choice = r.choices[0]
    assert (choice.text, choice.finish_reason, choice.model_extra["matched_stop"]) == (want, "stop", pattern)
    assert r.usage.completion_tokens < 24
    streamed = client.completions.create(**args, stream=True, extra_body={"stop_regex": [pattern]})
    assert "".join(c.choices[0].text for c in streamed if c.choices) == want
    kept = client.completions.create(**args, extra_body={"stop_regex": pattern,
                                                         "include_stop_str_in_output": True})
    assert kept.choices[0].text.startswith(want) and re.fullmatch(pattern, kept.choices[0].text[len(want):])
    body = {"prompt": "x", "max_tokens": 1}
    for bad in ("(", "a*"):  # does not compile; matches the empty string
        assert error_of(server, "/v1/completions", {**body, "stop_regex": bad})["param"] == "stop_regex"
    assert httpx.post(f"{server.url}/v1/completions", json={**body, "stop_regex": []}, timeout=60).status_code == 200


# --- 5. JSON bodies only; stream_options needs a stream --------------------------------------

def test_non_json_content_types_are_refused(server: Server) -> None:
    body = json.dumps({"prompt": "x", "max_tokens": 1})
    for ctype in ("application/x-www-form-urlencoded", "text/plain"):
        r = httpx.post(f"{server.url}/v1/completions", content=body, headers={"content-type": ctype})
        assert r.status_code == 415, r.text
        assert "application/json" in r.json()["error"]["message"]
    ok = httpx.post(f"{server.url}/v1/completions", content=body,
                    headers={"content-type": "application/json; charset=utf-8"}, timeout=60)
    assert ok.status_code == 200, ok.text


def test_stream_options_need_stream_and_usage_needs_include_usage(server: Server, client: openai.OpenAI,
                                                                  model: str) -> None:
    e = error_of(server, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"}], "stream_options": {"include_usage": True}})
    assert e["param"] == "stream_options"
    chunks = list(client.completions.create(
        model=model, prompt=PROMPT, max_tokens=3, stream=True,
        stream_options={"include_usage": False, "continuous_usage_stats": True}))
    assert all(c.usage is None for c in chunks)


# --- 6. shapes -----------------------------------------------------------------------------

def test_shapes_match_vllm(server: Server, client: openai.OpenAI, model: str) -> None:
    c = client.completions.create(model=model, prompt=PROMPT, max_tokens=1).choices[0].model_extra
    assert "prompt_logprobs" in c and c["prompt_logprobs"] is None
    assert "prompt_token_ids" in c and c["prompt_token_ids"] is None
    chat = httpx.post(f"{server.url}/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}, timeout=60).json()
    assert chat["prompt_logprobs"] is None and chat["prompt_token_ids"] is None
    assert "reasoning_content" in chat["choices"][0]["message"]
    card = client.models.list().data[0]
    assert card.model_extra["root"] == card.id == model


def test_errors_name_the_problem(server: Server) -> None:
    e = error_of(server, "/v1/completions", {"prompt": None, "max_tokens": 1})
    assert e["param"] == "prompt" and "untagged" not in e["message"], e
    assert "string" in e["message"]
    e = error_of(server, "/v1/completions", {"prompt": "x", "logit_bias": {"abc": 1, "def": 2, "1": 500}})
    assert all(k in e["message"] for k in ('"abc"', '"def"', "500")), e


# --- metrics and the dashboard ---------------------------------------------------------------

def metric_names(text: str) -> set[str]:
    return {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and line[0] != "#"}


def test_vllm_metrics_and_the_dashboard(server: Server, client: openai.OpenAI, model: str) -> None:
    client.completions.create(model=model, prompt=PROMPT, max_tokens=2, n=2, temperature=0)
    text = httpx.get(f"{server.url}/metrics").text
    names = metric_names(text)
    for name in ("iteration_tokens_total", "request_params_n", "request_params_max_tokens",
                 "request_num_preemptions", "request_inference_time_seconds",
                 "request_queue_time_seconds", "request_prefill_time_seconds",
                 "request_decode_time_seconds", "request_time_per_output_token_seconds"):
        assert f"tokenspeed:{name}_count" in names, name
    assert "tokenspeed:cache_config_info" in names
    n2 = re.search(r'tokenspeed:request_params_n_bucket\{[^}]*le="2"[^}]*\} (\d+)', text)
    assert n2 and int(n2.group(1)) >= 1, "an n=2 request was counted"
    # Every series the dashboard queries exists (histograms by their _bucket/_sum/_count).
    queried = set(re.findall(r"tokenspeed:[a-z0-9_]+", DASHBOARD.read_text()))
    assert len(queried) > 15
    missing = sorted(q for q in queried if q not in names)
    assert not missing, missing
