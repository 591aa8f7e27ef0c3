"""Run an async resource on a private event-loop thread, for synchronous callers.

Inference servers with synchronous hooks call ``stage``/``fetch`` from many
threads; each call is submitted to one background asyncio loop (an anyio
blocking portal), so a slow call never blocks another.
"""

from __future__ import annotations

import threading
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager, AbstractContextManager
from types import TracebackType
from typing import Any, Self, TypeVar

from anyio.from_thread import BlockingPortal, start_blocking_portal

__all__ = ("PortalOwner",)

T = TypeVar("T")


class PortalOwner:
    """Owns a background loop thread and one async context manager entered on it.

    Subclasses call :meth:`_call` to run a coroutine function on the loop.
    """

    def __init__(self, resource: AbstractAsyncContextManager[Any]) -> None:
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
