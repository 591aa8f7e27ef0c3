"""Verify that a server acknowledges writes only after they are on disk (architecture §4).

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

from ..settings import SinkSettings
from .connection import Topology, describe_redis_error, reply_text
from .server_version import supports_waitaof

__all__ = ("REQUIRED_CONFIG", "DurabilityMonitor", "DurabilityReport", "verify_durability")

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


async def _check_node(client: aioredis.Redis) -> tuple[str | None, bool]:
    address = _address(client)
    try:
        values: dict[str, str] = {}
        for name in REQUIRED_CONFIG:
            # One name per CONFIG GET: Redis 6.2 takes a single pattern.
            reply = await client.config_get(name)
            for key, value in reply.items():
                values[reply_text(key, "CONFIG GET reply")] = reply_text(value, "CONFIG GET reply")
        server_info = await client.info("server")
    except redis_errors.ResponseError as exc:
        return f"cannot verify durability of {address}: CONFIG GET refused ({describe_redis_error(exc)})", False
    except (redis_errors.RedisError, OSError) as exc:
        return f"cannot verify durability of {address}: {describe_redis_error(exc)}", False
    wrong = [
        f"{name}={values.get(name, '<missing>')!r} (need {expected!r})"
        for name, expected in REQUIRED_CONFIG.items()
        if values.get(name) != expected
    ]
    if wrong:
        return f"server {address} is not durable: " + ", ".join(wrong), False
    return None, supports_waitaof(server_info)


def _address(client: aioredis.Redis) -> str:
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
        except (redis_errors.RedisError, OSError) as exc:
            return DurabilityReport(
                problem=f"cannot verify durability: {describe_redis_error(exc)}", supports_waitaof=False
            )
        return await verify_durability(nodes)
