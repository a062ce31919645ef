"""One request lifecycle (issue 9), end to end on the default model: one request id, a random
UUID, shared by the server's log, the engine and the response `id`; and one place that ends a
request, so a stop string finishes it as a stop (metrics, latency histograms), not as an abort."""

from __future__ import annotations

import re
import time

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

from server_harness import Server

PROMPT = "The capital of France is"
HEX32 = r"[0-9a-f]{32}"


def logged_ids(server: Server) -> set[str]:
    """Request ids of the `--log-requests` lines (`id=<uuid>[-<choice>]`)."""
    return set(re.findall(rf"\bid=({HEX32}(?:-\d+)?)", server.log()))


def wait_logged(server: Server, ids: set[str], timeout_s: float = 10) -> set[str]:
    deadline = time.monotonic() + timeout_s
    while not ids <= (seen := logged_ids(server)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return seen


def test_chat_response_id_is_the_logged_engine_id(server: Server, client: openai.OpenAI,
                                                  model: str) -> None:
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}],
                                       max_tokens=2, n=2, temperature=0)
    m = re.fullmatch(rf"chatcmpl-({HEX32})", r.id)
    assert m, r.id
    # Choice 0 runs under the bare id, choice 1 under `<id>-1`.
    want = {m.group(1), f"{m.group(1)}-1"}
    assert want <= wait_logged(server, want)


def test_completion_and_generate_ids_are_logged_and_fresh(server: Server, client: openai.OpenAI,
                                                          model: str) -> None:
    a = client.completions.create(model=model, prompt=PROMPT, max_tokens=1)
    b = client.completions.create(model=model, prompt=PROMPT, max_tokens=1)
    ids = {a.id.removeprefix("cmpl-"), b.id.removeprefix("cmpl-")}
    assert len(ids) == 2 and all(re.fullmatch(HEX32, i) for i in ids), (a.id, b.id)
    gen = httpx.post(f"{server.url}/generate", timeout=60,
                     json={"text": PROMPT, "sampling_params": {"max_new_tokens": 1}}).json()
    rid = gen["meta_info"]["id"]
    assert re.fullmatch(HEX32, rid), rid
    assert ids | {rid} <= wait_logged(server, ids | {rid})


def test_abort_request_refuses_ids_no_request_can_have(server: Server) -> None:
    for rid in ("12", "zz" * 16, f"{'a' * 32}-x"):
        r = httpx.post(f"{server.url}/abort_request", json={"rid": rid}, timeout=10)
        assert r.status_code == 404, (rid, r.text)
    # Well-formed but unknown: a 200, as SGLang (abort is idempotent).
    assert httpx.post(f"{server.url}/abort_request", json={"rid": "a" * 32}).status_code == 200


def metrics(server: Server) -> dict[str, float]:
    """`name{finished_reason}` → value for the counters and histogram counts this test reads."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(f"{server.url}/metrics").text):
        for s in family.samples:
            if s.name == "tokenspeed:request_success_total":
                out[f"success_{s.labels['finished_reason']}"] = s.value
            elif s.name in ("tokenspeed:e2e_request_latency_seconds_count",
                            "tokenspeed:request_generation_tokens_sum"):
                out[s.name.split(":")[1]] = s.value
    return out


def wait_idle(server: Server, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        engine = httpx.get(f"{server.url}/get_server_info", timeout=10).json()["engine"]
        if engine["running_requests"] == 0 and engine["waiting_requests"] == 0:
            return
        time.sleep(0.1)
    raise AssertionError("the engine never went idle")


def test_a_stop_string_finishes_the_request_as_a_stop(server: Server, client: openai.OpenAI,
                                                      model: str) -> None:
    text = client.completions.create(model=model, prompt=PROMPT, max_tokens=12,
                                     temperature=0).choices[0].text
    words = text.split()
    assert len(words) >= 3, text
    stop = words[1]
    wait_idle(server)
    before = metrics(server)
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0,
                                  stop=[stop])
    wait_idle(server)
    after = metrics(server)
    assert r.choices[0].finish_reason == "stop" and stop not in r.choices[0].text
    assert r.usage.completion_tokens < 12
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    # Ended by the one owner of finishing: counted once, as a stop, with its latency and its
    # generated tokens (as many as the response's usage says); never as an abort.
    assert delta.get("success_stop") == 1, delta
    assert delta.get("success_abort", 0) == 0, delta
    assert delta.get("e2e_request_latency_seconds_count") == 1, delta
    assert delta.get("request_generation_tokens_sum") == r.usage.completion_tokens, delta
