"""An ASGI guard in front of MLflow's scoring app, for what the pyfunc cannot see.

Measured with mlflow 3.17.2's `mlflow models serve`: a POST without Content-Type answers 500; a body
that is not JSON answers 400 but echoes the whole body, escaped, in the error (3 MB in, 21 MB out); and
there is no limit on the body size. The guard answers 415 without Content-Type, 413 above `max_body`
bytes (before the app reads or parses anything), and cuts error bodies to `max_error` characters.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

GUARDED_PATHS = frozenset({"/invocations"})


async def reply(send: Send, status: int, error_code: str, message: str) -> None:
    body = json.dumps({"error_code": error_code, "message": message}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def shorten_error(body: bytes, max_error: int) -> bytes:
    """An error body of at most ~max_error characters: JSON keeps its error_code, drops the stack trace."""
    if len(body) <= max_error:
        return body
    try:
        parsed = json.loads(body)
    except ValueError:
        parsed = None
    if isinstance(parsed, dict):
        message = str(parsed.get("message", ""))
        short = {"error_code": parsed.get("error_code", "BAD_REQUEST"),
                 "message": message[:max_error] + (" …(truncated)" if len(message) > max_error else "")}
        return json.dumps(short).encode()
    return body[:max_error] + b" ...(truncated)"


class RequestGuard:
    """Wraps an ASGI app: Content-Type required, body size capped, error bodies kept short."""

    def __init__(self, app: ASGIApp, *, max_body: int = 2 * 1024 * 1024, max_error: int = 2000) -> None:
        self.app = app
        self.max_body = max_body
        self.max_error = max_error

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("path") not in GUARDED_PATHS:
            await self.app(scope, receive, send)
            return
        headers = {k.lower(): v for k, v in scope.get("headers", [])}
        if not headers.get(b"content-type", b"").strip():
            await reply(send, 415, "BAD_REQUEST", "set a Content-Type: application/json, text/csv or "
                                                  "application/x-parquet")
            return
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body:
            await reply(send, 413, "REQUEST_LIMIT_EXCEEDED", f"the body has {int(declared)} bytes; send at most "
                                                             f"{self.max_body} per request (split the batch)")
            return
        body = bytearray()
        more = True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            more = bool(message.get("more_body", False))
            if len(body) > self.max_body:
                await reply(send, 413, "REQUEST_LIMIT_EXCEEDED",
                            f"the body exceeds {self.max_body} bytes; split the batch")
                return
        await self.app(scope, _replay(bytes(body), receive), _ShortErrors(send, self.max_error))


def _replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


class _ShortErrors:
    """A `send` that buffers 4xx/5xx responses and shortens their bodies; others pass straight through."""

    def __init__(self, send: Send, max_error: int) -> None:
        self.send = send
        self.max_error = max_error
        self.start: Message | None = None
        self.buffer = bytearray()

    async def __call__(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            if int(message["status"]) >= 400:
                self.start = message
                return
            await self.send(message)
            return
        if message["type"] != "http.response.body" or self.start is None:
            await self.send(message)
            return
        self.buffer += message.get("body", b"")
        if message.get("more_body", False):
            return
        body = shorten_error(bytes(self.buffer), self.max_error)
        headers = [(k, v) for k, v in self.start.get("headers", []) if k.lower() != b"content-length"]
        headers.append((b"content-length", str(len(body)).encode()))
        await self.send({**self.start, "headers": headers})
        await self.send({"type": "http.response.body", "body": body, "more_body": False})
