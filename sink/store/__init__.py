"""The Redis side of staging: connections, durability checks, server scripts, the sink, the source, stream consumers."""

from __future__ import annotations

from sink.store.sink import AsyncRedisStagingSink, RedisStagingSink, SinkStatistics
from sink.store.source import AsyncRedisStagingSource, RedisStagingSource

__all__ = (
    "AsyncRedisStagingSink",
    "AsyncRedisStagingSource",
    "RedisStagingSink",
    "RedisStagingSource",
    "SinkStatistics",
)
