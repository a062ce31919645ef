"""A prefill/decode pair on CPU (gloo) behind SGLang's own router in PD mode
(`python -m sglang_router.launch_router --pd-disaggregation`), which sends each request to both
servers at once with `bootstrap_host`, `bootstrap_port` and `bootstrap_room`. The decode server
holds such a request outside its batch until the prefill server's KV arrives, so the pair gives
the greedy tokens of one server (chat and completions, streamed or not) while the decode
server's other streams keep their pace through a long prefill; killing the prefill server ends
the decode side's waiting request with an error, never a hang."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
from test_e2e_pd import MESSAGES, PAGE, Pair, _chat, _kill

from server_harness import flushed_pages, free_port, start_server

pytestmark = pytest.mark.slow  # two pairs of CPU servers and SGLang's router: ~60-120 s

# ~330 tokens: some 20 prefill steps of 16 (about a second each on a busy 2-core machine).
LONG = [{"role": "user", "content": " ".join(f"word{i}" for i in range(150))}]


def start_sglang_pair(tmp: str, *extra: str) -> Pair:
    """A prefill and a decode server (prefill chunks of 16 tokens: a long prompt takes many
    steps) and SGLang's router in PD mode in front of them."""
    boot = free_port()
    common = ("--disaggregation-transfer-backend", "gloo", "--disaggregation-bootstrap-port",
              str(boot), "--page-size", str(PAGE), "--served-model-name", "default",
              "--chunked-prefill-size", "16", *extra)
    prefill = start_server(tmp, "--disaggregation-mode", "prefill", *common)
    decode = start_server(tmp, "--disaggregation-mode", "decode", *common)
    port = free_port()
    log = open(os.path.join(tmp, f"sglang-router-{port}.log"), "w")  # noqa: SIM115 (the child's)
    router = subprocess.Popen(
        [sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation",
         "--prefill", prefill.url, str(boot), "--decode", decode.url, "--host", "127.0.0.1",
         "--port", str(port), "--prometheus-port", str(free_port()), "--log-level", "warn"],
        stdout=log, stderr=subprocess.STDOUT)
    pair = Pair(prefill, decode, router, f"http://127.0.0.1:{port}")
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and router.poll() is None:
        try:  # the router registers its workers in the background: wait for an answer
            r = httpx.post(f"{pair.url}/generate", timeout=30,
                           json={"text": "hi", "sampling_params": {"max_new_tokens": 1}})
            if r.status_code == 200:
                return pair
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    pair.stop()
    raise RuntimeError("SGLang's router never answered")


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    p = start_sglang_pair(str(tmp_path_factory.mktemp("pd-sglang")))
    yield p
    p.stop()


def _completion(client: openai.OpenAI, stream: bool) -> str:
    kw = {"model": "default", "prompt": "The rainbow has seven colors:", "max_tokens": 12,
          "temperature": 0}
    if not stream:
        return client.completions.create(**kw).choices[0].text
    return "".join(c.choices[0].text for c in client.completions.create(**kw, stream=True)
                   if c.choices)


def test_sglangs_router_gives_the_tokens_of_one_server(pair: Pair) -> None:
    direct = pair.client(pair.prefill.url)  # no bootstrap_room: a combined server's answer
    want, _ = _chat(direct, stream=False)
    want_text = _completion(direct, stream=False)
    assert want and want_text
    for stream in (False, True):
        got, usage = _chat(pair.client(), stream)
        assert got == want, f"chat, stream={stream}"
        # The decode server received the prompt's full pages bar the last token.
        assert usage.prompt_tokens_details.cached_tokens == (usage.prompt_tokens - 1) // PAGE * PAGE
        assert _completion(pair.client(), stream) == want_text, f"completions, stream={stream}"
    for server in (pair.prefill, pair.decode):
        pages = flushed_pages(server)
        assert pages["free"] == pages["total"], pages


def test_fields_naming_another_pair_are_refused(pair: Pair) -> None:
    body = {"messages": MESSAGES, "max_tokens": 2, "bootstrap_room": 7,
            "bootstrap_host": "127.0.0.1", "bootstrap_port": 1}
    r = httpx.post(f"{pair.decode.url}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "bootstrap_port", r.text
    body |= {"bootstrap_host": "10.9.9.9", "bootstrap_port": None}
    r = httpx.post(f"{pair.decode.url}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "bootstrap_host", r.text


def test_a_long_prefill_does_not_stall_the_decode_servers_streams(pair: Pair) -> None:
    # A stream on the decode server itself (no room: it runs there like on a combined server).
    stamps: list[float] = []
    done = threading.Event()

    def stream_tokens() -> None:
        for chunk in pair.client(pair.decode.url).completions.create(
                model="default", prompt="Count:", max_tokens=1000, temperature=0, stream=True,
                extra_body={"ignore_eos": True}):
            if chunk.choices and chunk.choices[0].text:
                stamps.append(time.monotonic())
            if done.is_set():
                break  # the client goes away: the server aborts the stream

    streamer = threading.Thread(target=stream_tokens)
    streamer.start()
    while len(stamps) < 5:
        time.sleep(0.05)
    # Meanwhile a long prompt through the router: the decode server holds it from the start
    # while the prefill server computes its prompt in chunks of 16.
    start = time.monotonic()
    slow = pair.client().with_options(timeout=300)  # a busy 2-core machine: minutes at worst
    out = slow.chat.completions.create(model="default", messages=LONG, max_tokens=2,
                                       temperature=0)
    end = time.monotonic()
    done.set()
    streamer.join(timeout=60)
    assert out.choices[0].message.content is not None
    during = [t for t in stamps if start <= t <= end]
    gaps = [b - a for a, b in itertools.pairwise(during)]
    # Held in the step, the decode server's stream would pause for the whole prefill.
    assert len(during) >= 10, (len(during), end - start)
    assert max(gaps) < (end - start) / 4, (max(gaps), end - start)


def test_killing_the_prefill_server_ends_the_decode_sides_request(tmp_path: object) -> None:
    p = start_sglang_pair(str(tmp_path))
    try:
        # What SGLang's router sends the decode server, directly: the KV will never come.
        body = {"messages": LONG, "max_tokens": 4, "bootstrap_room": 12345,
                "bootstrap_host": "127.0.0.1"}
        threading.Timer(1.0, _kill, args=(p.prefill,)).start()
        start = time.monotonic()
        r = httpx.post(f"{p.decode.url}/v1/chat/completions", json=body, timeout=60)
        assert time.monotonic() - start < 20, "ended by the pair's failure, not a timeout"
        assert r.status_code >= 500 and "pair is down" in r.text, r.text
        # Through the router: an error, not a hang.
        start = time.monotonic()
        with pytest.raises(openai.APIError):
            p.client().chat.completions.create(model="default", messages=LONG, max_tokens=4)
        assert time.monotonic() - start < 40
        pages = flushed_pages(p.decode)
        assert pages["free"] == pages["total"], pages
    finally:
        p.stop()
