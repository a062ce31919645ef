"""`tokenspeed router --pd`: the entry point of a prefill/decode pair (docs/parallelism.md).

A generation request goes first to the prefill server with a fresh `bootstrap_room` (the
transfer's id, SGLang's field) and `stream` off: that server computes the prompt and its first
token and ships the prompt's KV to its decode peer. Then the same request, with the same room,
goes to the decode server, which takes the KV from the transfer and generates; its response
(streamed or not) is the client's. Sequential, unlike SGLang's router (which sends to both at
once; the decode server then holds the request outside its batch until the KV arrives): a
request the prefill server refuses never reaches the decode server.

Failures end the request with an OpenAI-format error, never a hang: a prefill server that
refuses the request passes its error on, one that cannot be reached or dies mid-request gives a
502, and a decode server that dies mid-stream ends the stream with an error event. A client
that goes away closes the upstream request, which the server aborts (freeing its pages).
"""

from __future__ import annotations

import argparse
import json
import logging
import secrets
import sys
from typing import Any

import aiohttp
from aiohttp import web

logger = logging.getLogger("tokenspeed.router")

GENERATION_ROUTES = ("/v1/chat/completions", "/v1/completions", "/generate")


def _error(status: int, message: str, kind: str = "server_error") -> web.Response:
    body = {"error": {"message": message, "type": kind, "param": None, "code": status}}
    return web.json_response(body, status=status)


def _sse_error(message: str) -> bytes:
    body = {"error": {"message": message, "type": "server_error", "param": None, "code": 502}}
    return f"data: {json.dumps(body)}\n\n".encode()


class PdRouter:
    def __init__(self, prefill: str, decode: str) -> None:
        self.prefill, self.decode = prefill.rstrip("/"), decode.rstrip("/")
        self.session: aiohttp.ClientSession | None = None

    async def start(self, _app: web.Application) -> None:
        # No total timeout (a long generation is fine); a server that cannot be reached fails fast.
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
        self.session = aiohttp.ClientSession(timeout=timeout)

    async def stop(self, _app: web.Application) -> None:
        if self.session is not None:
            await self.session.close()

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.on_startup.append(self.start)
        app.on_cleanup.append(self.stop)
        for route in GENERATION_ROUTES:
            app.router.add_post(route, self.generate)
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/get_server_info", self.server_info)
        return app

    async def generate(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return _error(400, "the request body is not JSON", "invalid_request_error")
        if not isinstance(body, dict):
            return _error(400, "the request body must be a JSON object", "invalid_request_error")
        room = secrets.randbits(63)
        first = {k: v for k, v in body.items() if k != "stream_options"}
        first.update(bootstrap_room=room, stream=False)
        refused = await self._prefill(request.path, first)
        if refused is not None:
            return refused
        return await self._decode(request, dict(body, bootstrap_room=room))

    async def _prefill(self, path: str, body: dict[str, Any]) -> web.Response | None:
        """Runs the prefill; None when it went through, else the client's error response."""
        assert self.session is not None
        try:
            async with self.session.post(self.prefill + path, json=body) as r:
                text = await r.read()
                if r.status == 200:
                    return None
                return web.Response(body=text, status=r.status, content_type="application/json")
        except (aiohttp.ClientError, ConnectionError) as e:
            return _error(502, f"the prefill server failed: {type(e).__name__}: {e}")

    async def _decode(self, request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        assert self.session is not None
        try:
            upstream = await self.session.post(self.decode + request.path, json=body)
        except (aiohttp.ClientError, ConnectionError) as e:
            return _error(502, f"the decode server failed: {type(e).__name__}: {e}")
        async with upstream:
            ctype = upstream.headers.get("Content-Type", "application/json")
            if upstream.status != 200 or not ctype.startswith("text/event-stream"):
                try:
                    text = await upstream.read()
                except (aiohttp.ClientError, ConnectionError) as e:
                    return _error(502, f"the decode server failed: {type(e).__name__}: {e}")
                return web.Response(body=text, status=upstream.status,
                                    content_type=ctype.split(";")[0])
            out = web.StreamResponse(headers={"Content-Type": ctype, "Cache-Control": "no-cache"})
            await out.prepare(request)
            try:
                async for chunk in upstream.content.iter_any():
                    await out.write(chunk)
            except (aiohttp.ClientError, ConnectionError) as e:
                await out.write(_sse_error(f"the decode server failed mid-stream: "
                                           f"{type(e).__name__}: {e}"))
            await out.write_eof()
            return out

    async def health(self, _request: web.Request) -> web.Response:
        assert self.session is not None
        for name, url in (("prefill", self.prefill), ("decode", self.decode)):
            try:
                async with self.session.get(url + "/health") as r:
                    if r.status != 200:
                        return _error(503, f"the {name} server is unhealthy ({r.status})")
            except (aiohttp.ClientError, ConnectionError) as e:
                return _error(503, f"the {name} server is unreachable: {e}")
        return web.Response(text="")

    async def models(self, _request: web.Request) -> web.Response:
        assert self.session is not None
        try:
            async with self.session.get(self.decode + "/v1/models") as r:
                return web.Response(body=await r.read(), status=r.status,
                                    content_type="application/json")
        except (aiohttp.ClientError, ConnectionError) as e:
            return _error(502, f"the decode server failed: {e}")

    async def server_info(self, _request: web.Request) -> web.Response:
        assert self.session is not None
        info: dict[str, Any] = {}
        for name, url in (("prefill", self.prefill), ("decode", self.decode)):
            try:
                async with self.session.get(url + "/get_server_info") as r:
                    info[name] = await r.json()
            except (aiohttp.ClientError, ConnectionError, json.JSONDecodeError) as e:
                info[name] = {"error": str(e)}
        return web.json_response(info)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="tokenspeed router",
                                description="Route requests to a prefill/decode server pair.")
    p.add_argument("--pd", action="store_true", required=True,
                   help="prefill/decode disaggregation (the one routing mode built; data-parallel "
                        "replicas are `tokenspeed serve --dp N`)")
    p.add_argument("--prefill", required=True, help="URL of the --disaggregation-mode prefill server")
    p.add_argument("--decode", required=True, help="URL of the --disaggregation-mode decode server")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    router = PdRouter(args.prefill, args.decode)
    web.run_app(router.app(), host=args.host, port=args.port, print=None,
                handler_cancellation=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
