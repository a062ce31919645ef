"""`tokenspeed.AsyncLLM`: streaming generation for asyncio code (vLLM's `AsyncLLM` shape).

    engine = AsyncLLM(model="/models/llama")
    async for out in engine.generate("Hello", SamplingParams(max_tokens=32), request_id="a"):
        print(out.outputs[0].text, end="")   # the new text of this step
    engine.shutdown()

One thread drains the engine's events (waiting with the GIL released) and hands each to its
request's asyncio queue on that request's event loop.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from tokenspeed.offline.engine import EngineCore, EngineDeadError, make_config
from tokenspeed.offline.outputs import Assembler, RequestOutput
from tokenspeed.offline.sampling_params import SamplingParams

if TYPE_CHECKING:
    from typing_extensions import Self


class AsyncLLM:
    """Keyword arguments as for `LLM`. `generate` yields a `RequestOutput` per step with the
    text and tokens new in that step (vLLM's DELTA kind); the last one has `finished=True`."""

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        self.engine = EngineCore(make_config(model, kwargs))
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._drain, name="tokenspeed-outputs", daemon=True)
        self._thread.start()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.shutdown()

    async def generate(self, prompt: str | list[int], sampling_params: SamplingParams | None = None,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Streams one prompt's outputs. Leaving the loop early (break, cancel) aborts it."""
        sp = sampling_params or SamplingParams()
        body = {"prompt": prompt} | sp.completion_fields()
        text = prompt if isinstance(prompt, str) else None
        async for out in self._stream("completion", body, sp, text, request_id):
            yield out

    async def chat(self, messages: list[dict[str, Any]], sampling_params: SamplingParams | None = None,
                   request_id: str | None = None, chat_template_kwargs: dict[str, Any] | None = None,
                   tools: list[dict[str, Any]] | None = None) -> AsyncIterator[RequestOutput]:
        sp = sampling_params or SamplingParams()
        body: dict[str, Any] = {"messages": messages} | sp.chat_fields()
        if chat_template_kwargs:
            body["chat_template_kwargs"] = chat_template_kwargs
        if tools:
            body["tools"] = tools
        async for out in self._stream("chat", body, sp, None, request_id):
            yield out

    async def abort(self, request_id: str) -> None:
        """Ends the request: its stream ends with `finish_reason="abort"`."""
        self.engine.abort(request_id)

    def shutdown(self) -> None:
        self._stop.set()
        self.engine.shutdown()
        self._thread.join(timeout=5)

    async def _stream(self, kind: str, body: dict[str, Any], sp: SamplingParams, text: str | None,
                      request_id: str | None) -> AsyncIterator[RequestOutput]:
        rid = request_id or _new_id()
        queue: asyncio.Queue = asyncio.Queue()
        with self._lock:
            if rid in self._queues:
                raise ValueError(f"request id {rid!r} is already in flight")
            self._queues[rid] = (asyncio.get_running_loop(), queue)
        wants = sp.logprobs is not None or sp.prompt_logprobs is not None
        asm = Assembler(rid, text, sp.n, sp.logprobs is not None,
                        decode=self.engine.decode if wants else None, delta=True)
        done = False
        try:
            self.engine.submit(rid, kind, body, stream=True)
            while not done:
                event = await queue.get()
                if "error" in event:
                    raise self.engine.error(event)
                if event.get("dead"):
                    raise EngineDeadError(event["dead"])
                if event.get("done"):
                    done = True
                    if event.get("aborted"):
                        yield asm.aborted()
                    continue
                yield asm.add(event)
        finally:
            with self._lock:
                self._queues.pop(rid, None)
            if not done:
                self.engine.abort(rid)

    def _drain(self) -> None:
        while not self._stop.is_set():
            try:
                events = self.engine.recv(0.2)
                if not events:
                    self.engine.check_alive()
            except EngineDeadError as e:
                self._fail_all(str(e))
                return
            except RuntimeError:  # shut down
                return
            for event in events:
                with self._lock:
                    target = self._queues.get(event["request_id"])
                if target is not None:
                    loop, queue = target
                    loop.call_soon_threadsafe(queue.put_nowait, event)

    def _fail_all(self, message: str) -> None:
        with self._lock:
            targets = list(self._queues.items())
        for rid, (loop, queue) in targets:
            loop.call_soon_threadsafe(queue.put_nowait, {"request_id": rid, "dead": message})


def _new_id() -> str:
    import uuid

    return uuid.uuid4().hex
