"""Tracing (--enable-trace) end to end: an OTLP/HTTP receiver in the test, decoding with the
`opentelemetry-proto` messages a collector uses, gets a chat completion's spans (HTTP, tokenize,
queue, one per prefill chunk, decode, detokenize) under the trace of the request's W3C
`traceparent` (one whose sampled flag is off records nothing); a collector that never answers
slows and fails no request; off, nothing is sent."""

from __future__ import annotations

import math
import secrets
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import openai
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from server_harness import Server, start_server, stop_server

CHUNK = 16  # --chunked-prefill-size: the long prompt below takes several steps
ENGINE_SPANS = ("tokenize", "queue", "prefill_chunk", "decode", "detokenize")
LONG_PROMPT = "Count the colours of the rainbow, then name every planet of the solar system. " * 4


class Receiver:
    """An OTLP/HTTP collector's traces endpoint: POST /v1/traces, protobuf in and out."""

    def __init__(self) -> None:
        self.spans: list[Span] = []
        self.requests = 0
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                request = ExportTraceServiceRequest.FromString(body)
                ok = self.path == "/v1/traces" and self.headers["Content-Type"] == "application/x-protobuf"
                if ok:
                    receiver.requests += 1
                    for resource in request.resource_spans:
                        for scope in resource.scope_spans:
                            receiver.spans.extend(scope.spans)
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200 if ok else 404)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: object) -> None:
                pass

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.http.server_address[1]
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    def wait_for(self, trace_id: str, names: set[str], timeout_s: float = 15) -> list[Span]:
        """The spans of trace `trace_id` (hex) once they include `names`, or after the timeout."""
        deadline = time.monotonic() + timeout_s
        while True:
            spans = [s for s in list(self.spans) if s.trace_id.hex() == trace_id]
            if names <= {s.name for s in spans} or time.monotonic() > deadline:
                return spans
            time.sleep(0.1)

    def close(self) -> None:
        self.http.shutdown()
        self.http.server_close()


@pytest.fixture(scope="module")
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.close()


@pytest.fixture(scope="module")
def traced(tmp_path_factory: pytest.TempPathFactory, receiver: Receiver) -> Iterator[Server]:
    server = start_server(str(tmp_path_factory.mktemp("traced")), "--enable-trace",
                          "--oltp-traces-endpoint", f"127.0.0.1:{receiver.port}",
                          "--chunked-prefill-size", str(CHUNK))
    yield server
    stop_server(server)


def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=30)


def chat(server: Server, headers: dict[str, str] | None = None, prompt: str = LONG_PROMPT):
    api = client(server)
    return api.chat.completions.with_raw_response.create(
        model=api.models.list().data[0].id, messages=[{"role": "user", "content": prompt}], max_tokens=6,
        temperature=0, extra_headers=headers or {})


def test_a_chat_completion_exports_its_spans_under_the_callers_traceparent(
        traced: Server, receiver: Receiver) -> None:
    trace_id, caller_span = secrets.token_hex(16), secrets.token_hex(8)
    raw = chat(traced, {"traceparent": f"00-{trace_id}-{caller_span}-01", "tracestate": "ts=1"})
    completion = raw.parse()
    spans = receiver.wait_for(trace_id, {"POST /v1/chat/completions", *ENGINE_SPANS})
    by_name: dict[str, list[Span]] = {}
    for s in spans:
        by_name.setdefault(s.name, []).append(s)
    assert set(by_name) == {"POST /v1/chat/completions", *ENGINE_SPANS}, sorted(by_name)

    # The server span is the caller's child; every other span is the server span's child.
    (server,) = by_name.pop("POST /v1/chat/completions")
    assert server.kind == Span.SPAN_KIND_SERVER
    assert server.parent_span_id.hex() == caller_span
    assert server.trace_state == "ts=1"
    status = {a.key: a.value.int_value for a in server.attributes}["http.response.status_code"]
    assert status == 200
    assert raw.headers["traceresponse"] == f"00-{trace_id}-{server.span_id.hex()}-01"
    for name, group in by_name.items():
        for s in group:
            assert s.parent_span_id == server.span_id, name
            assert server.start_time_unix_nano <= s.start_time_unix_nano, name
            assert s.start_time_unix_nano <= s.end_time_unix_nano <= server.end_time_unix_nano, name

    # One prefill_chunk per step that carried prompt tokens, the uncached prompt in CHUNK pieces.
    usage = completion.usage
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
    chunks = sorted(by_name["prefill_chunk"], key=lambda s: s.start_time_unix_nano)
    tokens = [{a.key: a.value.int_value for a in s.attributes}["tokenspeed.chunk.tokens"] for s in chunks]
    assert sum(tokens) == usage.prompt_tokens - cached
    assert len(chunks) == math.ceil((usage.prompt_tokens - cached) / CHUNK) >= 3, tokens
    assert all(t <= CHUNK for t in tokens)
    # The journey's order: tokenize, queue, the chunks, decode (from the first token).
    (tokenize,), (queue,), (decode,) = by_name["tokenize"], by_name["queue"], by_name["decode"]
    assert tokenize.end_time_unix_nano <= queue.start_time_unix_nano
    assert queue.end_time_unix_nano <= chunks[0].start_time_unix_nano
    assert chunks[-1].end_time_unix_nano <= decode.start_time_unix_nano
    detokenize = {a.key: a.value.int_value for a in by_name["detokenize"][0].attributes}
    assert detokenize["tokenspeed.tokens"] == usage.completion_tokens


def test_a_streamed_request_without_traceparent_starts_its_own_trace(
        traced: Server, receiver: Receiver) -> None:
    api = client(traced)
    raw = api.chat.completions.with_raw_response.create(
        model=api.models.list().data[0].id, messages=[{"role": "user", "content": "Hi"}],
        max_tokens=4, stream=True)
    assert any(chunk.choices and chunk.choices[0].finish_reason for chunk in raw.parse())
    _, trace_id, span_id, _ = raw.headers["traceresponse"].split("-")
    spans = {s.name: s for s in receiver.wait_for(trace_id, {"POST /v1/chat/completions", *ENGINE_SPANS})}
    server = spans.pop("POST /v1/chat/completions")
    assert server.span_id.hex() == span_id and server.parent_span_id == b""  # a root
    assert set(spans) == set(ENGINE_SPANS)  # a short prompt: one chunk
    # The stream outlives the handler: the server span ends with the body, after the last text.
    assert spans["detokenize"].end_time_unix_nano <= server.end_time_unix_nano


def test_an_unsampled_traceparent_is_honoured(traced: Server, receiver: Receiver) -> None:
    trace_id = secrets.token_hex(16)
    raw = chat(traced, {"traceparent": f"00-{trace_id}-{secrets.token_hex(8)}-00"}, prompt="Hi")
    assert raw.parse().choices[0].message.content
    assert raw.headers["traceresponse"].startswith(f"00-{trace_id}-") and raw.headers["traceresponse"].endswith("-00")
    time.sleep(1.0)  # several export intervals
    assert receiver.wait_for(trace_id, set(), timeout_s=0) == []


def silent_collector() -> socket.socket:
    """A port that takes connections and never answers (a hung collector)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    return sock


def test_a_collector_that_never_answers_slows_and_fails_no_request(tmp_path) -> None:
    sock = silent_collector()
    server = start_server(str(tmp_path), "--enable-trace", "--otlp-traces-endpoint",
                          f"http://127.0.0.1:{sock.getsockname()[1]}")
    try:
        assert chat(server, prompt="Hi").parse().choices[0].message.content
        sock.settimeout(10)
        exporter, _ = sock.accept()  # the exporter connected: its export hangs from now on
        for _ in range(2):  # the client's timeout (30 s) fails a request the exporter would hold
            assert chat(server, prompt="Hello").parse().choices[0].message.content
        exporter.close()
    finally:
        stop_server(server)
        sock.close()
    assert server.proc.returncode == 0, server.log()[-2000:]


def test_tracing_off_exports_nothing(tmp_path, receiver: Receiver) -> None:
    config = tmp_path / "serve.yaml"
    config.write_text(f"enable-trace: false\notlp-traces-endpoint: 127.0.0.1:{receiver.port}\n")
    server = start_server(str(tmp_path), "--config", str(config))
    try:
        before = receiver.requests
        raw = chat(server, {"traceparent": f"00-{secrets.token_hex(16)}-{secrets.token_hex(8)}-01"})
        assert raw.parse().choices[0].message.content
        assert "traceresponse" not in raw.headers
        time.sleep(1.0)  # several export intervals
        assert receiver.requests == before
    finally:
        stop_server(server)
