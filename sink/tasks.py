"""Task groups whose failure is one error, as a single call's would be.

anyio raises a failed task group's errors as an ``ExceptionGroup``, even when there is one. The library runs some
calls concurrently (one read per cluster node or slot, the rollouts of one pull); their callers catch
:class:`~sink.errors.StagingError` as they would for one call, so :func:`task_group` raises the first of the
errors when every error is of the kinds the caller expects, with the whole group as its ``__cause__``. Anything
else (a cancellation, a bug) propagates as anyio raised it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
from anyio.abc import TaskGroup

from sink.errors import StagingError

__all__ = ("task_group",)


@asynccontextmanager
async def task_group(
    expected: tuple[type[BaseException], ...] = (StagingError,),
) -> AsyncIterator[TaskGroup]:
    """An anyio task group whose failure, when every error in it is an instance of *expected*, is the first one."""
    try:
        async with anyio.create_task_group() as group:
            yield group
    except BaseExceptionGroup as exc:
        matched, rest = exc.split(expected)
        if matched is None or rest is not None:
            raise
        first: BaseException = matched
        while isinstance(first, BaseExceptionGroup):
            first = first.exceptions[0]
        raise first from exc
