"""The forwarder's connection pool against a real uvicorn upstream: a request checks at most two pooled connections
however many are idle (httpcore's own pool checks every one, twice per request), expired idle connections are
closed and never reused, at most ``max_connections`` requests are in flight (the next waits, then times out with
``httpcore.PoolTimeout``), and a cancelled request gives its slot back."""

from __future__ import annotations

import ssl
from collections.abc import Iterator

import anyio
import httpcore
import pytest

from worker.asgi import Receive, Scope, Send, read_body, send_body
from worker.proxy.connection_pool import ConnectionPool
from worker.proxy.serve import running_server

pytestmark = pytest.mark.anyio


class Upstream:
    """Answers ``{"ok":true}``. ``/together/N`` answers only once N such requests are in flight (so N connections are
    open at once, however slow the machine); ``/hold`` first waits 3 s (requests kept in flight)."""

    def __init__(self) -> None:
        self.arrived = 0
        self.all_in: anyio.Event | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        await read_body(receive)
        path = scope["path"]
        if path.startswith("/together/"):
            if self.all_in is None:
                self.all_in = anyio.Event()
            self.arrived += 1
            if self.arrived == int(path.rsplit("/", 1)[1]):
                self.all_in.set()
            with anyio.fail_after(30):
                await self.all_in.wait()
        elif path == "/hold":
            await anyio.sleep(3.0)
        await send_body(send, 200, b'{"ok":true}')


@pytest.fixture
def upstream_url() -> Iterator[str]:
    with running_server(Upstream()) as url:
        yield url


def _pool(
    url: str, *, max_connections: int = 64, keepalive_expiry_s: float = 60.0, pool_timeout_s: float = 10.0
) -> ConnectionPool:
    return ConnectionPool(
        httpcore.URL(url).origin,
        ssl_context=ssl.create_default_context(),
        max_connections=max_connections,
        keepalive_expiry_s=keepalive_expiry_s,
        pool_timeout_s=pool_timeout_s,
    )


async def _get(pool: ConnectionPool, url: str, path: str = "/") -> bytes:
    lease = await pool.open(httpcore.Request("GET", url + path, headers=[(b"host", b"upstream")]))
    try:
        return b"".join([chunk async for chunk in lease.response.aiter_stream()])
    finally:
        await pool.release(lease)


async def test_a_request_checks_at_most_two_pooled_connections(
    upstream_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    pool = _pool(upstream_url)
    async with anyio.create_task_group() as group:  # 32 requests in flight at once: 32 connections, then all idle
        for _ in range(32):
            group.start_soon(_get, pool, upstream_url, "/together/32")
    assert pool.open_connections == 32
    checked: list[httpcore.AsyncHTTPConnection] = []
    has_expired = httpcore.AsyncHTTPConnection.has_expired

    def counted(connection: httpcore.AsyncHTTPConnection) -> bool:
        checked.append(connection)
        return has_expired(connection)

    monkeypatch.setattr(httpcore.AsyncHTTPConnection, "has_expired", counted)
    for _ in range(10):
        assert await _get(pool, upstream_url) == b'{"ok":true}'
    assert len(checked) <= 2 * 10  # the oldest idle one and the one taken, per request: not 32
    assert pool.open_connections == 32  # every request reused a pooled connection
    await pool.aclose()
    assert pool.open_connections == 0


async def test_expired_idle_connections_are_closed_and_never_reused(upstream_url: str) -> None:
    pool = _pool(upstream_url, keepalive_expiry_s=0.05)
    async with anyio.create_task_group() as group:
        for _ in range(4):
            group.start_soon(_get, pool, upstream_url, "/together/4")
    assert pool.open_connections == 4
    await anyio.sleep(0.2)  # every idle connection is now past its keep-alive expiry
    assert await _get(pool, upstream_url) == b'{"ok":true}'
    assert pool.open_connections == 1  # the four expired ones closed, the request on a new one
    await pool.aclose()


async def test_past_max_connections_a_request_waits_then_times_out(upstream_url: str) -> None:
    pool = _pool(upstream_url, max_connections=2, pool_timeout_s=0.2)
    async with anyio.create_task_group() as group:
        for _ in range(2):
            group.start_soon(_get, pool, upstream_url, "/hold")  # both slots held for 3 s
        await anyio.sleep(0.5)
        with pytest.raises(httpcore.PoolTimeout):
            await _get(pool, upstream_url)
        group.cancel_scope.cancel()
    assert await _get(pool, upstream_url) == b'{"ok":true}'  # the cancelled requests gave their slots back
    await pool.aclose()


async def test_a_request_cancelled_mid_body_gives_its_slot_back_and_closes_its_connection(upstream_url: str) -> None:
    pool = _pool(upstream_url, max_connections=1, pool_timeout_s=1.0)
    lease = await pool.open(httpcore.Request("GET", upstream_url + "/", headers=[(b"host", b"upstream")]))
    with anyio.CancelScope() as scope:
        scope.cancel()
        await pool.release(lease)  # cancelled: the release still closes the response and frees the slot
    assert await _get(pool, upstream_url) == b'{"ok":true}'  # the only slot is free again
    await pool.aclose()
