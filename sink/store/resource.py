"""The resource lifecycle: :class:`AsyncResource` (open on entry, close once) and :class:`PortalOwner`, its
synchronous facade on a private event-loop thread; :func:`settings_or_fields`, the one ``from_url`` signature.

The sync facade: inference servers with synchronous hooks call ``stage``/``fetch`` from many
threads; each call is submitted to one background asyncio loop (an anyio
blocking portal), so a slow call never blocks another.
"""

from __future__ import annotations

import threading
from collections.abc import Awaitable, Callable, Mapping
from contextlib import AbstractContextManager
from types import TracebackType
from typing import Any, Generic, Self, TypeVar

import anyio
from anyio.from_thread import BlockingPortal, start_blocking_portal

from ..settings import ConnectionSettings

__all__ = ("AsyncResource", "PortalOwner", "settings_or_fields")

T = TypeVar("T")
_Settings = TypeVar("_Settings", bound=ConnectionSettings)
_Resource = TypeVar("_Resource", bound="AsyncResource")


def settings_or_fields(
    settings_type: type[_Settings], settings: _Settings | None, fields: Mapping[str, Any]
) -> _Settings:
    """*settings*, or a *settings_type* built from setting *fields* (the two ways to call a ``from_url``).

    :raises TypeError: both were given.
    :raises pydantic.ValidationError: an unknown or invalid setting.
    """
    if settings is not None and fields:
        raise TypeError("pass either settings or setting fields, not both")
    return settings or settings_type(**fields)


class AsyncResource:
    """Async-context-manager lifecycle: :meth:`_open` on entry; on exit or :meth:`aclose`, exactly once,
    :meth:`_stop` then :meth:`_close_resources` (shielded).

    Subclasses implement :meth:`_close_resources` (what they own; a borrowed
    client stays open) and may override :meth:`_open` and :meth:`_stop`; a
    failing ``_open`` closes again before the error propagates.
    """

    _closed = False

    async def _open(self) -> None:
        """Prepare on ``async with`` entry; nothing by default."""

    async def _stop(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        """Wind down work started by :meth:`_open` (e.g. a task group entered there, which must exit unshielded
        in the task that entered it), with the exception leaving the ``async with`` block; nothing by default."""

    async def _close_resources(self) -> None:
        raise NotImplementedError

    async def __aenter__(self) -> Self:
        try:
            await self._open()
        except BaseException:
            await self.aclose()
            raise
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self._shutdown(exc_type, exc, tb)

    async def aclose(self) -> None:
        """Stop, then close the clients this object owns (a borrowed client stays open); idempotent."""
        await self._shutdown(None, None, None)

    async def _shutdown(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            await self._stop(exc_type, exc, tb)
        finally:
            with anyio.CancelScope(shield=True):
                await self._close_resources()


class PortalOwner(Generic[_Resource]):
    """The synchronous facade: owns a background loop thread and one :class:`AsyncResource` entered on it.

    Subclasses call :meth:`_call` to run a coroutine function (usually a method of ``self._resource``) on the loop.
    """

    def __init__(self, resource: _Resource) -> None:
        self._resource = resource
        self._lock = threading.Lock()
        self._portal_cm: AbstractContextManager[BlockingPortal] | None = start_blocking_portal(backend="asyncio")
        self._portal: BlockingPortal | None = self._portal_cm.__enter__()
        # The resource is entered and exited inside one task on the loop, as its
        # task group requires; this thread only waits for it.
        self._resource_cm = self._portal.wrap_async_context_manager(resource)
        try:
            self._resource_cm.__enter__()
        except BaseException:
            self._portal_cm.__exit__(None, None, None)
            self._portal = self._portal_cm = None
            raise

    def _call(self, func: Callable[..., Awaitable[T]], *args: Any) -> T:
        portal = self._portal
        if portal is None:
            raise RuntimeError(f"{type(self).__name__} is closed")
        return portal.call(func, *args)

    def close(self) -> None:
        """Finish pending work, close the resource and stop the loop thread (idempotent)."""
        with self._lock:
            portal, portal_cm = self._portal, self._portal_cm
            self._portal = self._portal_cm = None
        if portal is None or portal_cm is None:
            return
        try:
            self._resource_cm.__exit__(None, None, None)
        finally:
            portal_cm.__exit__(None, None, None)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
