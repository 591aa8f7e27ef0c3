"""The ``done`` event that ends a rollout (contract §7.1 step 1): :func:`finished` writes it, the assembler parses it.

The framework calls :func:`finished` once a rollout is scored; it appends one
token-free event to ``ns:done:<shard>``, which an
:class:`~sink.assembler.Assembler` turns into the rollout's receipt.
"""

from __future__ import annotations

import json
import math
from typing import NamedTuple

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster

from .canonical import canonical_json
from .errors import CodecError
from .keys import DEFAULT_NAMESPACE, done_stream, shard_of, validate_rollout_id
from .settings import DEFAULT_SHARDS
from .store.connection import map_redis_errors

__all__ = ("DoneEvent", "finished", "parse_done_event")


def _check_reward(reward: object) -> float | None:
    if reward is None:
        return None
    if isinstance(reward, bool) or not isinstance(reward, int | float):
        raise TypeError(f"reward must be a float or None, got {type(reward).__name__}")
    if not math.isfinite(reward):
        raise ValueError(f"reward must be finite, got {reward!r}")
    return float(reward)


async def finished(
    client: aioredis.Redis | RedisCluster,
    rollout_id: str,
    *,
    reward: float | None,
    response: object = None,
    declared_response_id: str | None = None,
    namespace: str = DEFAULT_NAMESPACE,
    shards: int = DEFAULT_SHARDS,
) -> str:
    """Announce that *rollout_id* finished: one token-free event on ``ns:done:<shard_of(rollout_id, shards)>``.

    Event fields: ``rollout_id``, ``reward`` (JSON), ``response`` (canonical
    JSON, or empty for ``None``) and ``declared_response_id`` (or empty).
    *client* is borrowed (plain or cluster). Calling it twice is safe: the
    assembler keeps the first receipt.

    :returns: the stream entry id.
    :raises ValueError: invalid rollout id, non-finite reward, or a response that is not JSON-serializable.
    :raises TypeError: *reward* is not a number, or *response* holds a non-JSON type.
    :raises StagingConnectionError: the server could not be reached.
    """
    validate_rollout_id(rollout_id)
    reward_value = _check_reward(reward)
    if declared_response_id is not None and not isinstance(declared_response_id, str):
        raise TypeError("declared_response_id must be a str or None")
    fields = {
        "rollout_id": rollout_id,
        "reward": json.dumps(reward_value, allow_nan=False),
        "response": "" if response is None else canonical_json(response),
        "declared_response_id": declared_response_id or "",
    }
    stream = done_stream(namespace, shard_of(rollout_id, shards))
    with map_redis_errors(f"announce that rollout {rollout_id!r} finished"):
        entry_id = await client.xadd(stream, fields)  # type: ignore[arg-type]
    return entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)


class DoneEvent(NamedTuple):
    """A parsed ``ns:done:<k>`` event."""

    rollout_id: str
    reward: float | None
    response: object
    declared_response_id: str | None


def parse_done_event(fields: dict[str, str]) -> DoneEvent:
    """Parse the fields :func:`finished` wrote.

    :raises CodecError: a field is missing or malformed (such an event can never succeed).
    """
    try:
        rollout_id = validate_rollout_id(fields["rollout_id"])
        reward = _check_reward(json.loads(fields["reward"]))
        response_text = fields.get("response", "")
        response = json.loads(response_text) if response_text else None
    except RecursionError as exc:
        raise CodecError("malformed done event: a JSON field is nested too deeply to parse") from exc
    except (KeyError, ValueError, TypeError) as exc:
        raise CodecError(f"malformed done event {fields!r}: {exc!r}") from exc
    return DoneEvent(rollout_id, reward, response, fields.get("declared_response_id") or None)
