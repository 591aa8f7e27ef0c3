"""The capture middleware leaves what it does not capture untouched: a non-HTTP ASGI event (lifespan, websocket)
reaches the wrapped app with the very scope, receive and send it arrived with, and the metrics route answers
200 with Prometheus's text content type (contract §6.6: everything that is not a captured call passes through)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from sink.settings import ProxySettings
from worker.asgi import Message, Receive, Scope, Send
from worker.proxy.app import ProxyApp
from worker.proxy.middleware import METRICS_PATH, CaptureMiddleware

pytestmark = pytest.mark.anyio


class RecordingApp:
    """An ASGI app that records each call's three arguments; it answers an HTTP request 204, nothing else."""

    def __init__(self) -> None:
        self.calls: list[tuple[Scope, Receive, Send]] = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.calls.append((scope, receive, send))
        if scope["type"] == "http":
            await send({"type": "http.response.start", "status": 204, "headers": []})
            await send({"type": "http.response.body", "body": b""})


@pytest.fixture
async def wrapped(redis_url: str) -> AsyncIterator[tuple[CaptureMiddleware, RecordingApp]]:
    """The proxy's own capture middleware (real Redis behind it) around a recording app."""
    inner = RecordingApp()
    proxy = ProxyApp(ProxySettings(upstream_url="http://in-process", redis_url=redis_url, upstream_kind="nemo-rl"))
    await proxy.open(inner=inner)
    try:
        assert proxy.middleware is not None
        yield proxy.middleware, inner
    finally:
        await proxy.aclose()


@pytest.mark.parametrize(
    "scope",
    [
        {"type": "lifespan", "asgi": {"version": "3.0"}},
        {"type": "websocket", "path": "/r/ws-1/v1/chat/completions", "headers": []},
        {"type": "websocket", "path": METRICS_PATH, "headers": []},
    ],
    ids=["lifespan", "websocket-to-a-captured-route", "websocket-to-metrics"],
)
async def test_a_non_http_event_reaches_the_wrapped_app_unchanged(
    wrapped: tuple[CaptureMiddleware, RecordingApp], scope: Scope
) -> None:
    middleware, inner = wrapped

    async def receive() -> Message:
        raise AssertionError("the middleware must not read a non-HTTP event itself")

    async def send(message: Message) -> None:
        raise AssertionError(f"the middleware must not answer a non-HTTP event itself: {message}")

    await middleware(scope, receive, send)
    [(seen_scope, seen_receive, seen_send)] = inner.calls
    assert seen_scope is scope
    assert seen_receive is receive
    assert seen_send is send


async def test_the_metrics_route_answers_200_in_prometheus_text_format(
    wrapped: tuple[CaptureMiddleware, RecordingApp],
) -> None:
    middleware, inner = wrapped
    transport = httpx.ASGITransport(app=middleware)
    async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as client:
        answer = await client.get(METRICS_PATH)
    assert answer.status_code == 200
    assert answer.headers["content-type"] == "text/plain; version=0.0.4"
    assert "staging_proxy_" in answer.text
    assert inner.calls == []  # served by the middleware, never forwarded


async def test_a_post_to_the_metrics_path_is_not_the_metrics_route(
    wrapped: tuple[CaptureMiddleware, RecordingApp],
) -> None:
    middleware, inner = wrapped
    transport = httpx.ASGITransport(app=middleware)
    async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as client:
        answer = await client.post(METRICS_PATH, content=b"{}")
    assert answer.status_code == 204
    [(scope, _, _)] = inner.calls
    fields: dict[str, Any] = {"method": scope["method"], "path": scope["path"]}
    assert fields == {"method": "POST", "path": METRICS_PATH}
