"""Benchmarks runnable as ``python -m sink.bench.<name>`` (and ``staging-sink bench <name>``).

Each module has a ``main(argv=None) -> int`` entry point and a function that
returns the measured figures, so the CLI and tests can use them directly.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from ..server import DurableServer, durable_server

__all__ = ("on_server",)

T = TypeVar("T")


def on_server(redis_url: str | None, run: Callable[[str, DurableServer | None], T]) -> T:
    """``run(url, server)`` on *redis_url*, or on a private durable server started for it (``server`` set)."""
    if redis_url:
        return run(redis_url, None)
    with durable_server() as server:
        return run(server.url, server)
