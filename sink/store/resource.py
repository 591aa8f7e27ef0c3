"""The resource lifecycle: :class:`AsyncResource` (open on entry, close once) and :class:`PortalOwner`, its
synchronous facade on a private event-loop thread; :func:`settings_or_fields`, the one ``from_url`` signature.

The sync facade: inference servers with synchronous hooks call ``stage``/``fetch`` from many
threads; each call is submitted to one background asyncio loop (an anyio
blocking portal), so a slow call never blocks another.
"""

from __future__ import annotations

import logging
import queue
import threading
import warnings
import weakref
from collections.abc import Awaitable, Callable, Mapping
from contextlib import AbstractContextManager
from types import TracebackType
from typing import Any, Generic, Self, TypeVar

import anyio
from anyio.from_thread import BlockingPortal

from sink.settings import ConnectionSettings

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


class _LoopThread:
    """A blocking portal on an asyncio loop in a **daemon** thread.

    ``anyio.from_thread.start_blocking_portal`` runs its loop in a non-daemon thread, which the
    interpreter joins at exit: a facade whose ``close()`` was forgotten then kept the process alive
    forever. A daemon loop thread never does.
    """

    def __init__(self, name: str) -> None:
        handoff: queue.Queue[BlockingPortal | BaseException] = queue.Queue(1)

        async def serve() -> None:
            async with BlockingPortal() as portal:
                handoff.put(portal)
                await portal.sleep_until_stopped()

        def run() -> None:
            try:
                anyio.run(serve, backend="asyncio")
            except BaseException as exc:  # noqa: BLE001 (handed to the constructor waiting on startup)
                if handoff.empty():
                    handoff.put(exc)

        self.thread = threading.Thread(target=run, name=f"{name}-loop", daemon=True)
        self.thread.start()
        item = handoff.get()
        if isinstance(item, BaseException):
            raise item
        self.portal = item

    def stop(self) -> None:
        """Let the portal's tasks finish, stop the loop and join its thread."""
        if threading.current_thread() is self.thread:
            return  # cannot wait for ourselves; the daemon thread ends with the process
        try:
            self.portal.call(self.portal.stop)
        except RuntimeError:
            pass  # the loop is already gone
        self.thread.join()


def _close_forgotten(name: str, loop: _LoopThread, resource_cm: AbstractContextManager[Any]) -> None:
    """``weakref.finalize`` callback: a facade was collected, or the process exits, without ``close()``."""
    warnings.warn(f"unclosed {name}: call close() or use a with block", ResourceWarning, stacklevel=2)
    if threading.current_thread() is loop.thread:
        return  # collected on its own loop: cannot block here; the daemon thread does not keep the process
    try:
        resource_cm.__exit__(None, None, None)
    except Exception as exc:  # noqa: BLE001 (best effort on the way out; never raise from a finalizer)
        logging.getLogger(__name__).warning("closing an unclosed %s failed: %r", name, exc)
    finally:
        loop.stop()


class PortalOwner(Generic[_Resource]):
    """The synchronous facade: owns a background loop thread and one :class:`AsyncResource` entered on it.

    The loop thread is a daemon: a facade that is never closed does not keep the process alive. Such a
    facade is closed when it is garbage-collected or the interpreter exits, with a ``ResourceWarning``
    (shown with ``python -W always::ResourceWarning`` or ``-X dev``), as redis-py's own clients do.

    Subclasses call :meth:`_call` to run a coroutine function (usually a method of ``self._resource``) on the loop.
    """

    def __init__(self, resource: _Resource) -> None:
        self._resource = resource
        self._lock = threading.Lock()
        loop = _LoopThread(type(self).__name__)
        # The resource is entered and exited inside one task on the loop, as its
        # task group requires; this thread only waits for it.
        resource_cm = loop.portal.wrap_async_context_manager(resource)
        try:
            resource_cm.__enter__()
        except BaseException:
            loop.stop()
            raise
        self._loop: _LoopThread | None = loop
        self._portal: BlockingPortal | None = loop.portal
        self._resource_cm = resource_cm
        # No reference to self: the finalizer must not keep the facade alive.
        self._finalizer = weakref.finalize(self, _close_forgotten, type(self).__name__, loop, resource_cm)

    def _call(self, func: Callable[..., Awaitable[T]], *args: Any) -> T:
        portal = self._portal
        if portal is None:
            raise RuntimeError(f"{type(self).__name__} is closed")
        return portal.call(func, *args)

    def close(self) -> None:
        """Finish pending work, close the resource and stop the loop thread (idempotent)."""
        with self._lock:
            loop = self._loop
            self._portal = self._loop = None
        if loop is None:
            return
        self._finalizer.detach()
        try:
            self._resource_cm.__exit__(None, None, None)
        finally:
            loop.stop()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
