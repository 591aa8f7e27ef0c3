"""The forwarding app: relays every request to the upstream inference server (a bare reverse proxy).

The capture proxy is :class:`~worker.proxy.middleware.CaptureMiddleware` over this app. Upstream errors pass
through with their status and body; an upstream that does not answer in time becomes ``504`` and one that cannot
be reached ``502`` (OpenAI-style error bodies). Response bodies are streamed through as they arrive.

Requests go out on keep-alive connections (:class:`~worker.proxy.connection_pool.ConnectionPool`: httpcore's
connections, with constant work per request however many are pooled), built here: the upstream URL
joined with the request's path as an httpx client joins a relative URL to its ``base_url`` (httpx percent-encodes
the path and removes its dot segments, :func:`worker.proxy.routes.canonical_path`), the agent's headers less the
hop-by-hop ones, ``accept-encoding: identity`` unless the agent asked for an encoding (bodies are relayed raw), the
upstream's ``host`` and the body's ``content-length``. An httpx client added about 120 us of CPU per request in
layers a reverse proxy does not use (its request and response models, redirects, authentication, cookies) and
httpcore's pool under it a cost that grew with the pooled connections; without them, no cookie an upstream sets is
kept and sent with another agent's request, and the upstream is reached directly, never through an HTTP proxy
named in the environment (``HTTP_PROXY``): it is the engine the proxy fronts.
"""

from __future__ import annotations

import functools
import logging
import ssl

import httpcore
import httpx

from worker.asgi import Receive, Scope, Send, error_body, read_body, send_body
from worker.proxy.connection_pool import ConnectionPool

__all__ = ("UPSTREAM_TIMEOUT_HEADER", "ForwardingApp")

logger = logging.getLogger(__name__)

UPSTREAM_TIMEOUT_HEADER = b"x-staging-upstream-error"
"""Response header the forwarder sets on a 502/504 it produced itself (not the upstream's)."""

_HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"te",
        b"trailers",
        b"transfer-encoding",
        b"upgrade",
        b"host",
        b"content-length",
    }
)
_RESENT_ONCE = (httpcore.ReadError, httpcore.RemoteProtocolError, httpcore.WriteError)
"""A pooled connection the server closed under us: no response byte arrived, the request is sent once more."""
_UNREACHABLE = (httpcore.NetworkError, httpcore.ProtocolError, httpcore.UnsupportedProtocol, httpcore.ProxyError)


@functools.cache
def _tls_context() -> ssl.SSLContext:
    """httpx's default verifying TLS context, built once per process and shared by every forwarder's pool.

    A client given ``verify=True`` builds its own and loads the CA bundle again (about 20 ms of CPU): that adds up
    where one process starts many proxies (the tests, the benchmarks); the context is the same either way.
    """
    return httpx.create_ssl_context()


class ForwardingApp:
    """ASGI app relaying requests to *upstream_url* (``http://host:port``, optionally with a path prefix).

    :param timeout_s: deadline for connecting and for each read from the upstream.
    :param max_connections: connection pool size (concurrent upstream requests).
    """

    def __init__(self, upstream_url: str, *, timeout_s: float = 600.0, max_connections: int = 1024) -> None:
        self.upstream_url = upstream_url.rstrip("/")
        base = httpx.URL(self.upstream_url + "/")  # a path is appended to it, as to an httpx client's base_url
        self._base = base
        self._timeouts = {"connect": timeout_s, "read": timeout_s, "write": timeout_s}
        # Idle connections expire before the usual 5 s server keep-alive (uvicorn's, vLLM's), so a request is
        # not sent on a connection the server is closing at that moment.
        self._pool = ConnectionPool(
            httpcore.URL(scheme=base.raw_scheme, host=base.raw_host, port=base.port, target=b"/").origin,
            ssl_context=_tls_context(),
            max_connections=max_connections,
            keepalive_expiry_s=2.0,
            pool_timeout_s=timeout_s,
        )

    async def aclose(self) -> None:
        """Close the upstream connection pool."""
        await self._pool.aclose()

    def upstream_request(self, scope: Scope, body: bytes) -> httpcore.Request:
        """The upstream request for *scope* and its *body* (see the module docstring)."""
        # As an httpx client joins a relative URL to its base_url: the joined URL removes the dot segments.
        base = self._base
        url = base.copy_with(raw_path=base.raw_path + httpx.URL(scope["path"]).raw_path.lstrip(b"/"))
        query = scope.get("query_string", b"")
        if query:
            url = httpx.URL(url, params=httpx.QueryParams(query.decode("latin-1")))  # as an httpx client given params
        given = [(k, v) for k, v in scope.get("headers", ()) if k.lower() not in _HOP_BY_HOP]
        headers = [(b"host", base.netloc)]
        if not any(k.lower() == b"accept-encoding" for k, _ in given):
            headers.append((b"accept-encoding", b"identity"))  # bodies are relayed raw: compressed only when asked
        headers += given
        method = scope["method"]
        if body or method in ("POST", "PUT", "PATCH"):
            headers.append((b"content-length", b"%d" % len(body)))
        target = httpcore.URL(scheme=base.raw_scheme, host=base.raw_host, port=base.port, target=url.raw_path)
        return httpcore.Request(method, target, headers=headers, content=body, extensions={"timeout": self._timeouts})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Relay one request (lifespan events close the pool on shutdown)."""
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await self.aclose()
            await send({"type": "lifespan.shutdown.complete"})
            return
        if scope["type"] != "http":
            return
        request = self.upstream_request(scope, await read_body(receive))
        try:
            try:
                lease = await self._pool.open(request)
            except _RESENT_ONCE as exc:
                logger.info(
                    "upstream %s%s dropped a pooled connection (%r); retrying once",
                    self.upstream_url,
                    scope["path"],
                    exc,
                )
                lease = await self._pool.open(request)
        except httpcore.TimeoutException as exc:
            logger.warning("upstream %s%s timed out: %r", self.upstream_url, scope["path"], exc)
            await _own_error(send, 504, f"upstream timed out: {exc!r}", "UpstreamTimeout")
            return
        except _UNREACHABLE as exc:
            logger.warning("upstream %s%s unreachable: %r", self.upstream_url, scope["path"], exc)
            await _own_error(send, 502, f"upstream unreachable: {exc!r}", "UpstreamUnreachable")
            return
        response = lease.response
        try:
            out_headers = [
                (k.lower(), v)
                for k, v in response.headers
                if k.lower() not in _HOP_BY_HOP or k.lower() == b"content-length"
            ]
            await send({"type": "http.response.start", "status": response.status, "headers": out_headers})
            try:
                async for chunk in response.aiter_stream():
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            except httpcore.TimeoutException as exc:
                logger.warning("upstream %s%s timed out mid-body: %r", self.upstream_url, scope["path"], exc)
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            await self._pool.release(lease)


async def _own_error(send: Send, status: int, message: str, kind: str) -> None:
    await send_body(send, status, error_body(status, message, kind), headers=[(UPSTREAM_TIMEOUT_HEADER, kind.encode())])
