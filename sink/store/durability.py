"""Verify that a server acknowledges writes only after they are on disk (architecture §4).

With ``appendonly yes``, ``appendfsync always`` and ``no-appendfsync-on-rewrite
no``, Redis 7+ and Valkey 8 reply to a write only after ``fdatasync`` of the
AOF; ``maxmemory-policy noeviction`` makes sure nothing acknowledged is evicted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import redis.asyncio as aioredis
import redis.exceptions as redis_errors

from .connection import describe_redis_error, reply_text

__all__ = ("REQUIRED_CONFIG", "DurabilityReport", "verify_durability")

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
    return None, _supports_waitaof(server_info)


def _supports_waitaof(server_info: dict[str, object]) -> bool:
    # WAITAOF exists in Valkey and in Redis >= 7.2.
    if "valkey_version" in server_info:
        return True
    # redis-py parses INFO into text and numbers, never bytes.
    parts = str(server_info.get("redis_version", "0")).split(".")
    try:
        major, minor = int(parts[0]), int(parts[1]) if len(parts) > 1 else 0
    except ValueError:
        return False
    return (major, minor) >= (7, 2)


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
