"""Clocks and keyspace snapshots for the ``prune`` tests: ages are counted to a time the test fixes."""

from __future__ import annotations

import time

import anyio
import redis.asyncio as aioredis

from sink.store.connection import reply_text
from tests.helpers.replies import raw_entries

__all__ = ("key_state", "newest_entry_ms", "next_millisecond", "now_for_cutoff")


async def next_millisecond() -> float:
    """A wall-clock time in a millisecond after every stream entry written so far (entry ids count server
    milliseconds, on this same clock): waits for the millisecond to turn over."""
    start_ms = int(time.time() * 1000)
    while int(time.time() * 1000) <= start_ms:  # noqa: ASYNC110 (the clock is the condition)
        await anyio.sleep(0.0005)
    return time.time()


def now_for_cutoff(cutoff_ms: int, abandon_after_s: float) -> float:
    """The ``now_s`` at which ``prune``'s age line (now minus *abandon_after_s*) falls exactly on *cutoff_ms*
    (half a millisecond in, so float rounding cannot move it to the millisecond before)."""
    return (cutoff_ms + 0.5) / 1000 + abandon_after_s


async def newest_entry_ms(client: aioredis.Redis, stream: str) -> int:
    """The server millisecond of *stream*'s newest entry (its id's first part)."""
    (entry_id, _fields), *_older = raw_entries(await client.xrevrange(stream, count=1))
    return int(entry_id.decode().split("-")[0])


async def key_state(client: aioredis.Redis, pattern: str) -> dict[str, tuple[str, int, int]]:
    """Every key matching *pattern*: its type, TTL (-1: none) and size (stream length, hash or set size,
    string length)."""
    state: dict[str, tuple[str, int, int]] = {}
    for raw in await client.keys(pattern):
        name = reply_text(raw)
        kind = reply_text(await client.type(name))
        size = {
            "stream": client.xlen,
            "hash": client.hlen,
            "set": client.scard,
            "string": client.strlen,
        }[kind](name)
        state[name] = (kind, int(await client.ttl(name)), int(await size))
    return state
