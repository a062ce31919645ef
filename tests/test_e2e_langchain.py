"""LangChain's `ChatOpenAI` (langchain-openai) against `tokenspeed serve` unchanged, as agent
frameworks use it (issue 31): plain `invoke` and `stream`, `bind_tools` with a forced tool (its
call parsed into `AIMessage.tool_calls`), and `with_structured_output` by function calling and
by JSON schema (a pydantic object back). The default model is tiny, so every structured answer
is forced by the server's grammar; what is checked is that LangChain's requests are accepted
and its parsers read our answers."""

from __future__ import annotations

import pytest
from pydantic import BaseModel, Field

from server_harness import Server

langchain_openai = pytest.importorskip("langchain_openai")


class Weather(BaseModel):
    """The weather in a city."""

    city: str = Field(description="the city's name")
    celsius: int


def chat(server: Server, model: str, max_tokens: int = 48) -> object:
    return langchain_openai.ChatOpenAI(base_url=f"{server.url}/v1", api_key="none", model=model,
                                       temperature=0, max_tokens=max_tokens)


def test_invoke_and_stream(server: Server, model: str) -> None:
    llm = chat(server, model)
    whole = llm.invoke("Say hello.")
    assert isinstance(whole.content, str) and whole.content
    assert whole.response_metadata["finish_reason"] in ("stop", "length")
    pieces = [c.content for c in llm.stream("Say hello.")]
    assert "".join(pieces) == whole.content  # greedy: the stream adds up to the same text


def test_bind_tools_forced_call_is_parsed(server: Server, model: str) -> None:
    llm = chat(server, model).bind_tools([Weather], tool_choice="Weather")
    msg = llm.invoke("What is the weather in Paris?")
    assert len(msg.tool_calls) == 1, msg
    call = msg.tool_calls[0]
    assert call["name"] == "Weather"
    Weather.model_validate(call["args"])  # the arguments satisfy the tool's schema


@pytest.mark.parametrize("method", ["function_calling", "json_schema"])
def test_with_structured_output(server: Server, model: str, method: str) -> None:
    llm = chat(server, model, max_tokens=64).with_structured_output(Weather, method=method)
    out = llm.invoke("What is the weather in Paris?")
    assert isinstance(out, Weather)
