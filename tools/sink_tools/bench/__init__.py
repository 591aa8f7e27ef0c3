"""Benchmarks runnable as ``python -m sink_tools.bench.<name>`` (and ``staging-sink bench <name>``).

Each module has a ``main(argv=None) -> int`` entry point and a function that returns the measured figures,
so the CLI and tests can use them directly.

Benchmarks never destroy data. Without ``--redis-url`` each starts a private durable server. With
``--redis-url`` a benchmark works only in its own namespace (``--namespace``, default
:data:`DEFAULT_BENCH_NAMESPACE`): :func:`bench_namespace` refuses a server that already has a key in it
(:class:`BenchmarkNamespaceInUseError`), and deletes only the keys under ``<namespace>:``
(``SCAN MATCH <namespace>:*`` + ``UNLINK``) between configurations and at the end, even on failure. No
benchmark sends ``FLUSHALL``/``FLUSHDB``.

Shared here as well: :func:`progress` (one line to stderr while a benchmark runs), :class:`Target` and
:func:`format_targets` (a PASS/MISS line per target), :func:`add_common_arguments`, and :func:`report_on_server`
(the end of every benchmark's ``main``: the server, an ``error:`` line, the report), :func:`drive` (items
through an operation by concurrent tasks, each call timed) and :func:`percentile_ms`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import anyio
import redis.asyncio as aioredis

from sink.errors import StagingError
from sink.server import DurableServer
from sink.store.connection import reply_text

__all__ = (
    "DEFAULT_BENCH_NAMESPACE",
    "DEFAULT_REPEATS",
    "BenchHelpFormatter",
    "BenchNamespace",
    "BenchmarkNamespaceInUseError",
    "Target",
    "add_common_arguments",
    "bench_namespace",
    "drive",
    "format_targets",
    "on_server",
    "percentile_ms",
    "progress",
    "report_on_server",
)


class BenchmarkNamespaceInUseError(StagingError):
    """Raised when a benchmark is pointed at a server that already holds keys in the benchmark's namespace:
    a benchmark works only in a namespace it has to itself, so it can delete everything it wrote and nothing
    else. Nothing is written or deleted. The message names the namespace and one key found."""

T = TypeVar("T")


class BenchHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` of a benchmark: each option's default shown (``None`` and ``False`` defaults left out)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


DEFAULT_BENCH_NAMESPACE = "stg-bench"
"""The namespace a benchmark writes in unless told otherwise (never the services' default ``stg``)."""
DEFAULT_REPEATS = 3
"""Timed repeats per figure; the best is reported."""
_SCAN_COUNT = 1000
_UNLINK_BATCH = 500


def on_server(redis_url: str | None, run: Callable[[str, DurableServer | None], T]) -> T:
    """``run(url, server)`` on *redis_url*, or on a private durable server started for it (``server`` set)."""
    if redis_url:
        return run(redis_url, None)
    with DurableServer() as server:
        return run(server.url, server)


def report_on_server(
    redis_url: str | None,
    run: Callable[[str, DurableServer | None], T],
    render: Callable[[T], str],
    *,
    as_json: bool = False,
    to_json: Callable[[T], object] = lambda figures: figures,
) -> int:
    """A benchmark's ``main`` after its arguments: :func:`on_server`, then the report on stdout (``render``, or
    with *as_json* ``to_json`` of the figures as indented JSON); a :class:`~sink.errors.StagingError` is one
    ``error:`` line on stderr.

    :returns: the exit code (0, or 1 after an error).
    """
    try:
        figures = on_server(redis_url, run)
    except StagingError as exc:
        sys.stderr.write(f"error: {exc}\n")
        return 1
    sys.stdout.write((json.dumps(to_json(figures), indent=2) if as_json else render(figures)) + "\n")
    return 0


def percentile_ms(values: Sequence[float], q: float) -> float:
    """The *q* quantile (0..1, nearest rank) of *values* in seconds, in milliseconds."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000.0


async def drive(
    items: Sequence[Any], concurrency: int, op: Callable[[Any], Awaitable[None]]
) -> tuple[float, list[float]]:
    """``op(item)`` for every item of *items*, by *concurrency* tasks taking the next item in turn.

    :returns: the elapsed seconds and each call's seconds.
    """
    latencies: list[float] = []
    position = 0

    async def task() -> None:
        nonlocal position
        while position < len(items):
            item = items[position]
            position += 1
            start = time.perf_counter()
            await op(item)
            latencies.append(time.perf_counter() - start)

    start = time.perf_counter()
    async with anyio.create_task_group() as group:
        for _ in range(concurrency):
            group.start_soon(task)
    return time.perf_counter() - start, latencies


def progress(message: str) -> None:
    """One progress line on stderr (stdout stays the report, so ``--json`` output remains parseable)."""
    sys.stderr.write(f"bench: {message}\n")
    sys.stderr.flush()


@dataclass(frozen=True, slots=True)
class BenchNamespace:
    """The namespace one benchmark run owns on the server at :attr:`url`."""

    url: str
    namespace: str

    @property
    def pattern(self) -> str:
        """The ``SCAN MATCH`` pattern of every key in the namespace: ``<namespace>:*``."""
        return f"{self.namespace}:*"

    async def first_key(self) -> str | None:
        """One key of the namespace, or ``None`` when it has none."""
        async with aioredis.Redis.from_url(self.url) as client:
            async for key in client.scan_iter(match=self.pattern, count=_SCAN_COUNT):
                return reply_text(key, "key")
        return None

    async def clear(self) -> int:
        """Delete every key of the namespace (and no other); returns how many were deleted."""
        deleted = 0
        async with aioredis.Redis.from_url(self.url) as client:
            batch: list[bytes] = []
            async for key in client.scan_iter(match=self.pattern, count=_SCAN_COUNT):
                batch.append(key)
                if len(batch) >= _UNLINK_BATCH:
                    deleted += int(await client.unlink(*batch))
                    batch = []
            if batch:
                deleted += int(await client.unlink(*batch))
        return deleted


@asynccontextmanager
async def bench_namespace(url: str, namespace: str = DEFAULT_BENCH_NAMESPACE) -> AsyncIterator[BenchNamespace]:
    """Own *namespace* on the server at *url* for one benchmark run.

    Its keys are deleted on exit (also after an error or cancellation); no other key is touched.

    :raises BenchmarkNamespaceInUseError: the namespace already has a key (nothing is written or deleted).
    :raises ValueError: *namespace* is not ``[A-Za-z0-9._-]+`` (which also keeps ``SCAN MATCH`` literal).
    """
    if not namespace or not all(c.isascii() and (c.isalnum() or c in "._-") for c in namespace):
        raise ValueError(f"benchmark namespace must be [A-Za-z0-9._-]+, got {namespace!r}")
    space = BenchNamespace(url=url, namespace=namespace)
    found = await space.first_key()
    if found is not None:
        raise BenchmarkNamespaceInUseError(
            f"the server already has keys in the benchmark namespace {namespace!r} (e.g. {found!r}); a benchmark "
            "runs only in a namespace of its own: choose another with --namespace, or run without --redis-url "
            "to use a private server"
        )
    try:
        yield space
    finally:
        await space.clear()


@dataclass(frozen=True, slots=True)
class Target:
    """One documented target: ``value`` must be ``<=`` or ``>=`` ``limit``."""

    name: str
    value: float
    op: Literal["<=", ">="]
    limit: float
    unit: str = ""

    @property
    def met(self) -> bool:
        """Whether the measured value meets the target."""
        return self.value <= self.limit if self.op == "<=" else self.value >= self.limit

    def line(self) -> str:
        """``PASS name: value unit (target op limit)`` or ``MISS ...``."""
        unit = f" {self.unit}" if self.unit and self.unit != "x" else self.unit
        verdict = "PASS" if self.met else "MISS"
        return f"{verdict} {self.name}: {self.value:.2f}{unit} (target {self.op} {self.limit:g}{unit})"


def format_targets(targets: Sequence[Target]) -> list[str]:
    """A heading and one PASS/MISS line per target."""
    met = sum(target.met for target in targets)
    return [f"targets: {met} of {len(targets)} met", *(f"  {target.line()}" for target in targets)]


def add_common_arguments(parser: argparse.ArgumentParser, *, server: bool = True) -> None:
    """``--repeats`` and ``--json`` (and, with *server*, ``--redis-url`` and ``--namespace``)."""
    if server:
        parser.add_argument(
            "--redis-url",
            help="use this durable server instead of a private one; only keys under --namespace are written and "
            "deleted, and a namespace that already has keys is refused (default: start a private server)",
        )
        parser.add_argument(
            "--namespace",
            default=DEFAULT_BENCH_NAMESPACE,
            help=f"key namespace the benchmark owns (default: {DEFAULT_BENCH_NAMESPACE})",
        )
    parser.add_argument(
        "--repeats",
        type=int,
        default=DEFAULT_REPEATS,
        help=f"timed repeats per figure, best kept (default: {DEFAULT_REPEATS})",
    )
    parser.add_argument("--json", action="store_true", help="print the raw figures as JSON (default: a table)")
