"""Prefill/decode disaggregation end to end on CPU: a prefill server and a decode server
(`--disaggregation-mode`, KV over gloo) behind `tokenspeed router --pd`, through the openai
client. The pair gives the greedy tokens of one server, streamed or not, with the prompt's KV
received rather than computed on the decode side (reported as cached tokens); killing either
server mid-request ends the request with an error, and the survivor's pages all come back."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import openai
import pytest

from server_harness import Server, flushed_pages, free_port, start_server, stop_server

PAGE = 4
MESSAGES = [{"role": "user", "content": "Name three colors of the rainbow, then explain why."}]


@dataclass
class Pair:
    prefill: Server
    decode: Server
    router: subprocess.Popen
    url: str

    def client(self, url: str | None = None) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{url or self.url}/v1", api_key="unused", max_retries=0,
                             timeout=60)

    def stop(self) -> None:
        if self.router.poll() is None:
            self.router.terminate()
            self.router.wait(timeout=30)
        for s in (self.prefill, self.decode):
            stop_server(s)


def start_pair(tmp: str, *extra: str, gpus: tuple[str, str] | None = None) -> Pair:
    """A prefill and a decode server and the router; on CPU (gloo), or with `gpus` on those two
    CUDA devices (NCCL, tests/test_gpu_pd.py)."""
    port = str(free_port())
    backend = ("--disaggregation-transfer-backend", "gloo" if gpus is None else "nccl")
    device = () if gpus is None else ("--device", "cuda")
    common = (*backend, "--disaggregation-bootstrap-port", port, "--page-size", str(PAGE),
              "--served-model-name", "default", "--enable-metrics", *device, *extra)
    prefill = _on(gpus and gpus[0], tmp, "--disaggregation-mode", "prefill", *common)
    decode = _on(gpus and gpus[1], tmp, "--disaggregation-mode", "decode", *common)
    rport = free_port()
    log = open(os.path.join(tmp, f"router-{rport}.log"), "w")  # noqa: SIM115 (the child's)
    router = subprocess.Popen([sys.executable, "-m", "tokenspeed.launch.cli", "router", "--pd",
                               "--prefill", prefill.url, "--decode", decode.url,
                               "--port", str(rport)], stdout=log, stderr=subprocess.STDOUT)
    pair = Pair(prefill, decode, router, f"http://127.0.0.1:{rport}")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{pair.url}/health", timeout=2).status_code == 200:
                return pair
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    pair.stop()
    raise RuntimeError("the router never became healthy")


def _on(gpu: str | None, tmp: str, *args: str) -> Server:
    """A server on CUDA device `gpu` (None: the CPU)."""
    if gpu is None:
        return start_server(tmp, *args)
    saved = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = gpu  # the server inherits it
    try:
        return start_server(tmp, *args)
    finally:
        if saved is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES")
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = saved


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    p = start_pair(str(tmp_path_factory.mktemp("pd")))
    yield p
    p.stop()


@pytest.fixture
def fresh_pair(tmp_path: object) -> Iterator[Pair]:
    p = start_pair(str(tmp_path), "--chunked-prefill-size", "16")
    yield p
    p.stop()


def _chat(client: openai.OpenAI, stream: bool, max_tokens: int = 16) -> tuple[str, object]:
    kw = {"model": "default", "messages": MESSAGES, "max_tokens": max_tokens, "temperature": 0}
    if not stream:
        out = client.chat.completions.create(**kw)
        return out.choices[0].message.content or "", out.usage
    text, usage = "", None
    for chunk in client.chat.completions.create(**kw, stream=True,
                                                stream_options={"include_usage": True}):
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
        usage = chunk.usage or usage
    return text, usage


def _metric(text: str, name: str) -> float:
    m = re.search(rf"^tokenspeed:{name}{{[^}}]*}} (\S+)$", text, re.MULTILINE)
    assert m, name
    return float(m.group(1))


def _transfers(server: Server) -> dict[str, int]:
    """/get_server_info's `kv_transfer`, checked against the same totals in /metrics (the
    microseconds of the arrived transfers: the sum of the `kv_transfer_seconds` histogram)."""
    info = httpx.get(f"{server.url}/get_server_info", timeout=10).json()["kv_transfer"]
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    for key, value in info.items():
        if key == "arrived_us":
            got = _metric(text, "kv_transfer_seconds_sum")
            assert got == pytest.approx(value / 1e6, abs=1e-6), (key, value, got)
            assert _metric(text, "kv_transfer_seconds_count") == info["arrived_requests"]
        else:
            assert _metric(text, f"kv_transfer_{key}_total") == value, (key, value)
    return info


def test_a_pd_pair_gives_the_tokens_of_one_server(pair: Pair) -> None:
    # Without a bootstrap_room a PD server serves as a combined one: the reference.
    want, _ = _chat(pair.client(pair.prefill.url), stream=False)
    assert want
    before = [_transfers(s) for s in (pair.prefill, pair.decode)]
    crossed = 0
    for stream in (False, True):
        got, usage = _chat(pair.client(), stream)
        assert got == want, f"stream={stream}"
        prompt = usage.prompt_tokens
        # The decode server received the prompt's full pages bar the last token, computed none.
        assert usage.prompt_tokens_details.cached_tokens == (prompt - 1) // PAGE * PAGE
        crossed += usage.prompt_tokens_details.cached_tokens // PAGE
    completion = pair.client().completions.create(model="default", prompt="The rainbow has",
                                                  max_tokens=8, temperature=0)
    direct = pair.client(pair.prefill.url).completions.create(
        model="default", prompt="The rainbow has", max_tokens=8, temperature=0)
    assert completion.choices[0].text == direct.choices[0].text
    native = {"text": "The rainbow has", "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
    got, want = (httpx.post(f"{url}/generate", json=native, timeout=60).json()["text"]
                 for url in (pair.url, pair.prefill.url))
    assert got == want and got
    for server in (pair.prefill, pair.decode):
        pages = flushed_pages(server)
        assert pages["free"] == pages["total"], pages
    # The two chats' pages crossed, counted on both sides; the short prompts fit one page, so
    # nothing of theirs crossed.
    sent, got_kv = ({k: v - was[k] for k, v in _transfers(s).items()}
                    for s, was in zip((pair.prefill, pair.decode), before, strict=True))
    assert crossed > 0
    nothing = {"arrived_requests": 0, "arrived_bytes": 0, "arrived_us": 0}
    assert sent == {"sent_requests": 2, "sent_pages": crossed, "received_requests": 0,
                    "received_pages": 0, **nothing}, sent
    # The decode worker measured each transfer: one per request, its pages' bytes, some time.
    measured = {k: got_kv.pop(k) for k in nothing}
    assert got_kv == {"sent_requests": 0, "sent_pages": 0, "received_requests": 2,
                      "received_pages": crossed}, got_kv
    assert measured["arrived_requests"] == 2, measured
    per_page = measured["arrived_bytes"] / crossed  # K and V of every layer, one page's tokens
    assert per_page > 0 and per_page == int(per_page) and per_page % PAGE == 0, measured
    assert measured["arrived_us"] > 0, measured


def test_bootstrap_room_is_refused_by_a_combined_server_and_with_n(pair: Pair) -> None:
    r = httpx.post(f"{pair.decode.url}/v1/chat/completions", timeout=30,
                   json={"messages": MESSAGES, "max_tokens": 2, "n": 2, "bootstrap_room": 7})
    assert r.status_code == 400 and r.json()["error"]["param"] == "bootstrap_room", r.text


def test_a_refused_request_and_a_client_that_goes_away(pair: Pair) -> None:
    # The prefill server's 400 (a bad parameter) comes back through the router as it is.
    with pytest.raises(openai.BadRequestError, match="temperature"):
        pair.client().chat.completions.create(model="default", messages=MESSAGES, temperature=-1)
    # A stream dropped mid-way: the decode server aborts the request and frees its pages.
    with httpx.stream("POST", f"{pair.url}/v1/chat/completions", timeout=60,
                      json={"messages": MESSAGES, "max_tokens": 1500, "stream": True,
                            "ignore_eos": True}) as r:
        for i, _line in enumerate(r.iter_lines()):
            if i == 4:
                break
    for server in (pair.prefill, pair.decode):  # idle long before 1,500 tokens could run
        pages = flushed_pages(server, timeout_s=10)
        assert pages["free"] == pages["total"], pages


def _kill(server: Server) -> None:
    os.killpg(server.proc.pid, signal.SIGKILL)
    server.proc.wait(timeout=30)


def test_killing_the_decode_server_mid_stream_ends_the_request(fresh_pair: Pair) -> None:
    stream = fresh_pair.client().chat.completions.create(
        model="default", messages=MESSAGES, max_tokens=400, temperature=0, stream=True,
        extra_body={"ignore_eos": True})
    start = time.monotonic()
    with pytest.raises(openai.APIError):
        for i, _chunk in enumerate(stream):
            if i == 2:
                _kill(fresh_pair.decode)
    assert time.monotonic() - start < 30, "ended by the error, not a timeout"
    # Later requests fail fast too: the prefill server finds its pair down (the first send to
    # the dead peer fails) and fails the requests that would send, rather than answer them.
    for _ in range(2):
        start = time.monotonic()
        with pytest.raises(openai.APIError):
            _chat(fresh_pair.client(), stream=False, max_tokens=2)
        assert time.monotonic() - start < 30
    pages = flushed_pages(fresh_pair.prefill)
    assert pages["free"] == pages["total"], pages
    assert "KV transfer pair (rank 0, prefill) is down" in fresh_pair.prefill.log()


def test_killing_the_prefill_server_mid_request_ends_the_request(fresh_pair: Pair) -> None:
    # A prompt of ~1,500 tokens in chunks of 16: the prefill takes many steps.
    long = [{"role": "user", "content": " ".join(f"word{i}" for i in range(700))}]
    threading.Timer(0.5, _kill, args=(fresh_pair.prefill,)).start()
    start = time.monotonic()
    with pytest.raises(openai.APIError) as e:
        fresh_pair.client().chat.completions.create(model="default", messages=long, max_tokens=4)
    assert time.monotonic() - start < 30, "ended by the error, not a timeout"
    assert "prefill" in str(e.value)
    pages = flushed_pages(fresh_pair.decode)
    assert pages["free"] == pages["total"], pages


def test_what_a_pair_refuses() -> None:
    from tokenspeed.config import NotSupportedError, parse_serve_args
    from tokenspeed.worker.kv_transfer import check_disaggregation

    for backend in ("mooncake", "nixl"):
        with pytest.raises(NotSupportedError, match="not supported yet"):
            parse_serve_args(["--disaggregation-mode", "prefill",
                              "--disaggregation-transfer-backend", backend])
    with pytest.raises(NotSupportedError, match="not supported yet"):
        parse_serve_args(["--disaggregation-mode", "decode", "--disaggregation-decode-tp", "2"])
    cfg = parse_serve_args(["--disaggregation-mode", "decode"])
    assert cfg.disaggregation_transfer_backend == "nccl"
    assert "use gloo" in (check_disaggregation(cfg, "cpu", 1, 1) or "")
    gloo = parse_serve_args(["--disaggregation-mode", "decode", "--disaggregation-transfer-backend", "gloo"])
    assert check_disaggregation(gloo, "cpu", 1, 1) is None
    assert "--dp" in (check_disaggregation(gloo, "cpu", 2, 1) or "")
    assert check_disaggregation(parse_serve_args([]), "cuda", 4, 1) is None  # off: nothing checked
