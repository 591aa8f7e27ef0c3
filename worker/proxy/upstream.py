"""The inner app's answer to a captured call, and what it tells the capture: a refusal (nothing generated), the
engine's error message, a client already gone."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import anyio
import orjson

from worker.asgi import ASGIApp, Message, Receive, Scope, replay_receive

__all__ = ("UpstreamAnswer", "call_inner", "client_gone", "error_message", "refused")


@dataclass
class UpstreamAnswer:
    """The inner app's whole response."""

    status: int
    headers: list[tuple[bytes, bytes]]
    body: bytes
    oversized: bool
    payload: dict[str, Any] | None = None
    """*body* already parsed, when the proxy built the answer itself from this object (exact mode): the capture
    reads it instead of parsing *body* again."""


async def call_inner(app: ASGIApp, scope: Scope, body: bytes, receive: Receive, limit_bytes: int) -> UpstreamAnswer:
    """The inner *app*'s whole answer to *body* (marked ``oversized`` past *limit_bytes*), never compressed."""
    result = UpstreamAnswer(502, [], b"", oversized=False)
    chunks: list[bytes] = []
    size = 0

    async def collect(message: Message) -> None:
        nonlocal size
        if message["type"] == "http.response.start":
            result.status = message["status"]
            result.headers = list(message.get("headers", ()))
        elif message["type"] == "http.response.body":
            chunk = message.get("body", b"")
            size += len(chunk)
            result.oversized = result.oversized or size > limit_bytes
            chunks.append(chunk)

    # The body must come back as plain JSON: never let the upstream compress it.
    kept = [(k, v) for k, v in scope.get("headers", ()) if k.lower() != b"accept-encoding"]
    inner = {**scope, "headers": [*kept, (b"accept-encoding", b"identity")]}
    await app(inner, replay_receive(body, receive), collect)
    result.body = b"".join(chunks)
    return result


async def client_gone(receive: Receive) -> bool:
    """Whether the client already disconnected (a non-blocking look at ``receive``)."""
    with anyio.move_on_after(0):
        message = await receive()
        return bool(message["type"] == "http.disconnect")
    return False


def refused(upstream: UpstreamAnswer) -> bool:
    """Whether the engine refused the request (a 4xx: over the context, a bad parameter): nothing was generated,
    so nothing reached the agent and the rollout's chain is untouched. A 5xx (a crash, the proxy's own 502/504) may
    come after a generation, so it stays a capture failure."""
    return 400 <= upstream.status < 500


def error_message(body: bytes) -> str:
    """The engine's error message (OpenAI-style ``{"error": {"message": ...}}``), or the body's head."""
    try:
        error = orjson.loads(body).get("error")
        message = error.get("message") if isinstance(error, dict) else error
    except (ValueError, AttributeError):
        message = None
    return f"engine said: {message if isinstance(message, str) else body[:200]!r}"
