"""Plain ASGI plumbing shared by the capture proxy and the simulated HTTP engine (no framework needed).

Bodies are JSON, parsed and emitted with orjson (the capture path's hot loop).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from typing import Any

import orjson

from worker.errors import BodyTooLargeError

__all__ = (
    "ASGIApp",
    "Message",
    "Receive",
    "Scope",
    "Send",
    "error_body",
    "header",
    "read_body",
    "replay_receive",
    "send_body",
    "send_json",
)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


async def read_body(receive: Receive, limit_bytes: int | None = None) -> bytes:
    """The whole request body.

    :raises BodyTooLargeError: more than *limit_bytes* arrived.
    """
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            break
        chunk = message.get("body", b"")
        size += len(chunk)
        if limit_bytes is not None and size > limit_bytes:
            raise BodyTooLargeError(f"request body larger than {limit_bytes} bytes")
        chunks.append(chunk)
        if not message.get("more_body", False):
            break
    return b"".join(chunks)


def replay_receive(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that yields *body* once, then defers to *receive* (which reports the disconnect)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


def header(scope: Scope, name: bytes) -> str | None:
    """The first value of request header *name* (lower-case bytes), decoded as latin-1, or ``None``."""
    for key, value in scope.get("headers", ()):
        if key == name:
            return bytes(value).decode("latin-1")
    return None


async def send_body(
    send: Send,
    status: int,
    body: bytes,
    content_type: bytes = b"application/json",
    headers: Iterable[tuple[bytes, bytes]] = (),
) -> None:
    """Send one complete response."""
    raw = [(b"content-type", content_type), (b"content-length", str(len(body)).encode()), *headers]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def error_body(status: int, message: str, kind: str) -> bytes:
    """An OpenAI-style error object."""
    return orjson.dumps({"error": {"message": message, "type": kind, "param": None, "code": status}})


async def send_json(send: Send, status: int, payload: Any) -> None:
    """Send *payload* as JSON."""
    await send_body(send, status, orjson.dumps(payload))
