"""Capture steps that make one I/O request, and the two drivers that perform it (blocking or awaited).

:class:`~worker.capture.RolloutTokenCapture` writes each step of a call once,
as a generator that yields at most one :class:`IoRequest` (``source.fetch`` or
``sink.stage``) and receives its result, or the exception thrown in when the
operation raised one the step handles (:attr:`IoRequest.handles`: the store's
typed errors); any other exception is a bug and propagates to the host's
boundary. :func:`run_blocking` performs the request in the calling thread,
:func:`run_async` awaits it (or runs a blocking one in a worker thread), so
the synchronous methods and their ``a``-prefixed async twins cannot drift.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import anyio.to_thread

from sink.errors import StagingError
from worker.errors import CaptureError

__all__ = ("IoRequest", "Steps", "run_async", "run_blocking")

_T = TypeVar("_T")


@dataclass(frozen=True, slots=True)
class IoRequest:
    """The one I/O request of a capture step: ``operation(argument)``, awaited when ``is_async``; an exception of
    *handles* is thrown into the step (it turns it into failed coordinates), any other propagates."""

    operation: Callable[[Any], Any]
    argument: object
    is_async: bool
    handles: tuple[type[Exception], ...] = (StagingError,)


Steps = Generator[IoRequest, Any, _T]
"""Pure capture steps that yield at most one :class:`IoRequest` and receive its result (or its exception)."""


def _resume(steps: Steps[_T], *, result: object = None, error: Exception | None = None) -> _T:
    try:
        if error is None:
            steps.send(result)
        else:
            steps.throw(error)
    except StopIteration as done:
        return cast(_T, done.value)
    raise AssertionError("a capture step makes at most one I/O request")


def run_blocking(steps: Steps[_T], async_misuse: str) -> _T:
    """Drive *steps*, performing their I/O in this thread.

    :raises CaptureError: *async_misuse*, when the step asks for an asynchronous operation.
    """
    try:
        io = next(steps)
    except StopIteration as done:
        return cast(_T, done.value)
    if io.is_async:
        steps.close()
        raise CaptureError(async_misuse)
    try:
        result = io.operation(io.argument)
    except io.handles as exc:
        return _resume(steps, error=exc)
    except BaseException:
        steps.close()
        raise
    return _resume(steps, result=result)


async def run_async(steps: Steps[_T]) -> _T:
    """Drive *steps*, awaiting an async operation or running a blocking one in a worker thread."""
    try:
        io = next(steps)
    except StopIteration as done:
        return cast(_T, done.value)
    try:
        if io.is_async:
            result = await io.operation(io.argument)
        else:
            result = await anyio.to_thread.run_sync(io.operation, io.argument)
    except io.handles as exc:  # cancellation is a BaseException and propagates
        return _resume(steps, error=exc)
    except BaseException:
        steps.close()
        raise
    return _resume(steps, result=result)
