"""The ``done`` event that ends a rollout (contract §7.5): :func:`finished` writes it, the assembler parses it.

The framework calls :func:`finished` once a rollout is scored; it appends one
token-free event to ``ns:done:<shard>``, which an
:class:`~sink.rollout.assembler.Assembler` turns into the rollout's receipt.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import NamedTuple

import redis.asyncio as aioredis
from redis.asyncio.client import Pipeline
from redis.asyncio.cluster import RedisCluster

from sink.canonical import canonical_json
from sink.errors import CodecError
from sink.keys import DEFAULT_NAMESPACE, done_stream, shard_of, validate_rollout_id
from sink.settings import DEFAULT_SHARDS, ConnectionSettings
from sink.store.batch import BatchCall, write_durably
from sink.store.connection import Topology, reply_text
from sink.store.durability import Durability

__all__ = ("DoneEvent", "GroupTag", "finished", "group_fields", "parse_done_event", "parse_group_fields")


def _check_reward(reward: object) -> float | None:
    if reward is None:
        return None
    if isinstance(reward, bool) or not isinstance(reward, int | float):
        raise TypeError(f"reward must be a float or None, got {type(reward).__name__}")
    try:
        value = float(reward)  # an int beyond any float (10**400) overflows here
    except OverflowError:
        value = math.inf
    if not math.isfinite(value):
        shown = repr(reward) if isinstance(reward, float) else f"an int of {reward.bit_length()} bits"
        raise ValueError(f"reward must be finite, got {shown}")
    return value


class GroupTag(NamedTuple):
    """The GRPO group a rollout belongs to: all ``group_size`` rollouts of one prompt share ``group_id``."""

    group_id: str
    group_size: int


def _check_group(group_id: object, group_size: object) -> GroupTag | None:
    if group_id is None and group_size is None:
        return None
    if group_id is None or group_size is None:
        raise ValueError("group_id and group_size go together: pass both or neither")
    if not isinstance(group_id, str):
        raise TypeError(f"group_id must be a str, got {type(group_id).__name__}")
    if type(group_size) is not int or group_size < 1:
        raise ValueError(f"group_size must be an int >= 1, got {group_size!r}")
    return GroupTag(validate_rollout_id(group_id), group_size)


def group_fields(group: GroupTag | None) -> dict[str, str]:
    """The stream-entry fields that carry *group* (``group_id``, ``group_size``; empty strings for none)."""
    if group is None:
        return {"group_id": "", "group_size": ""}
    return {"group_id": group.group_id, "group_size": str(group.group_size)}


def parse_group_fields(fields: Mapping[str, str]) -> GroupTag | None:
    """The group carried by :func:`group_fields` (absent fields: no group, as events written before groups).

    :raises ValueError: the fields are malformed.
    """
    group_id = fields.get("group_id") or None
    size_text = fields.get("group_size") or None
    if group_id is None and size_text is None:
        return None
    if size_text is None or not size_text.isdigit():
        raise ValueError(f"malformed group_size {size_text!r}")
    return _check_group(group_id, int(size_text))


async def finished(
    client: aioredis.Redis | RedisCluster,
    rollout_id: str,
    *,
    reward: float | None,
    response: object = None,
    declared_response_id: str | None = None,
    namespace: str = DEFAULT_NAMESPACE,
    shards: int = DEFAULT_SHARDS,
    group_id: str | None = None,
    group_size: int | None = None,
    durability: Durability = "fsync",
    confirm_timeout_s: float = 5.0,
) -> str:
    """Announce that *rollout_id* finished: one token-free event on ``ns:done:<shard_of(rollout_id, shards)>``.

    Event fields: ``rollout_id``, ``reward`` (JSON), ``response`` (canonical
    JSON, or empty for ``None``), ``declared_response_id`` (or empty) and,
    for a GRPO group member, ``group_id`` and ``group_size`` (the number of
    rollouts in the group; every member passes the same value). The group
    travels beside the receipt (the receipt itself has no group field) on the
    receipt entry, into :attr:`sink.trainer.pulled.PulledRollout.group`.
    *client* is borrowed (plain or cluster). Calling it twice is safe: the
    assembler keeps the first receipt.

    It returns only once the event is durable: the ``XADD`` travels with
    ``WAITAOF`` (within *confirm_timeout_s*) and the persistence settings read
    back, as every acknowledged write (:mod:`sink.store.durability`);
    ``durability="none"`` skips that (benchmarks, throwaway runs).

    :returns: the stream entry id.
    :raises ValueError: invalid rollout id or group id, non-finite reward (or an int too large for a float), a response that is not
        JSON-serializable, ``group_size`` < 1, or only one of ``group_id``/``group_size``.
    :raises TypeError: *reward* is not a number, *group_id* not a str, or *response* holds a non-JSON type.
    :raises NotDurableError: the server does not keep the event through a crash (the event may be written;
        calling again is safe).
    :raises StagingConnectionError: the server could not be reached or refused the write.
    """
    validate_rollout_id(rollout_id)
    reward_value = _check_reward(reward)
    group = _check_group(group_id, group_size)
    if declared_response_id is not None and not isinstance(declared_response_id, str):
        raise TypeError("declared_response_id must be a str or None")
    fields = {
        "rollout_id": rollout_id,
        "reward": json.dumps(reward_value, allow_nan=False),
        "response": "" if response is None else canonical_json(response),
        "declared_response_id": declared_response_id or "",
    }
    if group is not None:
        fields.update(group_fields(group))
    stream = done_stream(namespace, shard_of(rollout_id, shards))
    action = f"announce that rollout {rollout_id!r} finished"

    def queue(pipe: Pipeline) -> None:
        pipe.xadd(stream, fields)  # type: ignore[arg-type]

    # The caller's client, borrowed; in a cluster the write goes to the stream's primary through a client of
    # that node, closed with the topology.
    settings = ConnectionSettings(cluster=isinstance(client, RedisCluster))
    topology = Topology.borrow(client, settings)
    try:
        async with topology.translated(action):
            entry_id = await write_durably(
                topology,
                BatchCall([stream], commands=queue),
                durability=durability,
                timeout_s=confirm_timeout_s,
                action=action,
            )
    finally:
        await topology.aclose()
    return reply_text(entry_id, "done entry id")


class DoneEvent(NamedTuple):
    """A parsed ``ns:done:<k>`` event."""

    rollout_id: str
    reward: float | None
    response: object
    declared_response_id: str | None
    group: GroupTag | None = None


def parse_done_event(fields: dict[str, str]) -> DoneEvent:
    """Parse the fields :func:`finished` wrote.

    :raises CodecError: a field is missing or malformed (such an event can never succeed).
    """
    try:
        rollout_id = validate_rollout_id(fields["rollout_id"])
        reward = _check_reward(json.loads(fields["reward"]))
        response_text = fields.get("response", "")
        response = json.loads(response_text) if response_text else None
        group = parse_group_fields(fields)
    except RecursionError as exc:
        raise CodecError("malformed done event: a JSON field is nested too deeply to parse") from exc
    except (KeyError, ValueError, TypeError) as exc:
        raise CodecError(f"malformed done event {fields!r}: {exc!r}") from exc
    return DoneEvent(rollout_id, reward, response, fields.get("declared_response_id") or None, group)
