"""Async client for one request: OpenAI completions / chat, or the native /generate (streamed,
SSE); or one embedding (`openai-embeddings`: POST /v1/embeddings, one JSON answer)."""

from __future__ import annotations

import json
import time
from typing import Any

import httpx

from tokenspeed.bench.datasets import BenchRequest
from tokenspeed.bench.metrics import RequestResult

BACKENDS = ("openai-completions", "openai-chat", "tokenspeed-native", "openai-embeddings")
EMBEDDINGS = "openai-embeddings"


def build_payload(backend: str, model: str | None, req: BenchRequest, *, ignore_eos: bool,
                  temperature: float = 0.0, extra: dict[str, Any] | None = None) -> tuple[str, dict]:
    """(path, JSON body) of a streaming request that asks for `req.output_len` tokens (an
    embedding request asks for none)."""
    if backend == EMBEDDINGS:
        body = {"input": [req.prompt] if isinstance(req.prompt, list) else req.prompt}
        if model:
            body["model"] = model
        return "/v1/embeddings", body | (extra or {})
    if backend == "tokenspeed-native":
        sp: dict[str, Any] = {"max_new_tokens": req.output_len, "temperature": temperature}
        if ignore_eos:
            sp["ignore_eos"] = True
        key = "input_ids" if isinstance(req.prompt, list) else "text"
        body: dict[str, Any] = {key: req.prompt, "sampling_params": sp, "stream": True}
        path = "/generate"
    else:
        body = {"max_tokens": req.output_len, "temperature": temperature, "stream": True,
                "stream_options": {"include_usage": True}}
        if model:
            body["model"] = model
        if ignore_eos:
            body["ignore_eos"] = True
        if backend == "openai-chat":
            if isinstance(req.prompt, list):
                raise ValueError("openai-chat cannot send token-id prompts; use openai-completions")
            body["messages"] = [{"role": "user", "content": req.prompt}]
            path = "/v1/chat/completions"
        elif backend == "openai-completions":
            body["prompt"] = req.prompt
            path = "/v1/completions"
        else:
            raise ValueError(f"unknown backend {backend!r} (one of {', '.join(BACKENDS)})")
    if extra:
        body.update(extra)
    return path, body


class StreamParser:
    """Turns SSE `data:` payloads into (non-empty?, text) and keeps usage counts."""

    def __init__(self, backend: str, result: RequestResult) -> None:
        self.backend = backend
        self.result = result
        self._native_ids = 0
        self._native_text = ""

    def feed(self, data: dict, ts: float) -> None:
        r = self.result
        if "error" in data and not data.get("choices"):
            err = data["error"]
            raise RuntimeError(err.get("message", str(err)) if isinstance(err, dict) else str(err))
        if self.backend == "tokenspeed-native":
            text = str(data.get("text", ""))
            ids = data.get("output_ids")
            grew = len(ids) > self._native_ids if isinstance(ids, list) else len(text) > len(self._native_text)
            if isinstance(ids, list):
                self._native_ids = len(ids)
            self._native_text = text
            r.text = text
            meta = data.get("meta_info") or {}
            if meta.get("completion_tokens") is not None:
                r.usage_output_tokens = int(meta["completion_tokens"])
            elif isinstance(ids, list):
                r.usage_output_tokens = len(ids)
            if meta.get("prompt_tokens") is not None:
                r.usage_prompt_tokens = int(meta["prompt_tokens"])
            if grew:
                r.chunk_times.append(ts)
            return
        usage = data.get("usage")
        if isinstance(usage, dict):
            if usage.get("completion_tokens") is not None:
                r.usage_output_tokens = int(usage["completion_tokens"])
            if usage.get("prompt_tokens") is not None:
                r.usage_prompt_tokens = int(usage["prompt_tokens"])
        choices = data.get("choices") or []
        if not choices:
            return
        c = choices[0]
        piece = c.get("text") if self.backend == "openai-completions" else (c.get("delta") or {}).get("content")
        if piece:
            r.chunk_times.append(ts)
            r.text += piece


def iter_sse_data(buffer: bytearray) -> list[bytes]:
    """Pops every complete line from `buffer` and returns the payloads of `data:` lines."""
    end = buffer.rfind(b"\n")
    if end < 0:
        return []
    lines = bytes(buffer[:end]).split(b"\n")
    del buffer[:end + 1]
    return [line[5:].strip() for line in lines if line.startswith(b"data:")]


async def send(client: httpx.AsyncClient, base_url: str, backend: str, path: str, body: dict,
               result: RequestResult) -> RequestResult:
    """Streams one request into `result` (timestamps, text, usage); never raises."""
    if backend == EMBEDDINGS:
        return await send_embedding(client, base_url + path, body, result)
    parser = StreamParser(backend, result)
    buf = bytearray()
    result.send_time = time.perf_counter()
    try:
        async with client.stream("POST", base_url + path, json=body) as resp:
            if resp.status_code != 200:
                raw = await resp.aread()
                raise RuntimeError(f"HTTP {resp.status_code}: {raw.decode(errors='replace')[:500]}")
            done_at = 0.0
            async for chunk in resp.aiter_bytes():
                ts = time.perf_counter()
                buf += chunk
                for payload in iter_sse_data(buf):
                    if payload == b"[DONE]":
                        done_at = done_at or ts
                    elif payload and not done_at:
                        parser.feed(json.loads(payload), ts)
        # E2E ends at [DONE] (or at the end of the stream when the server sends none).
        result.end_time = done_at or time.perf_counter()
        result.ok = bool(result.chunk_times) or result.usage_output_tokens == 0
        if not result.ok:
            result.error = "the stream ended without any output"
    except Exception as e:  # noqa: BLE001 - a failed request is data, not a crash
        result.end_time = time.perf_counter()
        result.ok = False
        result.error = f"{type(e).__name__}: {e}"
    return result


async def send_embedding(client: httpx.AsyncClient, url: str, body: dict,
                         result: RequestResult) -> RequestResult:
    """One /v1/embeddings request: done when its vectors arrive (its "first chunk" too, so TTFT
    is the latency); prompt tokens from its usage. Never raises."""
    result.send_time = time.perf_counter()
    try:
        resp = await client.post(url, json=body)
        result.end_time = time.perf_counter()
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {resp.text[:500]}")
        data = resp.json()
        if not data.get("data") or not data["data"][0].get("embedding"):
            raise RuntimeError(f"no embedding in the answer: {str(data)[:200]}")
        result.chunk_times.append(result.end_time)
        result.usage_prompt_tokens = int(data.get("usage", {}).get("prompt_tokens") or 0)
        result.usage_output_tokens = 0
        result.ok = True
    except Exception as e:  # noqa: BLE001 - a failed request is data, not a crash
        result.end_time = result.end_time or time.perf_counter()
        result.ok = False
        result.error = f"{type(e).__name__}: {e}"
    return result
