"""The in-process middleware (``vllm serve --middleware worker.proxy.in_process.EnvCaptureMiddleware``) closes its
Redis resources cleanly at lifespan shutdown, although the first request, in another task, is what opened them.

The ASGI lifespan protocol is driven directly (as uvicorn drives it, in its own task) and the request goes through
``httpx.ASGITransport`` in the test's task: under uvicorn the same split made shutdown fail with "Attempted to exit
cancel scope in a different task than it was entered in" ("Application shutdown failed").
"""

from __future__ import annotations

import anyio
import httpx
import pytest
import redis.asyncio as aioredis

from sink_tools.simulated.http_app import EngineApp
from sink_tools.simulated.options import EngineOptions
from worker.asgi import Message
from worker.proxy.in_process import EnvCaptureMiddleware

pytestmark = pytest.mark.anyio


async def _clients(url: str) -> int:
    """Connections to the server other than this one."""
    async with aioredis.Redis.from_url(url) as client:
        return len(await client.client_list()) - 1


async def test_the_middleware_closes_what_the_first_request_opened_at_lifespan_shutdown(redis_url: str) -> None:
    middleware = EnvCaptureMiddleware(EngineApp(EngineOptions(seed=5)), {"STAGING_SINK_REDIS_URL": redis_url})
    before = await _clients(redis_url)
    to_app, from_server = anyio.create_memory_object_stream[Message](4)
    sent: list[Message] = []
    started = anyio.Event()

    async def send(message: Message) -> None:
        sent.append(message)
        if message["type"] == "lifespan.startup.complete":
            started.set()

    async def lifespan() -> None:
        async with from_server:
            await middleware({"type": "lifespan", "asgi": {"version": "3.0"}}, from_server.receive, send)

    with anyio.fail_after(30):
        async with anyio.create_task_group() as server, to_app:
            server.start_soon(lifespan)
            await to_app.send({"type": "lifespan.startup"})
            await started.wait()
            transport = httpx.ASGITransport(app=middleware)
            async with httpx.AsyncClient(transport=transport, base_url="http://in-process") as client:
                answer = await client.post(
                    "/r/life-1/v1/chat/completions",
                    json={"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
                )
            assert answer.status_code == 200, answer.text
            assert await _clients(redis_url) > before  # the first request opened the capture's connections
            await to_app.send({"type": "lifespan.shutdown"})
    assert [message["type"] for message in sent] == ["lifespan.startup.complete", "lifespan.shutdown.complete"]
    assert await _clients(redis_url) == before  # every connection it opened is closed
