"""RequestGuard against a tiny ASGI app that behaves like MLflow's scoring app on bad input."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from nightshift.deploy.guard import RequestGuard, shorten_error


async def echo_app(scope: Any, receive: Any, send: Any) -> None:
    """Reads the whole body; answers 400 echoing it (as mlflow does for invalid JSON), else 200."""
    body = b""
    more = True
    while more:
        message = await receive()
        body += message.get("body", b"")
        more = message.get("more_body", False)
    status = 400 if body.startswith(b"bad") else 200
    payload = json.dumps({"error_code": "BAD_REQUEST", "message": f"Invalid input: {body!r}",
                          "stack_trace": "x" * 5000} if status == 400 else {"predictions": [len(body)]}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]})
    await send({"type": "http.response.body", "body": payload})


def call(guard: RequestGuard, body: bytes, headers: list[tuple[bytes, bytes]], chunk: int = 65536,
         path: str = "/invocations") -> tuple[int, dict[bytes, bytes], bytes]:
    chunks = [body[i:i + chunk] for i in range(0, len(body), chunk)] or [b""]
    messages = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    asyncio.run(guard({"type": "http", "path": path, "headers": headers}, receive, send))
    start = sent[0]
    return start["status"], dict(start["headers"]), b"".join(m.get("body", b"") for m in sent[1:])


JSON = [(b"content-type", b"application/json")]


def test_good_request_passes_through_unchanged() -> None:
    status, _, body = call(RequestGuard(echo_app), b'{"x": 1}' * 1000, JSON, chunk=100)
    assert status == 200 and json.loads(body) == {"predictions": [8000]}


def test_missing_content_type_is_415() -> None:
    status, _, body = call(RequestGuard(echo_app), b"{}", [])
    assert status == 415 and b"Content-Type" in body


def test_body_over_the_limit_is_413_by_header_or_by_stream() -> None:
    guard = RequestGuard(echo_app, max_body=1000)
    declared = [*JSON, (b"content-length", b"5000000")]
    assert call(guard, b"", declared)[0] == 413
    status, _, body = call(guard, b"a" * 5000, JSON, chunk=300)  # chunked, no Content-Length
    assert status == 413 and b"1000" in body


def test_error_bodies_are_short_and_keep_their_code() -> None:
    status, headers, body = call(RequestGuard(echo_app, max_error=500), b"bad" + b"\xff" * 100_000, JSON)
    assert status == 400 and len(body) < 700 and int(headers[b"content-length"]) == len(body)
    parsed = json.loads(body)
    assert parsed["error_code"] == "BAD_REQUEST" and "stack_trace" not in parsed


def test_other_paths_are_not_touched() -> None:
    assert call(RequestGuard(echo_app), b"{}", [], path="/ping")[0] == 200
    assert shorten_error(b"short", 10) == b"short"
