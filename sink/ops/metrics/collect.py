"""The Redis-side state that ``stats`` prints and the exporter turns into gauges.

:func:`collect_redis_gauges` reads the length of every ``done``/``receipts``/``dead`` stream and each consumer
group's pending count, lag and consumers' idle times (``XINFO GROUPS``/``XINFO CONSUMERS``).
:func:`collect_server_gauges` reads each node's durability and memory, and counts the namespace's rollouts in
flight and retained receipts with :func:`count_rollouts` (one ``SCAN`` of the namespace per primary), the one
definition ``staging-sink stats`` shows too: a rollout **in flight** has a capture ledger and no receipt yet. Both need only the read-only ``ops``
ACL role, and walk the keyspace: an ops-tool cost, fine at scrape intervals, never on a hot path.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypedDict

import redis.asyncio as aioredis
import redis.exceptions as redis_errors

from sink.keys import DEFAULT_NAMESPACE
from sink.store.connection import reply_text
from sink.store.durability import verify_durability

__all__ = (
    "STREAM_KINDS",
    "GroupGauges",
    "NodeGauges",
    "RolloutCounts",
    "ServerGauges",
    "StreamGauges",
    "collect_redis_gauges",
    "collect_server_gauges",
    "count_rollouts",
    "node_address",
    "stream_labels",
)

STREAM_KINDS = ("done", "receipts", "dead")
"""The namespace's shared streams, ``<ns>:<kind>:<name>``, that the gauges cover."""
_SCAN_COUNT = 1000


class GroupGauges(TypedDict):
    """One consumer group: entries delivered but not acknowledged, entries not yet delivered (``None``
    where the server cannot tell, e.g. Redis 6.2 or after XDEL), its consumer count and each consumer's
    idle time in milliseconds."""

    pending: int
    lag: int | None
    consumers: int
    idle_ms: dict[str, int]


class StreamGauges(TypedDict):
    """One stream: its kind (``done``/``receipts``/``dead``/``other``), length and consumer groups."""

    kind: str
    length: int
    groups: dict[str, GroupGauges]


@dataclass(frozen=True, slots=True)
class NodeGauges:
    """One server node: whether it is durable (``appendfsync always`` etc.) and its memory in bytes."""

    durable: bool
    used_memory_bytes: int
    maxmemory_bytes: int


@dataclass(frozen=True, slots=True)
class ServerGauges:
    """Per node (``host:port``) gauges and the namespace's rollout counts."""

    nodes: dict[str, NodeGauges] = field(default_factory=dict)
    rollouts_in_flight: int = 0
    """Rollouts with a capture ledger and no receipt yet (:attr:`RolloutCounts.in_flight`)."""
    receipts_retained: int = 0
    """Stored receipts (``<ns>:{R}:receipt``), consumed or not."""


@dataclass(frozen=True, slots=True)
class RolloutCounts:
    """The namespace's rollouts by the keys they hold (:func:`count_rollouts`)."""

    in_flight: int
    """Rollouts **in flight**: a capture ledger and no receipt yet, so still being captured, or finished and not
    yet assembled. A rollout leaves it when its receipt is stored (it is the trainer's then, until its ack
    deletes the ledger); a rollout that never finishes stays until ``prune`` abandons it."""
    receipts_retained: int
    """Stored receipts (``<ns>:{R}:receipt``): assembled rollouts, consumed (kept for ``retention_s``) or not."""


def stream_labels(namespace: str, stream: str) -> tuple[str, str]:
    """``(kind, shard)`` of a shared stream name ``<ns>:<kind>:<shard>`` (kind ``other`` when not one of ours)."""
    prefix, _, rest = stream.partition(":")
    kind, _, shard = rest.partition(":")
    if prefix != namespace or kind not in STREAM_KINDS:
        return "other", stream
    return kind, shard


def node_address(client: aioredis.Redis) -> str:
    """``host:port`` of a node's client (the ``node`` label)."""
    kwargs = client.connection_pool.connection_kwargs
    return f"{kwargs.get('host', '?')}:{kwargs.get('port', '?')}"


def _is_absent(exc: redis_errors.ResponseError) -> bool:
    text = str(exc).lower()
    return "no such key" in text or "wrongtype" in text


def _info_map(raw: Mapping[Any, Any]) -> dict[str, Any]:
    return {reply_text(key, "server reply"): value for key, value in raw.items()}


async def _groups(client: aioredis.Redis, stream: str, reply: Iterable[Mapping[Any, Any]]) -> dict[str, GroupGauges]:
    groups: dict[str, GroupGauges] = {}
    for raw in reply:
        info = _info_map(raw)
        name = reply_text(info["name"], "server reply")
        lag = info.get("lag")
        consumers = [_info_map(c) for c in await client.xinfo_consumers(stream, name)]
        groups[name] = GroupGauges(
            pending=int(info.get("pending", 0)),
            lag=None if lag is None else int(lag),
            consumers=int(info.get("consumers", 0)),
            idle_ms={reply_text(c["name"], "server reply"): int(c.get("idle", 0)) for c in consumers},
        )
    return groups


async def collect_redis_gauges(
    client: aioredis.Redis, namespace: str = DEFAULT_NAMESPACE, *, streams: Sequence[str] | None = None
) -> dict[str, StreamGauges]:
    """Length and consumer groups of each shared stream, by stream name, sorted.

    Without *streams*, the ``<ns>:done:*``, ``<ns>:receipts:*`` and ``<ns>:dead:*`` streams are found with
    ``SCAN ... TYPE stream``. Streams that do not exist (or are not streams) are left out.

    :raises redis.RedisError: the server cannot be reached or refuses a command (e.g. ``NOPERM``).
    """
    if streams is None:
        found: set[str] = set()
        for kind in STREAM_KINDS:
            async for key in client.scan_iter(match=f"{namespace}:{kind}:*", count=_SCAN_COUNT, _type="stream"):
                found.add(reply_text(key, "server reply"))
        names = sorted(found)
    else:
        names = list(streams)
    result: dict[str, StreamGauges] = {}
    for name in names:
        try:
            if reply_text(await client.type(name), "server reply") != "stream":
                continue
            length = int(await client.xlen(name))
            groups = await _groups(client, name, await client.xinfo_groups(name))
        except redis_errors.ResponseError as exc:
            if _is_absent(exc):
                continue
            raise
        result[name] = StreamGauges(kind=stream_labels(namespace, name)[0], length=length, groups=groups)
    return result


async def _node(client: aioredis.Redis) -> NodeGauges:
    report = await verify_durability([client])
    memory = _info_map(await client.info("memory"))
    return NodeGauges(
        durable=report.problem is None,
        used_memory_bytes=int(memory.get("used_memory", 0)),
        maxmemory_bytes=int(memory.get("maxmemory", 0)),
    )


async def count_rollouts(primaries: Sequence[aioredis.Redis], namespace: str) -> RolloutCounts:
    """Rollouts in flight and receipts retained, counted with ``SCAN MATCH <ns>:{*}`` on every primary in
    *primaries* (the exporter's gauges and ``staging-sink stats`` both use it).

    :raises redis.RedisError: a node cannot be reached or refuses a command.
    """
    ledgers: set[str] = set()
    receipts: set[str] = set()
    for primary in primaries:
        async for raw in primary.scan_iter(match=f"{namespace}:{{*}}:*", count=_SCAN_COUNT):
            key = reply_text(raw, "server reply")
            tag, _, suffix = key[len(namespace) + 1 :].partition("}:")
            if suffix == "ledger":
                ledgers.add(tag)
            elif suffix == "receipt":
                receipts.add(tag)
    return RolloutCounts(in_flight=len(ledgers - receipts), receipts_retained=len(receipts))


async def collect_server_gauges(
    nodes: Sequence[aioredis.Redis], primaries: Sequence[aioredis.Redis], namespace: str = DEFAULT_NAMESPACE
) -> ServerGauges:
    """Durability and memory of every node in *nodes*; rollouts in flight and receipts retained
    (:func:`count_rollouts` on *primaries*).

    :raises redis.RedisError: a node cannot be reached or refuses a command.
    """
    per_node = {node_address(node): await _node(node) for node in nodes}
    counts = await count_rollouts(primaries, namespace)
    return ServerGauges(
        nodes=per_node, rollouts_in_flight=counts.in_flight, receipts_retained=counts.receipts_retained
    )
