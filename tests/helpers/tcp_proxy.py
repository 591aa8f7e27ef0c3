"""A fault-injecting loopback TCP proxy for the network-fault tests.

``async with tcp_proxy(host, port) as proxy:`` listens on ``127.0.0.1:<proxy.port>`` and forwards every
accepted connection to ``host:port`` until a fault is injected:

- :meth:`FaultProxy.drop`: close both sides of every live connection at once;
- :meth:`FaultProxy.stall` / :meth:`FaultProxy.release`: stop forwarding in both directions (bytes stay
  buffered in the proxy) until released, or for ``seconds`` with :meth:`FaultProxy.stall_for`;
- :meth:`FaultProxy.half_close`: send EOF in one direction of every live connection and stop forwarding
  that direction (``"to_server"`` or ``"to_client"``);
- :meth:`FaultProxy.cut_after`: forward exactly ``n_bytes`` more bytes in one direction, then close that
  connection mid-stream (cuts a pipeline in the middle of a command or reply).

Everything runs in the proxy's own task group (structured: leaving the block closes every connection).
Only loopback addresses are used.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Literal

import anyio
from anyio.abc import SocketStream, TaskGroup

__all__ = ("Direction", "FaultProxy", "tcp_proxy")

Direction = Literal["to_server", "to_client"]
_CHUNK_BYTES = 65536
_STREAM_ERRORS = (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError)


@dataclass(eq=False)
class _Link:
    """One proxied connection: its outer scope (drop) and one scope per direction (half-close)."""

    scope: anyio.CancelScope = field(default_factory=anyio.CancelScope)
    pumps: dict[Direction, anyio.CancelScope] = field(
        default_factory=lambda: {"to_server": anyio.CancelScope(), "to_client": anyio.CancelScope()}
    )


@dataclass
class _Cut:
    direction: Direction
    remaining: int


class FaultProxy:
    """The running proxy: its port, counters, and the fault switches (see the module docstring)."""

    def __init__(self, upstream_host: str, upstream_port: int, group: TaskGroup) -> None:
        self.upstream_host = upstream_host
        self.upstream_port = upstream_port
        self.port = 0
        self._group = group
        self._links: set[_Link] = set()
        self._flowing = anyio.Event()
        self._flowing.set()
        self._cut: _Cut | None = None
        self.connections = 0
        self.bytes_forwarded: dict[Direction, int] = {"to_server": 0, "to_client": 0}
        self.faults: list[str] = []

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:<port>`` of the proxy."""
        return f"redis://127.0.0.1:{self.port}"

    @property
    def live_connections(self) -> int:
        """Connections being forwarded right now."""
        return len(self._links)

    # --- faults -----------------------------------------------------------------------------

    def drop(self) -> int:
        """Close both sides of every live connection; returns how many were dropped."""
        self.faults.append("drop")
        for link in list(self._links):
            link.scope.cancel()
        return len(self._links)

    def stall(self) -> None:
        """Stop forwarding in both directions until :meth:`release` (connections stay open)."""
        self.faults.append("stall")
        if self._flowing.is_set():
            self._flowing = anyio.Event()

    def release(self) -> None:
        """Resume forwarding after :meth:`stall`; buffered bytes are delivered."""
        self._flowing.set()

    def stall_for(self, seconds: float) -> None:
        """Stall now and release after *seconds* (in the proxy's task group)."""
        self.stall()

        async def release_later() -> None:
            await anyio.sleep(seconds)
            self.release()

        self._group.start_soon(release_later)

    def half_close(self, direction: Direction) -> int:
        """Send EOF in *direction* on every live connection and stop forwarding that way; returns the count."""
        self.faults.append(f"half_close:{direction}")
        for link in list(self._links):
            link.pumps[direction].cancel()
        return len(self._links)

    def cut_after(self, n_bytes: int, direction: Direction = "to_server") -> None:
        """Forward *n_bytes* more bytes in *direction* (any connection), then close that connection."""
        if n_bytes < 0:
            raise ValueError(f"n_bytes must be >= 0, got {n_bytes}")
        self.faults.append(f"cut:{direction}:{n_bytes}")
        self._cut = _Cut(direction, n_bytes)

    @property
    def cut_pending(self) -> bool:
        """Whether an armed :meth:`cut_after` has not fired yet."""
        return self._cut is not None

    def heal(self) -> None:
        """Release a stall and disarm a pending cut (live connections are left as they are)."""
        self._cut = None
        self.release()

    # --- forwarding -------------------------------------------------------------------------

    async def _handle(self, client: SocketStream) -> None:
        async with client:
            try:
                upstream = await anyio.connect_tcp(self.upstream_host, self.upstream_port)
            except OSError:
                return  # the client sees its connection closed, as with a dead server
            async with upstream:
                link = _Link()
                self._links.add(link)
                self.connections += 1
                try:
                    with link.scope:
                        async with anyio.create_task_group() as pumps:
                            pumps.start_soon(self._pump, client, upstream, link, "to_server")
                            pumps.start_soon(self._pump, upstream, client, link, "to_client")
                finally:
                    self._links.discard(link)

    async def _pump(self, source: SocketStream, sink: SocketStream, link: _Link, direction: Direction) -> None:
        with link.pumps[direction]:
            while True:
                try:
                    data = await source.receive(_CHUNK_BYTES)
                except anyio.EndOfStream:
                    break
                except _STREAM_ERRORS:
                    link.scope.cancel()
                    return
                await self._flowing.wait()
                data, cut_here = self._apply_cut(data, direction)
                try:
                    if data:
                        await sink.send(data)
                        self.bytes_forwarded[direction] += len(data)
                except _STREAM_ERRORS:
                    link.scope.cancel()
                    return
                if cut_here:
                    link.scope.cancel()
                    return
        # End of stream or half-close: pass the EOF on and stop this direction only.
        with anyio.CancelScope(shield=True):
            try:
                await sink.send_eof()
            except _STREAM_ERRORS:
                link.scope.cancel()

    def _apply_cut(self, data: bytes, direction: Direction) -> tuple[bytes, bool]:
        cut = self._cut
        if cut is None or cut.direction != direction:
            return data, False
        if len(data) < cut.remaining:
            cut.remaining -= len(data)
            return data, False
        self._cut = None
        return data[: cut.remaining], True


@asynccontextmanager
async def tcp_proxy(upstream_host: str, upstream_port: int) -> AsyncIterator[FaultProxy]:
    """Run a :class:`FaultProxy` to ``upstream_host:upstream_port`` for the block."""
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
    async with listener, anyio.create_task_group() as group:
        proxy = FaultProxy(upstream_host, upstream_port, group)
        proxy.port = int(listener.extra(anyio.abc.SocketAttribute.local_port))
        group.start_soon(listener.serve, proxy._handle, group)
        try:
            yield proxy
        finally:
            proxy.release()
            group.cancel_scope.cancel()
