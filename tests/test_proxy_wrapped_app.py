"""The in-process capture middleware (vLLM's ``--middleware``) hands the wrapped app a request it serves like any
other (real uvicorn server, the official openai client):

- the route the engine serves, in ``path`` and ``raw_path`` alike, for a captured call, a rollout's GET passed
  through and a call without a rollout id forwarded uncaptured (an app reading ``raw_path`` never sees the
  ``/r/{rollout_id}`` spelling the agent sent);
- a ``receive`` that still reports the client after the body, as vLLM's handlers read it to notice a disconnect,
  also for the calls served uncaptured (``n`` > 1, a body the proxy cannot parse).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any
from urllib.parse import unquote

import httpx
import pytest

from sink.contract.records import WORKER_CAPTURE_FAILED_REASON
from sink_tools.simulated.http_app import EngineApp
from sink_tools.simulated.options import EngineOptions
from tests.helpers.proxy import SYSTEM, RecordingEngine, client_for, close_clients, manifest
from worker.asgi import Receive, Scope, Send, read_body, replay_receive
from worker.proxy.in_process import EnvCaptureMiddleware
from worker.proxy.serve import running_server
from worker.proxy.upstream import client_gone

MESSAGES: Any = [SYSTEM, {"role": "user", "content": "go"}]


@pytest.fixture(autouse=True)
def _clients() -> Iterator[None]:
    yield
    close_clients()


def _env(redis_url: str) -> dict[str, str]:
    return {"STAGING_SINK_REDIS_URL": redis_url, "STAGING_SINK_PREFIX_MODE": "verify"}


def test_the_wrapped_app_sees_the_engine_route_in_path_and_raw_path(redis_url: str) -> None:
    engine = RecordingEngine()
    with running_server(EnvCaptureMiddleware(engine, _env(redis_url))) as url:
        captured = client_for(url, "scope-1").chat.completions.create(
            model="simulated", messages=MESSAGES, max_tokens=4, extra_body={"min_tokens": 2}
        )
        listed = client_for(url, "scope-1").models.list()
        uncaptured = client_for(url).chat.completions.create(
            model="simulated", messages=MESSAGES, max_tokens=4, extra_body={"min_tokens": 2}
        )
        health = httpx.get(f"{url}/r/scope-1/health", timeout=20)
    assert captured.choices[0].message.content and uncaptured.choices[0].message.content
    assert [model.id for model in listed.data] == ["simulated"]
    assert health.status_code == 200
    seen = [(scope["method"], scope["path"], unquote(scope["raw_path"].decode("ascii"))) for scope in engine.scopes]
    assert seen == [
        ("POST", "/v1/chat/completions", "/v1/chat/completions"),
        ("GET", "/v1/models", "/v1/models"),
        ("POST", "/v1/chat/completions", "/v1/chat/completions"),
        ("GET", "/health", "/health"),
    ]
    assert len(manifest(redis_url, "scope-1").records) == 1  # the rollout's one captured call


class DisconnectWatchingEngine:
    """The simulated engine behind the check vLLM's handlers make once they have the body: is the client gone?"""

    def __init__(self) -> None:
        self.app = EngineApp(EngineOptions(seed=5))
        self.gone: list[bool] = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        body = await read_body(receive)
        self.gone.append(await client_gone(receive))
        await self.app(scope, replay_receive(body, receive), send)


def test_the_wrapped_app_can_watch_for_a_disconnect_on_captured_and_uncaptured_calls(redis_url: str) -> None:
    engine = DisconnectWatchingEngine()
    body = {"model": "simulated", "messages": MESSAGES, "max_tokens": 4}
    with running_server(EnvCaptureMiddleware(engine, _env(redis_url))) as url:
        captured = httpx.post(f"{url}/r/watch-1/v1/chat/completions", json=body, timeout=20)
        many = httpx.post(f"{url}/r/watch-1/v1/chat/completions", json={**body, "n": 2}, timeout=20)
        unparsed = httpx.post(f"{url}/r/watch-1/v1/chat/completions", content=b"{not json", timeout=20)
    assert captured.status_code == 200 and captured.json()["choices"][0]["message"]["role"] == "assistant"
    # Fail-open serves both uncaptured: the engine's own refusals come back (it serves n == 1 and JSON only).
    assert (many.status_code, many.json()["error"]["type"]) == (400, "BadRequestError")
    assert (unparsed.status_code, unparsed.json()["error"]["type"]) == (400, "BadRequestError")
    assert engine.gone == [False, False, False]
    shown = manifest(redis_url, "watch-1")
    assert len(shown.records) == 1 and [f.reason for f in shown.failures] == [WORKER_CAPTURE_FAILED_REASON]
