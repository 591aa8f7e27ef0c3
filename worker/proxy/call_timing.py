"""Where one captured call's time goes: waiting for the engine, staging and committing, and the proxy's own rest.

:func:`call_clock` starts a :class:`CallClock` for the request being served (a context variable, so the
engine requests a call makes from its child tasks count too); :func:`engine_span` marks the time spent waiting for
one engine answer. Engine spans that overlap (two renders at once) count once: ``engine_s`` is the length of
their union. With ``ProxySettings.server_timing`` the proxy reports the figures on each captured call's response as
a W3C ``Server-Timing`` header (``engine``, ``capture``, ``total``, in ms): the proxy's own share of a call is
``total - engine`` (``staging-sink bench proxy`` reads it).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

__all__ = (
    "SERVER_TIMING_HEADER",
    "CallClock",
    "Span",
    "call_clock",
    "current_call_clock",
    "engine_span",
    "note_capture",
    "timing_headers",
)

SERVER_TIMING_HEADER = b"server-timing"
_CLOCK: ContextVar[CallClock | None] = ContextVar("staging_proxy_call_clock", default=None)


@dataclass
class CallClock:
    """The timings of one captured call (``time.perf_counter`` seconds)."""

    started: float = field(default_factory=time.perf_counter)
    engine_spans: list[tuple[float, float]] = field(default_factory=list)
    capture_s: float = 0.0
    """Staging the delta and committing the ledger row."""

    @property
    def engine_s(self) -> float:
        """Wall time spent waiting for engine answers (overlapping waits counted once)."""
        total, reached = 0.0, float("-inf")
        for start, end in sorted(self.engine_spans):
            if end > reached:
                total += end - max(start, reached)
                reached = end
        return total

    def header_value(self) -> bytes:
        """The ``Server-Timing`` value: ``engine``, ``capture`` and ``total`` so far, in ms."""
        total = time.perf_counter() - self.started
        return (
            f"engine;dur={self.engine_s * 1e3:.3f}, capture;dur={self.capture_s * 1e3:.3f}, total;dur={total * 1e3:.3f}"
        ).encode()


@contextmanager
def call_clock() -> Iterator[CallClock]:
    """A fresh clock for the call served inside the block (child tasks started inside see it too)."""
    clock = CallClock()
    token = _CLOCK.set(clock)
    try:
        yield clock
    finally:
        _CLOCK.reset(token)


def current_call_clock() -> CallClock | None:
    """The clock of the call being served, if one was started."""
    return _CLOCK.get()


@dataclass
class Span:
    """One wait for the engine; ``seconds`` is set when it ends."""

    started: float = field(default_factory=time.perf_counter)
    seconds: float = 0.0


@contextmanager
def engine_span() -> Iterator[Span]:
    """Time the enclosed wait for an engine answer, counted on the current call's clock (if one runs)."""
    span = Span()
    try:
        yield span
    finally:
        ended = time.perf_counter()
        span.seconds = ended - span.started
        clock = _CLOCK.get()
        if clock is not None:
            clock.engine_spans.append((span.started, ended))


def note_capture(seconds: float) -> float:
    """Record the current call's stage-and-commit time (if a clock runs); returns *seconds*."""
    clock = _CLOCK.get()
    if clock is not None:
        clock.capture_s = seconds
    return seconds


def timing_headers() -> list[tuple[bytes, bytes]]:
    """The ``Server-Timing`` header of the current call when a clock runs (``ProxySettings.server_timing``)."""
    clock = _CLOCK.get()
    if clock is None:
        return []
    return [(SERVER_TIMING_HEADER, clock.header_value())]
