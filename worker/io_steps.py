"""Capture steps that make I/O requests, and the two drivers that perform them (blocking or awaited).

:class:`~worker.capture.RolloutTokenCapture` writes each step of a call once,
as a generator that yields :class:`IoRequest` objects (``source.fetch`` or
``sink.stage``), one at a time, and receives each one's result, or the exception thrown in when the
operation raised one the step handles (:attr:`IoRequest.handles`: the store's
typed errors); any other exception is a bug and propagates to the host's
boundary. :func:`run_blocking` performs the request in the calling thread,
:func:`run_async` awaits it (or runs a blocking one in a worker thread), so
the synchronous methods and their ``a``-prefixed async twins cannot drift.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any, Generic, TypeVar, cast

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
"""Pure capture steps that yield :class:`IoRequest` objects one at a time and receive each one's result (or its
exception)."""


@dataclass(frozen=True, slots=True)
class _Done(Generic[_T]):
    """What a step returned when it finished."""

    value: _T


def _advance(steps: Steps[_T], result: object, error: Exception | None) -> IoRequest | _Done[_T]:
    """Send *result* (or throw *error*) into *steps*: its next request, or its return value."""
    try:
        return steps.send(result) if error is None else steps.throw(error)
    except StopIteration as done:
        return _Done(cast(_T, done.value))


def run_blocking(steps: Steps[_T], async_misuse: str) -> _T:
    """Drive *steps*, performing their I/O in this thread.

    :raises CaptureError: *async_misuse*, when a step asks for an asynchronous operation.
    """
    result: object = None
    error: Exception | None = None
    while not isinstance(io := _advance(steps, result, error), _Done):
        result, error = None, None
        if io.is_async:
            steps.close()
            raise CaptureError(async_misuse)
        try:
            result = io.operation(io.argument)
        except io.handles as exc:
            error = exc
        except BaseException:
            steps.close()
            raise
    return io.value


async def run_async(steps: Steps[_T]) -> _T:
    """Drive *steps*, awaiting an async operation or running a blocking one in a worker thread."""
    result: object = None
    error: Exception | None = None
    while not isinstance(io := _advance(steps, result, error), _Done):
        result, error = None, None
        try:
            if io.is_async:
                result = await io.operation(io.argument)
            else:
                result = await anyio.to_thread.run_sync(io.operation, io.argument)
        except io.handles as exc:  # cancellation is a BaseException and propagates
            error = exc
        except BaseException:
            steps.close()
            raise
    return io.value
