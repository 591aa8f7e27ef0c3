"""NeMo Gym's complete-record transport on the durable Redis/Valkey backend.

``RedisTokenSink`` (Gym's ``TokenSink``: ``put``, ``mark_incomplete``, ``begin_call``, ``close``) and
``RedisTokenSource`` (Gym's ``TokenSource``: ``freeze``, ``drop``, ``close``). Configure Gym with
``token_id_capture.sink: "sink.gym:RedisTokenSink"`` and ``sink_kwargs: {redis_url: ..., namespace: ...}``;
build the source in the consuming process with the same keywords. See ``docs/gym.md``.
"""

from __future__ import annotations

from sink.gym.entry import SCHEMA_VERSION, LocalTokenCaptureSnapshot, LocalTokenEntry, entry_types
from sink.gym.transport import RedisTokenSink, RedisTokenSource

__all__ = (
    "SCHEMA_VERSION",
    "LocalTokenCaptureSnapshot",
    "LocalTokenEntry",
    "RedisTokenSink",
    "RedisTokenSource",
    "entry_types",
)
