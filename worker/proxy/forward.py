"""The forwarding app: relays every request to the upstream inference server with httpx (a bare reverse proxy).

The capture proxy is :class:`~worker.proxy.middleware.CaptureMiddleware` over this app. Upstream errors pass
through with their status and body; an upstream that does not answer in time becomes ``504`` and one that cannot
be reached ``502`` (OpenAI-style error bodies). Response bodies are streamed through as they arrive.
"""

from __future__ import annotations

import functools
import logging
import ssl

import httpx

from worker.asgi import Receive, Scope, Send, error_body, read_body, send_body

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
    :param max_connections: httpx pool size (concurrent upstream requests).
    """

    def __init__(self, upstream_url: str, *, timeout_s: float = 600.0, max_connections: int = 1024) -> None:
        self.upstream_url = upstream_url.rstrip("/")
        # Idle connections expire before the usual 5 s server keep-alive (uvicorn's, vLLM's), so a request is
        # not sent on a connection the server is closing at that moment.
        limits = httpx.Limits(
            max_connections=max_connections, max_keepalive_connections=max_connections, keepalive_expiry=2.0
        )
        self._client = httpx.AsyncClient(
            base_url=self.upstream_url,
            timeout=httpx.Timeout(timeout_s),
            limits=limits,
            headers={"accept-encoding": "identity"},  # bodies are relayed raw: compress only when the client asks
            verify=_tls_context(),
        )

    async def aclose(self) -> None:
        """Close the upstream connection pool."""
        await self._client.aclose()

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
        body = await read_body(receive)
        headers = [(k, v) for k, v in scope.get("headers", ()) if k.lower() not in _HOP_BY_HOP]
        query = scope.get("query_string", b"")
        request = self._client.build_request(
            scope["method"],
            scope["path"],
            params=query.decode("latin-1") if query else None,
            headers=headers,
            content=body,
        )
        try:
            try:
                response = await self._client.send(request, stream=True)
            except (httpx.ReadError, httpx.RemoteProtocolError, httpx.WriteError) as exc:
                # A pooled connection the server closed under us: no response byte arrived, send it once more.
                logger.info(
                    "upstream %s%s dropped a pooled connection (%r); retrying once",
                    self.upstream_url,
                    scope["path"],
                    exc,
                )
                response = await self._client.send(request, stream=True)
        except httpx.TimeoutException as exc:
            logger.warning("upstream %s%s timed out: %r", self.upstream_url, scope["path"], exc)
            await _own_error(send, 504, f"upstream timed out: {exc!r}", "UpstreamTimeout")
            return
        except httpx.HTTPError as exc:
            logger.warning("upstream %s%s unreachable: %r", self.upstream_url, scope["path"], exc)
            await _own_error(send, 502, f"upstream unreachable: {exc!r}", "UpstreamUnreachable")
            return
        try:
            out_headers = [
                (k.lower(), v)
                for k, v in response.headers.raw
                if k.lower() not in _HOP_BY_HOP or k.lower() == b"content-length"
            ]
            await send({"type": "http.response.start", "status": response.status_code, "headers": out_headers})
            try:
                async for chunk in response.aiter_raw():
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            except httpx.TimeoutException as exc:
                logger.warning("upstream %s%s timed out mid-body: %r", self.upstream_url, scope["path"], exc)
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            await response.aclose()


async def _own_error(send: Send, status: int, message: str, kind: str) -> None:
    await send_body(send, status, error_body(status, message, kind), headers=[(UPSTREAM_TIMEOUT_HEADER, kind.encode())])
