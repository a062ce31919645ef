"""`--grammar-backend xgrammar` end to end (issue 11): a representative subset of the structured
output and tool tests through the official `openai` client against `tokenspeed serve` on CPU with
the default model, and the same greedy requests compared with the llguidance server (the session
`server`): where the two grammars are the same language the masks are the same, so greedy text must
be equal; JSON differs only where xgrammar's whitespace is narrower (see the JSON test)."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import jsonschema
import openai
import pytest

pytest.importorskip("xgrammar", reason="the xgrammar package is not installed (pip install xgrammar)")

from json_schemas import SCHEMAS
from test_e2e_structured import MAX_TOKENS, chat_json
from test_e2e_tools import TOOLS, check_calls
from test_e2e_tools import create as create_chat

from server_harness import Server, start_server, stop_server

SUBSET = (6, 19)  # enums and numbers, an array of objects (schema 0 runs greedy below)


@pytest.fixture(scope="module")
def xserver(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    # The session server's flags, but the other backend.
    srv = start_server(str(tmp_path_factory.mktemp("xgrammar")), "--grammar-backend", "xgrammar",
                       "--page-size", "4", "--max-running-requests", "32", "--max-total-tokens", "16384")
    try:
        yield srv
    finally:
        stop_server(srv)


def client_of(srv: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def xclient(xserver: Server) -> openai.OpenAI:
    return client_of(xserver)


@pytest.fixture(scope="module")
def lclient(server: Server) -> openai.OpenAI:
    return client_of(server)


@pytest.fixture(scope="module")
def model(xclient: openai.OpenAI) -> str:
    return xclient.models.list().data[0].id


def complete(client: openai.OpenAI, model: str, prompt: str, **extra: Any) -> Any:
    return client.completions.create(model=model, prompt=prompt, max_tokens=32, temperature=0,
                                     extra_body=extra)


def test_json_schemas_validate(xclient: openai.OpenAI, model: str) -> None:
    with ThreadPoolExecutor(len(SUBSET)) as pool:  # batched: constrained rows share steps
        outs = list(pool.map(lambda i: chat_json(xclient, model, SCHEMAS[i], False, 0.7), SUBSET))
    for i, (text, finish) in zip(SUBSET, outs):
        assert finish == "stop", f"schema {i}: finish_reason {finish!r} for {text!r}"
        jsonschema.validate(json.loads(text), SCHEMAS[i])


@pytest.mark.parametrize("extra", [
    {"guided_regex": r"[0-9]{3}-[0-9]{4} (ok|fail)"},
    {"regex": r"zz[a-c]{2}Q"},  # nothing the model would write unconstrained
    {"guided_choice": ["positive", "negative", "neutral"]},
    {"ebnf": 'root ::= "(" num ("+" num)* ")"\nnum ::= [1-9]'},
])
def test_same_greedy_text_as_llguidance(xclient: openai.OpenAI, lclient: openai.OpenAI, model: str,
                                        extra: dict[str, Any]) -> None:
    x = complete(xclient, model, "Answer:", **extra)
    ref = complete(lclient, model, "Answer:", **extra)
    assert (x.choices[0].text, x.choices[0].finish_reason) == (ref.choices[0].text, "stop")
    # llguidance ends a request when its grammar is complete; xgrammar lets only eos follow, which
    # ends it one token later (counted) unless the grammar could still go on.
    assert 0 <= x.usage.completion_tokens - ref.usage.completion_tokens <= 1
    if "guided_choice" in extra:
        assert x.choices[0].text in extra["guided_choice"]
    elif "ebnf" not in extra:
        pattern = extra.get("guided_regex") or extra["regex"]
        assert re.fullmatch(pattern, x.choices[0].text), x.choices[0].text


def test_greedy_json_matches_llguidance_where_its_whitespace_allows(
        xclient: openai.OpenAI, lclient: openai.OpenAI, model: str, server: Server) -> None:
    """The default --constrained-json-whitespace-pattern (one space, or a newline and an indent)
    maps to xgrammar's fixed ", " and ": " separators, a subset of it. So each xgrammar mask is a
    subset of llguidance's, and wherever llguidance's greedy pick lies in it both pick the same: if
    xgrammar's grammar accepts the llguidance text, the texts are equal."""
    import xgrammar as xgr
    from transformers import AutoTokenizer

    model_dir = httpx.get(f"{server.url}/get_server_info").json()["model_dir"]
    info = xgr.TokenizerInfo.from_huggingface(AutoTokenizer.from_pretrained(model_dir), vocab_size=49152)
    compiler = xgr.GrammarCompiler(info, max_threads=1)
    for i in (0,):  # an object with a bounded string
        (x, xf), (ref, rf) = (chat_json(c, model, SCHEMAS[i], False, 0.0) for c in (xclient, lclient))
        assert xf == rf == "stop"
        jsonschema.validate(json.loads(x), SCHEMAS[i])
        assert chat_json(xclient, model, SCHEMAS[i], True, 0.0) == (x, xf)  # streamed: the same
        matcher = xgr.GrammarMatcher(compiler.compile_json_schema(json.dumps(SCHEMAS[i]), any_whitespace=False))
        if matcher.accept_string(ref) and matcher.is_completed():
            assert x == ref, f"schema {i}"
        else:  # llguidance took whitespace xgrammar does not allow (or none where it needs ", "):
            # the texts may part there, and only there: where they first differ, one has whitespace.
            c = len(os.path.commonprefix([x, ref]))
            assert ref[c:c + 1].isspace() or x[c:c + 1].isspace(), f"schema {i}: {x!r} vs {ref!r}"


def test_json_object_parses(xclient: openai.OpenAI, model: str) -> None:
    r = xclient.chat.completions.create(model=model, max_tokens=MAX_TOKENS, temperature=0,
                                        response_format={"type": "json_object"},
                                        messages=[{"role": "user", "content": "Describe a cat."}])
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content or ""), dict)


def test_tool_choice_required_returns_valid_calls(xclient: openai.OpenAI) -> None:
    check_calls(create_chat(xclient, tools=TOOLS, tool_choice="required", parallel_tool_calls=False),
                {"get_weather", "get_time"})


def test_invalid_schema_is_the_same_400_under_both_backends(xserver: Server, server: Server,
                                                             model: str) -> None:
    body = {"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}],
            "guided_json": {"type": "object", "properties": {"a": {"type": "strin"}}}}
    x, ref = (httpx.post(f"{s.url}/v1/chat/completions", json=body, timeout=60) for s in (xserver, server))
    assert x.status_code == ref.status_code == 400
    assert x.json() == ref.json() and x.json()["error"]["param"] == "guided_json"
