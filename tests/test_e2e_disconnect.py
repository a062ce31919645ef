"""A client that goes away, mid-stream or while its non-streaming request runs, gets its request
aborted and its KV pages back, on every generating route."""

from __future__ import annotations

import httpx
import pytest

from server_harness import Server, flushed_pages

LONG = 3000
BODIES = {
    "/v1/completions": {"prompt": "Once upon a time", "max_tokens": LONG, "ignore_eos": True},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "Tell me a story."}],
                             "max_tokens": LONG, "ignore_eos": True},
    "/generate": {"text": "Once upon a time", "sampling_params": {"max_new_tokens": LONG, "ignore_eos": True}},
}


@pytest.mark.parametrize("path", list(BODIES))
def test_stream_disconnect_frees_pages(server: Server, path: str) -> None:
    with httpx.stream("POST", server.url + path, json={**BODIES[path], "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        events = 0
        for line in r.iter_lines():
            events += line.startswith("data: ")
            if events == 3:
                break  # leaving the block closes the connection mid-stream
    kv = flushed_pages(server, timeout_s=10)
    assert kv["free"] == kv["total"], kv


@pytest.mark.parametrize("path", list(BODIES))
def test_non_stream_disconnect_frees_pages(server: Server, path: str) -> None:
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + path, json=BODIES[path], timeout=1.5)
    kv = flushed_pages(server, timeout_s=10)
    assert kv["free"] == kv["total"], kv
