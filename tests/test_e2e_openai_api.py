"""The OpenAI API surface clients rely on (issue 10), through the official `openai` client against
`tokenspeed serve` on CPU with the default model: n, batched prompts, echo, logit_bias, the vLLM
extras, chat roles and prefill, and the 400s for what is not implemented."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import torch

from server_harness import Server

PROMPT = "The capital of France is"


def greedy_text(client: openai.OpenAI, model: str, prompt: str | list[int], max_tokens: int = 5) -> str:
    r = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0)
    return r.choices[0].text


def test_n_gives_n_choices_sharing_one_prefill(server: Server, client: openai.OpenAI, model: str) -> None:
    prompt = "Once upon a time, in a land far away, there lived a small dragon who " * 2
    r = client.completions.create(model=model, prompt=prompt, max_tokens=4, n=4, temperature=1.0,
                                  seed=7)
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    assert all(c.finish_reason == "length" for c in r.choices)
    assert r.usage.completion_tokens == 16
    # Prompt counted once; its later samples read its pages from the radix cache.
    prompt_len = len(httpx.post(f"{server.url}/tokenize", json={"prompt": prompt}).json()["tokens"])
    assert r.usage.prompt_tokens == prompt_len
    assert r.usage.prompt_tokens_details.cached_tokens >= prompt_len - 8
    # Same seed, same texts (both runs read the prompt from the cache: a cached and an uncached
    # prefill may round differently, which can flip a temperature-1 draw).
    runs = [client.completions.create(model=model, prompt=prompt, max_tokens=4, n=4,
                                      temperature=1.0, seed=7) for _ in range(2)]
    assert [c.text for c in runs[0].choices] == [c.text for c in runs[1].choices]
    assert len({c.text for c in r.choices}) > 1, "seeded samples must differ from one another"


def test_batched_prompts_index_choices_prompt_major(client: openai.OpenAI, model: str) -> None:
    prompts = [PROMPT, "1, 2, 3, 4,", "Hello"]
    # best_of equal to n is accepted (it ranks nothing); any other value is a 400 (below).
    r = client.completions.create(model=model, prompt=prompts, max_tokens=4, n=2, best_of=2, temperature=0)
    assert len(r.choices) == 6
    by_index = {c.index: c.text for c in r.choices}
    for i, p in enumerate(prompts):
        alone = greedy_text(client, model, p, 4)
        assert by_index[2 * i] == by_index[2 * i + 1] == alone, (i, p)


def test_token_id_prompts_batched(server: Server, client: openai.OpenAI, model: str) -> None:
    ids = httpx.post(f"{server.url}/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    r = client.completions.create(model=model, prompt=[ids, ids[:3]], max_tokens=3, temperature=0)
    assert [c.index for c in r.choices] == [0, 1]
    assert r.choices[0].text == greedy_text(client, model, ids, 3)
    assert r.choices[1].text == greedy_text(client, model, ids[:3], 3)


def test_stream_matches_non_stream_for_several_choices(client: openai.OpenAI, model: str) -> None:
    args = {"model": model, "prompt": [PROMPT, "Hello"], "max_tokens": 5, "n": 2, "temperature": 0.8,
            "seed": 3}
    whole = client.completions.create(**args)
    texts: dict[int, str] = {}
    finishes: dict[int, str] = {}
    usage = None
    for chunk in client.completions.create(stream=True, stream_options={"include_usage": True},
                                           **args):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason:
                finishes[c.index] = c.finish_reason
    assert texts == {c.index: c.text for c in whole.choices}
    assert finishes == {c.index: c.finish_reason for c in whole.choices}
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens


def test_echo_prepends_the_prompt(client: openai.OpenAI, model: str) -> None:
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=4, temperature=0, echo=True)
    assert r.choices[0].text == PROMPT + greedy_text(client, model, PROMPT, 4)
    chunks = client.completions.create(model=model, prompt=PROMPT, max_tokens=4, temperature=0,
                                       echo=True, stream=True)
    assert "".join(c.choices[0].text for c in chunks) == r.choices[0].text


def test_logit_bias_forces_and_forbids_tokens(server: Server, client: openai.OpenAI, model: str) -> None:
    forced = httpx.post(f"{server.url}/tokenize",
                        json={"prompt": " banana", "add_special_tokens": False}).json()["tokens"][0]
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=3, temperature=0,
                                  logit_bias={str(forced): 100})
    assert r.choices[0].text == httpx.post(f"{server.url}/detokenize",
                                           json={"tokens": [forced] * 3}).json()["text"]
    first = client.completions.create(model=model, prompt=PROMPT, max_tokens=1, temperature=0,
                                      logprobs=0)
    top = httpx.post(f"{server.url}/tokenize", json={
        "prompt": first.choices[0].logprobs.tokens[0], "add_special_tokens": False}).json()["tokens"][0]
    banned = client.completions.create(model=model, prompt=PROMPT, max_tokens=1, temperature=0,
                                       logit_bias={str(top): -100})
    assert banned.choices[0].text != first.choices[0].text


@pytest.fixture(scope="module")
def hf_model() -> object:
    transformers = pytest.importorskip("transformers")
    from tokenspeed.launch.assets import ensure_default_model
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(ensure_default_model()), torch_dtype=torch.float32).eval()


def test_prompt_logprobs_and_echo_match_hf(server: Server, client: openai.OpenAI, model: str,
                                           hf_model: object) -> None:
    ids = httpx.post(f"{server.url}/tokenize", json={"prompt": PROMPT * 3}).json()["tokens"]
    with torch.no_grad():
        ref = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), dim=-1)  # type: ignore[operator]
    want = [ref[i - 1, ids[i]].item() for i in range(1, len(ids))]
    r = client.completions.create(model=model, prompt=ids, max_tokens=2, temperature=0, logprobs=2,
                                  echo=True, extra_body={"prompt_logprobs": 3})
    lp = r.choices[0].logprobs
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:len(ids)] == pytest.approx(want, abs=1e-3)
    assert all(len(t) == 2 for t in lp.top_logprobs[1:])
    assert len(lp.tokens) == len(ids) + 2
    assert r.choices[0].text.startswith(httpx.post(f"{server.url}/detokenize",
                                                   json={"tokens": ids}).json()["text"])
    # vLLM's prompt_logprobs: null first, then the prompt token and the top 3 by id.
    plp = r.choices[0].model_extra["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(ids)
    for i, entry in enumerate(plp[1:], start=1):
        assert entry[str(ids[i])]["logprob"] == pytest.approx(want[i - 1], abs=1e-3)
        ranked = sorted((e["rank"], e["logprob"]) for e in entry.values() if e["rank"] <= 3)
        assert [rank for rank, _ in ranked] == [1, 2, 3]
        top = ref[i - 1].topk(3).values.tolist()
        assert [v for _, v in ranked] == pytest.approx(top, abs=1e-3)
        # The prompt token's own rank, inside the top 3 or not: HF's, up to logprobs within the
        # tolerance of the token's own (their order may differ between the two computations).
        rank = entry[str(ids[i])]["rank"]
        own = ref[i - 1, ids[i]].item()
        assert int((ref[i - 1] > own + 1e-3).sum()) + 1 <= rank <= int((ref[i - 1] > own - 1e-3).sum()) + 1
    # The generated (greedy) tokens' logprobs and top alternatives too.
    gen = ids + [int(ref[-1].argmax())]
    with torch.no_grad():
        last = torch.log_softmax(hf_model(torch.tensor([gen])).logits[0, -1].float(), dim=-1)  # type: ignore[operator]
    for got, top, want in zip(lp.token_logprobs[len(ids):], lp.top_logprobs[len(ids):], (ref[-1], last)):
        assert got == pytest.approx(want.max().item(), abs=1e-3)
        assert sorted(top.values(), reverse=True) == pytest.approx(want.topk(2).values.tolist(), abs=1e-3)
    outside = [e[str(ids[i])]["rank"] for i, e in enumerate(plp[1:], start=1)]
    assert max(outside) > 3, "the prompt has no token outside the top 3: the rank check is moot"
    # Streamed, the echo and its logprobs come first, the same as above.
    chunks = list(client.completions.create(model=model, prompt=ids, max_tokens=2, temperature=0,
                                            logprobs=2, echo=True, stream=True))
    streamed = [x for c in chunks for x in c.choices[0].logprobs.token_logprobs]
    assert streamed[0] is None
    assert streamed[1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-5)


def test_generate_input_token_logprobs_match_prompt_logprobs(server: Server, client: openai.OpenAI,
                                                             model: str) -> None:
    ids = httpx.post(f"{server.url}/tokenize", json={"prompt": PROMPT * 2}).json()["tokens"]
    ref = client.completions.create(model=model, prompt=ids, max_tokens=1, temperature=0,
                                    extra_body={"prompt_logprobs": 2}).choices[0].model_extra["prompt_logprobs"]
    start = 3
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 2, "temperature": 0},
            "return_logprob": True, "logprob_start_len": start, "top_logprobs_num": 2,
            "return_text_in_logprobs": True}
    meta = httpx.post(f"{server.url}/generate", json=body, timeout=120).json()["meta_info"]
    # SGLang's shape: [logprob, token id, text] from logprob_start_len on, the first unscored.
    got = meta["input_token_logprobs"]
    assert [t for _, t, _ in got] == ids[start:]
    assert got[0][0] is None and meta["input_top_logprobs"][0] is None
    for p, (lp, t, text) in enumerate(got[1:], start=start + 1):
        assert lp == pytest.approx(ref[p][str(t)]["logprob"], abs=1e-5)
        assert text == ref[p][str(t)]["decoded_token"]
        tops = meta["input_top_logprobs"][p - start]
        want = sorted((e["rank"], int(k), e["logprob"]) for k, e in ref[p].items() if e["rank"] <= 2)
        assert [(t2, lp2) for lp2, t2, _ in tops] == [(k, pytest.approx(v, abs=1e-5)) for _, k, v in want]
    assert len(meta["output_token_logprobs"]) == 2
    # Streamed, the last event carries the same; without logprob_start_len only the last prompt
    # token is listed (SGLang's default), unscored.
    with httpx.stream("POST", f"{server.url}/generate", json={**body, "stream": True}, timeout=120) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    streamed = events[-1]["meta_info"]["input_token_logprobs"]
    assert [(t, text) for _, t, text in streamed] == [(t, text) for _, t, text in got]
    assert [lp for lp, _, _ in streamed[1:]] == pytest.approx([lp for lp, _, _ in got[1:]], abs=1e-5)
    del body["logprob_start_len"]
    meta = httpx.post(f"{server.url}/generate", json=body, timeout=120).json()["meta_info"]
    assert meta["input_token_logprobs"] == [[None, ids[-1], ref[-1][str(ids[-1])]["decoded_token"]]]
    bad = httpx.post(f"{server.url}/generate", json={**body, "logprob_start_len": len(ids)}, timeout=120)
    assert bad.status_code == 400 and "logprob_start_len" in bad.text


def test_logprobs_have_text_offsets_and_token_ids(client: openai.OpenAI, model: str) -> None:
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=4, temperature=0,
                                  logprobs=2)
    lp = r.choices[0].logprobs
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    assert all(len(t) == 2 for t in lp.top_logprobs)
    as_ids = client.completions.create(model=model, prompt=PROMPT, max_tokens=4, temperature=0,
                                       logprobs=1,
                                       extra_body={"return_tokens_as_token_ids": True})
    assert all(t.startswith("token_id:") for t in as_ids.choices[0].logprobs.tokens)
    assert as_ids.choices[0].logprobs.token_logprobs == pytest.approx(lp.token_logprobs, abs=1e-4)


def test_include_stop_str_in_output(client: openai.OpenAI, model: str) -> None:
    text = greedy_text(client, model, PROMPT, 6)
    stop = text.strip().split()[0]
    cut = client.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=0,
                                    stop=[stop])
    kept = client.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=0,
                                     stop=[stop], extra_body={"include_stop_str_in_output": True})
    assert cut.choices[0].finish_reason == kept.choices[0].finish_reason == "stop"
    assert kept.choices[0].text == cut.choices[0].text + stop


def test_continuous_usage_stats(client: openai.OpenAI, model: str) -> None:
    chunks = list(client.completions.create(
        model=model, prompt=PROMPT, max_tokens=4, temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    counts = [c.usage.completion_tokens for c in chunks if c.choices and c.usage is not None]
    assert counts and counts == sorted(counts) and counts[-1] == 4


def test_default_max_tokens(server: Server, client: openai.OpenAI, model: str) -> None:
    # OpenAI's 16 for completions; vLLM's "the rest of the context" for chat. A min_tokens above
    # the default is refused naming it, which shows the chat default without generating it all.
    r = client.completions.create(model=model, prompt=PROMPT, temperature=0, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 16 and r.choices[0].finish_reason == "length"
    bad = httpx.post(f"{server.url}/v1/completions", json={"prompt": PROMPT, "min_tokens": 17}, timeout=30)
    assert bad.status_code == 400 and "max_tokens (16)" in bad.json()["error"]["message"], bad.text
    messages = [{"role": "user", "content": "Say hi."}]
    prompt = httpx.post(f"{server.url}/tokenize", json={"messages": messages, "add_generation_prompt": True}).json()
    room = server.info()["context_length"] - len(prompt["tokens"])
    bad = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": messages, "min_tokens": room + 1},
                     timeout=30)
    assert bad.status_code == 400 and f"max_tokens ({room})" in bad.json()["error"]["message"], bad.text


def test_chat_roles_and_text_parts(server: Server, client: openai.OpenAI, model: str) -> None:
    def answer(messages: list) -> str:
        return client.chat.completions.create(model=model, messages=messages, max_tokens=4,
                                              temperature=0).choices[0].message.content
    # Text parts are joined with newlines (vLLM's rule): the same prompt as the joined string.
    parts = [{"type": "text", "text": "What is the capital"}, {"type": "text", "text": "of France?"}]
    assert answer([{"role": "user", "content": parts}]) == answer(
        [{"role": "user", "content": "What is the capital\nof France?"}])
    # Every OpenAI role is accepted; any other is refused, naming it.
    assert answer([{"role": "developer", "content": "Answer briefly."},
                   {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
                   {"role": "user", "content": "What is the capital of France?"}])
    bad = httpx.post(f"{server.url}/v1/chat/completions", timeout=30, json={
        "messages": [{"role": "wizard", "content": "hi"}], "max_tokens": 2})
    assert bad.status_code == 400 and "wizard" in bad.json()["error"]["message"], bad.text


def test_chat_n_streams_role_first_for_each_choice(client: openai.OpenAI, model: str) -> None:
    messages = [{"role": "user", "content": "Say hello."}]
    firsts: dict[int, object] = {}
    texts: dict[int, str] = {}
    for chunk in client.chat.completions.create(model=model, messages=messages, max_tokens=4, n=2,
                                                temperature=0, stream=True):
        for c in chunk.choices:
            firsts.setdefault(c.index, c.delta)
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
    assert sorted(firsts) == [0, 1]
    assert all(d.role == "assistant" for d in firsts.values())
    whole = client.chat.completions.create(model=model, messages=messages, max_tokens=4, n=2,
                                           temperature=0)
    assert texts == {c.index: c.message.content for c in whole.choices}


def test_chat_prompt_logprobs_stream_matches_non_stream(client: openai.OpenAI, model: str) -> None:
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    kw = {"model": model, "messages": messages, "max_tokens": 3, "temperature": 0, "n": 2,
          "extra_body": {"prompt_logprobs": 2}}
    whole = client.chat.completions.create(**kw).model_extra["prompt_logprobs"]
    # vLLM's place in the chat API: on the response, null first, then one map per prompt token.
    assert whole[0] is None and len(whole) > 5
    assert all(1 <= len(e) <= 3 and min(x["rank"] for x in e.values()) == 1 for e in whole[1:])
    chunks = list(client.chat.completions.create(**kw, stream=True))
    carried = [c.model_extra["prompt_logprobs"] for c in chunks if c.model_extra.get("prompt_logprobs")]
    assert len(carried) == 1, "the stream carries the prompt logprobs once"
    streamed = carried[0]
    assert streamed[0] is None and len(streamed) == len(whole)
    for s, w in zip(streamed[1:], whole[1:]):
        assert s.keys() == w.keys()
        for k in s:
            assert s[k]["rank"] == w[k]["rank"] and s[k]["decoded_token"] == w[k]["decoded_token"]
            assert s[k]["logprob"] == pytest.approx(w[k]["logprob"], abs=1e-5)


def test_chat_assistant_prefill_and_echo(client: openai.OpenAI, model: str) -> None:
    messages = [{"role": "user", "content": "What is the capital of France?"},
                {"role": "assistant", "content": "The capital of France is"}]
    r = client.chat.completions.create(
        model=model, messages=messages, max_tokens=3, temperature=0,
        extra_body={"continue_final_message": True, "add_generation_prompt": False, "echo": True})
    content = r.choices[0].message.content
    assert content.startswith("The capital of France is")
    assert "Paris" in content


@pytest.mark.parametrize(("route", "body", "param"), [
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "response_format": {"type": "json_schema"}}, "response_format"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tool_choice"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 0}, "n"),
    ("/v1/completions", {"prompt": "x", "suffix": "y"}, "suffix"),
    ("/v1/completions", {"prompt": "x", "n": 2, "best_of": 3}, "best_of"),
    ("/v1/completions", {"prompt": "x", "regex": "a+", "ebnf": "root ::= \"a\""}, "ebnf"),
    ("/v1/completions", {"prompt": "x", "guided_decoding_backend": "xgrammar"}, "guided_decoding_backend"),
    ("/v1/completions", {"prompt": "x", "lora_path": "/a"}, "lora_path"),
    ("/v1/completions", {"prompt": "x", "guided_json": "{not json"}, "guided_json"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"abc": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"1": 1000}}, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"999999999": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": [], "max_tokens": 1}, "prompt"),
    ("/v1/completions", {"prompt": "x", "stop": ["s"] * 17}, "stop"),
    ("/v1/completions", {"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs"),
    ("/generate", {"text": "x", "sampling_params": {"ebnf": "root ::= missing_rule"}}, "ebnf"),
])
def test_unsupported_or_invalid_fields_get_a_400_naming_them(server: Server, route: str, body: dict,
                                                             param: str) -> None:
    r = httpx.post(f"{server.url}{route}", json={"max_tokens": 2, **body}, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


def test_unknown_fields_are_accepted(server: Server) -> None:
    r = httpx.post(f"{server.url}/v1/completions",
                   json={"prompt": PROMPT, "max_tokens": 2, "no_api_defines_this": 1, "user": "u1"},
                   timeout=30)
    assert r.status_code == 200, r.text
    assert "no_api_defines_this" in server.log()


def test_model_by_id(server: Server, model: str) -> None:
    assert httpx.get(f"{server.url}/v1/models/{model}").json()["id"] == model
    assert httpx.get(f"{server.url}/v1/models/other").status_code == 404


def test_info_routes(server: Server) -> None:
    assert httpx.get(f"{server.url}/version").json()["version"]
    assert httpx.get(f"{server.url}/ping").status_code == 200
    assert httpx.post(f"{server.url}/ping").status_code == 200
    assert httpx.get(f"{server.url}/server_info").json()["kv_pages"]["total"] > 0
    ids = httpx.post(f"{server.url}/v1/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    assert httpx.post(f"{server.url}/v1/detokenize", json={"tokens": ids}).json()["prompt"].endswith(PROMPT)
    assert httpx.post(f"{server.url}/abort_request", json={"rid": "zz"}).status_code == 404


def test_abort_request_ends_a_generate_request(server: Server) -> None:
    body = {"text": PROMPT, "stream": True,
            "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True}}
    events = []
    with httpx.stream("POST", f"{server.url}/generate", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            events.append(json.loads(line[6:]))
            if len(events) == 1:  # /generate reports the engine's request id
                rid = events[0]["meta_info"]["id"]
                assert httpx.post(f"{server.url}/abort_request", json={"rid": rid}).status_code == 200
    assert "error" in events[-1], events[-1]
    assert events[-2]["meta_info"]["completion_tokens"] < 2000


def test_vllm_metric_names(server: Server, client: openai.OpenAI, model: str) -> None:
    from prometheus_client.parser import text_string_to_metric_families
    client.completions.create(model=model, prompt=PROMPT, max_tokens=2)
    families = {f.name: f for f in text_string_to_metric_families(
        httpx.get(f"{server.url}/metrics").text)}
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                 "prefix_cache_queries", "prefix_cache_hits", "prompt_tokens", "generation_tokens",
                 "request_success", "time_to_first_token_seconds", "inter_token_latency_seconds",
                 "e2e_request_latency_seconds", "request_queue_time_seconds",
                 "request_prefill_time_seconds", "request_decode_time_seconds",
                 "request_prompt_tokens", "request_generation_tokens", "num_preemptions"):
        family = families[f"tokenspeed:{name}"]
        assert all(s.labels.get("model_name") == model for s in family.samples), name
    success = {s.labels.get("finished_reason"): s.value for s in families["tokenspeed:request_success"].samples
               if s.name.endswith("_total")}
    assert success.get("length", 0) >= 1

    def bounds(name: str) -> list[float]:
        return [float(s.labels["le"]) for s in families[f"tokenspeed:{name}"].samples
                if s.name.endswith("_bucket") and s.labels["le"] != "+Inf"]

    # vLLM's bucket boundaries, from its source (vllm/v1/metrics/loggers.py, later moved to
    # vllm/v1/metrics/buckets.py), so a vLLM dashboard's quantiles read the same.
    assert bounds("time_to_first_token_seconds") == [
        0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
        40.0, 80.0, 160.0, 640.0, 2560.0]
    assert bounds("inter_token_latency_seconds") == [
        0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
    for name in ("e2e_request_latency_seconds", "request_queue_time_seconds", "request_prefill_time_seconds",
                 "request_decode_time_seconds"):
        assert bounds(name) == [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                                60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0], name
    # Token counts: vLLM's build_1_2_5_buckets(max_model_len), 1, 2, 5 × 10^k up to the context.
    context = server.info()["context_length"]
    tokens = [float(m * 10 ** k) for k in range(12) for m in (1, 2, 5) if m * 10 ** k <= context]
    assert tokens[-1] > context / 5
    assert bounds("request_prompt_tokens") == bounds("request_generation_tokens") == tokens


def test_openapi_document_validates_and_lists_every_route(server: Server) -> None:
    from openapi_spec_validator import validate
    doc = httpx.get(f"{server.url}/openapi.json").json()
    validate(doc)
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/models", "/v1/models/{id}", "/generate",
                 "/tokenize", "/detokenize", "/health", "/metrics", "/get_server_info", "/flush_cache",
                 "/abort_request", "/version", "/health_generate", "/get_model_info", "/ping",
                 "/v1/tokenize", "/v1/detokenize", "/server_info"):
        assert path in doc["paths"], path
    for path in ("/v1/completions", "/v1/chat/completions"):  # a JSON body, or SSE with stream
        content = doc["paths"][path]["post"]["responses"]["200"]["content"]
        assert set(content) == {"application/json", "text/event-stream"}, (path, content)
