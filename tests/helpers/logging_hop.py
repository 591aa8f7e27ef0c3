"""A logging hop: an ASGI relay between the proxy and the engine that records the engine's raw answers.

The real-engine tests compare what was staged with what the engine itself sent, as seen by this hop, not by the
proxy under test. Each exchange keeps the request body and the response body's raw bytes (streams whole, as sent).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import orjson

from tests.helpers.tls import tls
from worker.asgi import Receive, Scope, Send, read_body
from worker.proxy.serve import running_server

__all__ = ("Exchange", "LoggingHop", "running_hop")

_HOP_HEADERS = frozenset({b"host", b"content-length", b"transfer-encoding", b"connection"})


@dataclass(frozen=True)
class Exchange:
    """One relayed request and the engine's raw answer."""

    method: str
    path: str
    request_body: bytes
    status: int
    response_body: bytes

    def request_json(self) -> Any:
        """The request body parsed."""
        return orjson.loads(self.request_body)

    def response_json(self) -> Any:
        """The response body parsed (non-streaming answers)."""
        return orjson.loads(self.response_body)

    def events(self) -> list[Any]:
        """The ``data:`` payloads of a streamed answer, parsed, without ``[DONE]``."""
        payloads = []
        for line in self.response_body.decode().splitlines():
            if line.startswith("data: ") and line != "data: [DONE]":
                payloads.append(orjson.loads(line[len("data: ") :]))
        return payloads


class LoggingHop:
    """ASGI app relaying every request to *upstream* unchanged and logging each exchange."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream.rstrip("/")
        self._lock = threading.Lock()
        self._exchanges: list[Exchange] = []
        self._client: httpx.AsyncClient | None = None

    @property
    def exchanges(self) -> list[Exchange]:
        """Every exchange so far, in completion order."""
        with self._lock:
            return list(self._exchanges)

    def on(self, path: str) -> list[Exchange]:
        """The exchanges on *path*."""
        return [exchange for exchange in self.exchanges if exchange.path == path]

    def clear(self) -> None:
        """Forget the exchanges logged so far."""
        with self._lock:
            self._exchanges.clear()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Relay one request (lifespan opens and closes the upstream client)."""
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    self._client = httpx.AsyncClient(timeout=httpx.Timeout(300.0), verify=tls())
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    if self._client is not None:
                        await self._client.aclose()
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http" or self._client is None:
            return
        body = await read_body(receive)
        headers = [(k, v) for k, v in scope.get("headers", ()) if bytes(k).lower() not in _HOP_HEADERS]
        query = scope.get("query_string", b"").decode()
        url = f"{self.upstream}{scope['path']}" + (f"?{query}" if query else "")
        request = self._client.build_request(scope["method"], url, content=body, headers=headers)
        response = await self._client.send(request, stream=True)
        chunks: list[bytes] = []
        try:
            out_headers = [
                (k.encode("latin-1"), v.encode("latin-1"))
                for k, v in response.headers.items()
                if k.encode("latin-1").lower() not in _HOP_HEADERS
            ]
            await send({"type": "http.response.start", "status": response.status_code, "headers": out_headers})
            async for chunk in response.aiter_raw():
                chunks.append(chunk)
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            await response.aclose()
            exchange = Exchange(scope["method"], scope["path"], body, response.status_code, b"".join(chunks))
            with self._lock:
                self._exchanges.append(exchange)


@contextmanager
def running_hop(upstream: str) -> Iterator[tuple[LoggingHop, str]]:
    """A :class:`LoggingHop` to *upstream* served by uvicorn on loopback; yields it and its base URL."""
    hop = LoggingHop(upstream)
    with running_server(hop) as url:
        yield hop, url
