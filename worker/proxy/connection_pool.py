"""Keep-alive HTTP/1.1 connections to the upstream, with constant work per request however many are pooled.

httpcore's ``AsyncConnectionPool`` (httpx's transport) walks every pooled connection on each request and on each
response close, asking each one whether it expired (a ``getpeername`` and a ``poll`` per connection) and, for
every idle one, counting all the idle ones again. Its CPU per request grows with the connections it holds: on this
2-core machine, about 0.25 ms with one pooled connection, 0.46 ms with 16, 1.8 ms with 64 and 6.4 ms with 256
(0.23-0.24 ms at each of these sizes here).
A proxy in front of an engine holds as many connections as it has concurrent calls (several per exact-mode call),
so that cost grew with the agents it serves.

:class:`ConnectionPool` keeps the same connections (httpcore's ``AsyncHTTPConnection``: connecting, TLS, HTTP/1.1)
in a stack of idle ones: a request takes the most recently used idle connection that has not expired (one check),
else opens one; a finished response gives its connection back, if still reusable. Each request also closes the
oldest idle connection when it has expired, so an idle pool shrinks back after a burst. At most
``max_connections`` requests are in flight; a request that waits longer than ``pool_timeout_s`` for one of them
raises ``httpcore.PoolTimeout``, as httpcore's pool does.
"""

from __future__ import annotations

import ssl
from collections import deque
from dataclasses import dataclass

import anyio
import httpcore

__all__ = ("ConnectionPool", "Lease")


@dataclass(frozen=True, slots=True, eq=False)
class Lease:
    """A response and the connection it arrives on, until :meth:`ConnectionPool.release`."""

    response: httpcore.Response
    connection: httpcore.AsyncHTTPConnection


class ConnectionPool:
    """Keep-alive connections to one *origin* (see the module docstring).

    :param keepalive_expiry_s: an idle connection older than this is closed, not reused.
    :param pool_timeout_s: the longest a request waits for a free slot when ``max_connections`` are in use.
    """

    def __init__(
        self,
        origin: httpcore.Origin,
        *,
        ssl_context: ssl.SSLContext,
        max_connections: int,
        keepalive_expiry_s: float,
        pool_timeout_s: float,
    ) -> None:
        self._origin = origin
        self._ssl_context = ssl_context
        self._keepalive_expiry_s = keepalive_expiry_s
        self._pool_timeout_s = pool_timeout_s
        self._slots = anyio.Semaphore(max_connections)
        self._idle: deque[httpcore.AsyncHTTPConnection] = deque()  # the most recently used on the right
        self._open: set[httpcore.AsyncHTTPConnection] = set()

    @property
    def open_connections(self) -> int:
        """Connections open now, idle or in use."""
        return len(self._open)

    async def open(self, request: httpcore.Request) -> Lease:
        """The upstream's response to *request* (its head read, its body not yet): give it back with
        :meth:`release` once its body is read or abandoned.

        :raises httpcore.PoolTimeout: no slot freed within ``pool_timeout_s``.
        :raises httpcore.ConnectError: and the other httpcore errors of a failed request; its connection is closed.
        """
        try:
            with anyio.fail_after(self._pool_timeout_s):
                await self._slots.acquire()
        except TimeoutError:
            raise httpcore.PoolTimeout(f"no upstream connection freed within {self._pool_timeout_s} s") from None
        try:
            connection = await self._reusable() or self._new()
            try:
                response = await connection.handle_async_request(request)
            except BaseException:
                await self._close(connection)
                raise
        except BaseException:
            self._slots.release()
            raise
        return Lease(response, connection)

    async def release(self, lease: Lease) -> None:
        """Close *lease*'s response and keep its connection for another request when it can take one; then its slot
        is free (so the connections open never exceed the slots)."""
        connection = lease.connection
        try:
            with anyio.CancelScope(shield=True):  # a cancelled request still leaves the pool consistent
                try:
                    await lease.response.aclose()
                finally:
                    if connection.is_idle() and connection in self._open:
                        self._idle.append(connection)
                    else:
                        await self._close(connection)
        finally:
            self._slots.release()

    async def aclose(self) -> None:
        """Close every connection, idle or in use."""
        with anyio.CancelScope(shield=True):
            self._idle.clear()
            for connection in list(self._open):
                await self._close(connection)

    async def _reusable(self) -> httpcore.AsyncHTTPConnection | None:
        """The most recently used idle connection that has not expired (expired ones are closed), or ``None``."""
        if self._idle and self._idle[0].has_expired():  # the oldest: an idle pool shrinks one connection a request
            await self._close(self._idle.popleft())
        while self._idle:
            connection = self._idle.pop()
            if connection.is_idle() and not connection.has_expired():
                return connection
            await self._close(connection)
        return None

    def _new(self) -> httpcore.AsyncHTTPConnection:
        connection = httpcore.AsyncHTTPConnection(
            self._origin, ssl_context=self._ssl_context, keepalive_expiry=self._keepalive_expiry_s
        )
        self._open.add(connection)
        return connection

    async def _close(self, connection: httpcore.AsyncHTTPConnection) -> None:
        self._open.discard(connection)
        with anyio.CancelScope(shield=True):
            await connection.aclose()
