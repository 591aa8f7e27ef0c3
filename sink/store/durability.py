"""Verify that a server acknowledges writes only after they are on disk (contract §11.2).

With ``appendonly yes``, ``appendfsync always`` and ``no-appendfsync-on-rewrite
no``, Redis 7+ and Valkey 8 reply to a write only after ``fdatasync`` of the
AOF; ``maxmemory-policy noeviction`` makes sure nothing acknowledged is evicted.
:class:`DurabilityMonitor` keeps a sink's verdict fresh.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import anyio
import redis.asyncio as aioredis
import redis.exceptions as redis_errors

from sink.settings import SinkSettings
from sink.store.connection import Topology, describe_redis_error, reply_text
from sink.store.server_version import supports_waitaof

__all__ = (
    "REQUIRED_CONFIG",
    "DurabilityMonitor",
    "DurabilityReport",
    "config_problem",
    "node_address",
    "verify_durability",
)

logger = logging.getLogger(__name__)

REQUIRED_CONFIG: dict[str, str] = {
    "appendonly": "yes",
    "appendfsync": "always",
    "no-appendfsync-on-rewrite": "no",
    "maxmemory-policy": "noeviction",
}


@dataclass(frozen=True, slots=True)
class DurabilityReport:
    """Outcome of one verification: ``problem`` is ``None`` when every node is durable."""

    problem: str | None
    supports_waitaof: bool


def config_problem(address: str, replies: Sequence[object]) -> str | None:
    """What is wrong with one node's ``CONFIG GET`` replies (one per :data:`REQUIRED_CONFIG` name, in order).

    A reply may be the exception the pipeline returned for that command.
    """
    values: dict[str, str] = {}
    for reply in replies:
        if isinstance(reply, BaseException):
            return f"cannot verify durability of {address}: CONFIG GET refused ({describe_redis_error(reply)})"
        if not isinstance(reply, dict):
            return f"cannot verify durability of {address}: unexpected CONFIG GET reply {type(reply).__name__}"
        for key, value in reply.items():
            values[reply_text(key, "CONFIG GET reply")] = reply_text(value, "CONFIG GET reply")
    wrong = [
        f"{name}={values.get(name, '<missing>')!r} (need {expected!r})"
        for name, expected in REQUIRED_CONFIG.items()
        if values.get(name) != expected
    ]
    return f"server {address} is not durable: " + ", ".join(wrong) if wrong else None


async def _check_node(client: aioredis.Redis) -> tuple[str | None, bool]:
    address = node_address(client)
    try:
        # One name per CONFIG GET: Redis 6.2 takes a single pattern.
        replies = [await client.config_get(name) for name in REQUIRED_CONFIG]
        server_info = await client.info("server")
    except redis_errors.ResponseError as exc:
        return f"cannot verify durability of {address}: CONFIG GET refused ({describe_redis_error(exc)})", False
    except (redis_errors.RedisError, OSError) as exc:
        return f"cannot verify durability of {address}: {describe_redis_error(exc)}", False
    problem = config_problem(address, replies)
    if problem is not None:
        return problem, False
    return None, supports_waitaof(server_info)


def node_address(client: aioredis.Redis) -> str:
    """``host:port`` of a single-node client (for messages)."""
    kwargs = client.connection_pool.connection_kwargs
    return f"{kwargs.get('host', '?')}:{kwargs.get('port', '?')}"


async def verify_durability(nodes: Sequence[aioredis.Redis]) -> DurabilityReport:
    """Check every node's persistence settings; the first problem found wins."""
    supports_waitaof = True
    for client in nodes:
        problem, waitaof = await _check_node(client)
        if problem is not None:
            return DurabilityReport(problem=problem, supports_waitaof=False)
        supports_waitaof = supports_waitaof and waitaof
    return DurabilityReport(problem=None, supports_waitaof=supports_waitaof)


class DurabilityMonitor:
    """A sink's durability verdict over every node of its topology, re-verified every ``durability_check_interval_s``.

    A failed check is not cached: the next :meth:`report` verifies again.
    """

    def __init__(self, topology: Topology, settings: SinkSettings) -> None:
        self._topology = topology
        self._settings = settings
        self._report: DurabilityReport | None = None
        self._checked_at = -math.inf
        self._lock = anyio.Lock()

    @property
    def supports_waitaof(self) -> bool:
        """Whether the last verdict found ``WAITAOF`` on every node (and durability is ``fsync``)."""
        report = self._report
        return report is not None and report.supports_waitaof and self._settings.durability == "fsync"

    def invalidate(self, problem: str) -> None:
        """Record that a write batch found *problem*: stages fail with it until a fresh check passes."""
        self._report = DurabilityReport(problem=problem, supports_waitaof=False)
        self._checked_at = -math.inf
        logger.error("staging sink refuses to acknowledge writes: %s", problem)

    def _fresh(self) -> bool:
        return time.monotonic() - self._checked_at < self._settings.durability_check_interval_s

    async def report(self, *, force: bool = False) -> DurabilityReport:
        """The current verdict (``problem=None`` when writes may be acknowledged), verified again when stale."""
        if self._settings.durability == "none":
            return DurabilityReport(problem=None, supports_waitaof=False)
        if self._report is not None and self._fresh() and not force:
            return self._report
        async with self._lock:
            if self._report is None or not self._fresh() or force:
                report = await self._verify_all_nodes()
                self._report = report
                # A failed check is retried on the next stage rather than cached.
                self._checked_at = time.monotonic() if report.problem is None else -math.inf
                if report.problem is not None:
                    logger.error("staging sink refuses to acknowledge writes: %s", report.problem)
        assert self._report is not None
        return self._report

    async def _verify_all_nodes(self) -> DurabilityReport:
        try:
            nodes = await self._topology.all_nodes()
            # The replicas WAIT counts must be durable too: a standalone primary's, not only a cluster's.
            replicas = await self._topology.standalone_replicas() if self._settings.min_replicas > 0 else []
        except (redis_errors.RedisError, OSError) as exc:
            return DurabilityReport(
                problem=f"cannot verify durability: {describe_redis_error(exc)}", supports_waitaof=False
            )
        report = await verify_durability(nodes)
        if report.problem is not None or not replicas:
            return report
        problems: list[str | None] = [None] * len(replicas)
        timeout_s = self._settings.confirm_timeout_s

        async def check(index: int, replica: aioredis.Redis) -> None:
            # A frozen replica must not hold the sink longer than a WAIT would.
            problems[index] = f"replica {node_address(replica)} did not answer within confirm_timeout_s={timeout_s}"
            with anyio.move_on_after(timeout_s):
                problems[index], _waitaof = await _check_node(replica)

        async with anyio.create_task_group() as group:
            for index, replica in enumerate(replicas):
                group.start_soon(check, index, replica)
        durable = problems.count(None)
        if durable < self._settings.min_replicas:
            return DurabilityReport(
                problem=f"only {durable} of {len(replicas)} replicas are durable (min_replicas="
                f"{self._settings.min_replicas}): " + "; ".join(p for p in problems if p is not None),
                supports_waitaof=False,
            )
        return report
