"""End to end: `tokenspeed serve` (Rust HTTP + scheduler + radix cache, shm, Python worker on
CPU, the real SmolLM2-135M-Instruct) driven by the official `openai` client."""

from __future__ import annotations

import json
import re
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from server_harness import Server

QUESTION = "What is the capital of France?"


def model_name(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def wait_idle_and_flush(server: Server, timeout_s: float = 30) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        info = server.info()
        if info["engine"]["running_requests"] == 0 and info["engine"]["waiting_requests"] == 0:
            r = httpx.post(f"{server.url}/flush_cache", timeout=10)
            if r.status_code == 200:
                return server.info()
        time.sleep(0.2)
    raise AssertionError(f"server never went idle: {server.info()}")


def test_chat_names_paris(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=model_name(client), messages=[{"role": "user", "content": QUESTION}], temperature=0, max_tokens=40
    )
    answer = r.choices[0].message.content
    assert "Paris" in answer, answer
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens > 5 and r.usage.completion_tokens > 0


def test_chat_stream_matches_non_stream(client: openai.OpenAI) -> None:
    kwargs = {"model": model_name(client), "messages": [{"role": "user", "content": QUESTION}], "temperature": 0,
              "max_tokens": 40}
    full = client.chat.completions.create(**kwargs).choices[0].message.content
    pieces, finish = [], None
    for chunk in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs):
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
    assert "".join(pieces) == full
    assert "Paris" in full
    assert finish in ("stop", "length")


def test_completions_stream_and_not(client: openai.OpenAI) -> None:
    prompt = "The capital of France is"
    r = client.completions.create(model=model_name(client), prompt=prompt, max_tokens=12, temperature=0)
    text = r.choices[0].text
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 12
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=model_name(client), prompt=prompt, max_tokens=12, temperature=0, stream=True) if c.choices)
    assert streamed == text
    assert "Paris" in text


def test_stop_string_is_not_emitted(client: openai.OpenAI) -> None:
    kwargs = {"model": model_name(client), "messages": [{"role": "user", "content": QUESTION}], "temperature": 0,
              "max_tokens": 40}
    full = client.chat.completions.create(**kwargs).choices[0].message.content
    assert "Paris" in full
    r = client.chat.completions.create(stop=["Paris"], **kwargs)
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content == full[: full.index("Paris")]
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        stop=["Paris"], stream=True, **kwargs) if c.choices)
    assert streamed == full[: full.index("Paris")]


def test_sixteen_concurrent_requests_are_batched(server: Server, client: openai.OpenAI) -> None:
    prompts = [f"Count from {i} to {i + 5}:" for i in range(20)]
    name = model_name(client)

    def one(p: str) -> str:
        return client.completions.create(model=name, prompt=p, max_tokens=16, temperature=0).choices[0].text

    before = server.info()["engine"]["max_batch_size"]
    with ThreadPoolExecutor(20) as pool:
        together = list(pool.map(one, prompts))
    assert server.info()["engine"]["max_batch_size"] >= 16 > before or server.info()["engine"]["max_batch_size"] >= 16
    # Each batched answer equals the same request served alone.
    alone = [one(p) for p in prompts[:4]]
    assert together[:4] == alone
    assert all(len(t) > 0 for t in together)


def test_repeated_prompt_reports_cached_tokens(server: Server, client: openai.OpenAI) -> None:
    messages = [{"role": "system", "content": "You are a helpful assistant who answers briefly. " * 4},
                {"role": "user", "content": QUESTION}]
    first = client.chat.completions.create(model=model_name(client), messages=messages, temperature=0, max_tokens=8)
    second = client.chat.completions.create(model=model_name(client), messages=messages, temperature=0, max_tokens=8)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= first.usage.prompt_tokens // 2, (cached, first.usage.prompt_tokens)
    metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
    counted = re.search(r"^tokenspeed:prefix_cache_hits_total\{[^}]*\} (\S+)$", metrics, re.MULTILINE)
    assert counted and float(counted.group(1)) >= cached, "the cache hit is counted in /metrics"
    assert second.choices[0].message.content == first.choices[0].message.content


def test_native_generate_tokenize_detokenize(server: Server) -> None:
    r = httpx.post(f"{server.url}/generate", json={
        "text": "The capital of France is", "sampling_params": {"max_new_tokens": 8, "temperature": 0}}, timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    assert len(body["output_ids"]) == 8 and body["meta_info"]["finish_reason"]["type"] == "length"
    tok = httpx.post(f"{server.url}/tokenize", json={"prompt": "Hello world"}, timeout=10).json()
    assert tok["count"] == len(tok["tokens"]) > 0
    detok = httpx.post(f"{server.url}/detokenize", json={"tokens": tok["tokens"]}, timeout=10).json()
    assert detok["text"] == "Hello world"
    ids = httpx.post(f"{server.url}/generate", json={
        "input_ids": tok["tokens"], "sampling_params": {"max_new_tokens": 4, "temperature": 0}}, timeout=60).json()
    assert len(ids["output_ids"]) == 4
    with httpx.stream("POST", f"{server.url}/generate", json={
            "text": "The capital of France is", "stream": True,
            "sampling_params": {"max_new_tokens": 8, "temperature": 0}}, timeout=60) as s:
        events = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["text"] == body["text"]


def test_info_endpoints(server: Server, client: openai.OpenAI) -> None:
    models = client.models.list().data
    assert len(models) == 1
    info = httpx.get(f"{server.url}/get_model_info", timeout=10).json()
    assert info["is_generation"] is True
    metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
    assert "tokenspeed:generation_tokens_total" in metrics
    kv = server.info()["kv_pages"]
    assert kv["total"] == kv["free"] + kv["used"] + kv["cached"] > 0


@pytest.mark.parametrize(
    ("body", "status", "needle"),
    [
        (b"{not json", 400, "invalid JSON"),
        (json.dumps({"model": "x"}).encode(), 400, "messages"),
        (json.dumps({"messages": "hi"}).encode(), 400, "messages"),
        (json.dumps({"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}).encode(), 400,
         "temperature"),
        (json.dumps({"messages": [{"role": "user", "content": "hi"}], "model": "no-such-model"}).encode(), 404,
         "no-such-model"),
        (json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1000000}).encode(), 400,
         "1000000"),
        (json.dumps({"messages": [{"role": "user", "content": "hi"}], "n": 1000}).encode(), 400, "n"),
    ],
)
def test_bad_input_gets_openai_error(server: Server, body: bytes, status: int, needle: str) -> None:
    r = httpx.post(f"{server.url}/v1/chat/completions", content=body,
                   headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"}
    assert needle in err["message"] or needle == err["param"], err


def test_too_long_prompt_names_both_numbers(server: Server) -> None:
    context = server.info()["context_length"]
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": [1] * (context + 5), "max_tokens": 4}, timeout=30)
    assert r.status_code == 400
    msg = r.json()["error"]["message"]
    assert str(context + 5) in msg and str(context) in msg


def test_bad_requests_do_not_disturb_requests_in_flight(server: Server, client: openai.OpenAI) -> None:
    name = model_name(client)
    ref = client.completions.create(model=name, prompt="One, two, three,", max_tokens=24, temperature=0).choices[0].text
    with ThreadPoolExecutor(8) as pool:
        good = [pool.submit(lambda: client.completions.create(
            model=name, prompt="One, two, three,", max_tokens=24, temperature=0).choices[0].text) for _ in range(3)]
        bad = [pool.submit(httpx.post, f"{server.url}/v1/completions", content=b"{oops", timeout=30)
               for _ in range(5)]
        assert all(b.result().status_code == 400 for b in bad)
        assert [g.result() for g in good] == [ref] * 3


def test_client_disconnect_frees_pages(server: Server, client: openai.OpenAI) -> None:
    stream = client.completions.create(model=model_name(client), prompt="Once upon a time", max_tokens=2000,
                                       temperature=0.8, stream=True, extra_body={"ignore_eos": True})
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()
    info = wait_idle_and_flush(server)
    kv = info["kv_pages"]
    assert kv["free"] == kv["total"], kv


def test_client_gone_mid_non_streaming_request_frees_pages(server: Server) -> None:
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", timeout=2, json={
            "prompt": "Once upon a time", "max_tokens": 3000, "ignore_eos": True})
    info = wait_idle_and_flush(server, timeout_s=10)
    kv = info["kv_pages"]
    assert kv["free"] == kv["total"], kv


def test_all_pages_free_after_flush(server: Server) -> None:
    info = wait_idle_and_flush(server)
    kv = info["kv_pages"]
    assert kv["free"] == kv["total"] and kv["used"] == 0 and kv["cached"] == 0, kv


# --- the step protocol's bug fixes (issue 9), with the real model ---------------------------


def greedy_ids(server: Server, prompt: str, n: int, **params: object) -> dict:
    r = httpx.post(f"{server.url}/generate", json={
        "text": prompt, "sampling_params": {"max_new_tokens": n, "temperature": 0, **params}}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_stop_token_ids_stop_even_with_ignore_eos(server: Server, client: openai.OpenAI) -> None:
    ids = greedy_ids(server, "The capital of France is", 8)["output_ids"]
    stop = ids[3]
    first = ids.index(stop)
    out = client.completions.create(model=model_name(client), prompt="The capital of France is",
                                    max_tokens=8, temperature=0,
                                    extra_body={"ignore_eos": True, "stop_token_ids": [stop]})
    assert out.choices[0].finish_reason == "stop"
    assert out.usage.completion_tokens == first + 1


def test_min_tokens_holds_off_the_end_on_every_route(server: Server, client: openai.OpenAI) -> None:
    chat = [{"role": "user", "content": "Reply with the single word OK."}]
    free = client.chat.completions.create(model=model_name(client), messages=chat, max_tokens=96, temperature=0)
    natural = free.usage.completion_tokens
    assert free.choices[0].finish_reason == "stop" and natural < 80, natural
    want = natural + 10
    held = client.chat.completions.create(model=model_name(client), messages=chat, max_tokens=96,
                                          temperature=0, extra_body={"min_tokens": want})
    assert held.usage.completion_tokens >= want
    done = client.completions.create(model=model_name(client), prompt="Hi", max_tokens=96, temperature=0,
                                     extra_body={"min_tokens": want})
    assert done.usage.completion_tokens >= want
    native = greedy_ids(server, "Hi", 96, min_new_tokens=want)
    assert native["meta_info"]["completion_tokens"] >= want


def test_generate_returns_logprobs_like_completions(server: Server, client: openai.OpenAI) -> None:
    r = httpx.post(f"{server.url}/generate", json={
        "text": "The capital of France is", "return_logprob": True, "top_logprobs_num": 2,
        "sampling_params": {"max_new_tokens": 5, "temperature": 0}}, timeout=60).json()
    lps = r["meta_info"]["output_token_logprobs"]
    assert [t for _, t, _ in lps] == r["output_ids"]
    assert all(len(top) == 2 and top[0][0] >= top[1][0] for top in r["meta_info"]["output_top_logprobs"])
    ref = client.completions.create(model=model_name(client), prompt="The capital of France is",
                                    max_tokens=5, temperature=0, logprobs=1)
    assert ref.choices[0].logprobs.token_logprobs == pytest.approx([lp for lp, _, _ in lps], abs=1e-4)


def test_metrics_route_is_served_with_enable_metrics(server: Server) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    names = {f.name for f in text_string_to_metric_families(text)}
    assert "tokenspeed:generation_tokens" in names
