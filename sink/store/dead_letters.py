"""What a consumer group copies to ``ns:dead:<role>-<shard>`` when it gives an entry up (so none stops it).

:class:`~sink.store.streams.GroupConsumer` dead-letters an entry delivered more than ``max_deliveries``
times, one its owner cannot parse, and one that is not UTF-8 text at all (:class:`UndecodableEntry`:
its raw bytes are copied unchanged). The record is the entry's own fields plus ``dead_*`` fields naming
where it came from and why; the reason is cut to :data:`MAX_REASON_CHARS`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ("MAX_REASON_CHARS", "UndecodableEntry", "dead_letter_record")

MAX_REASON_CHARS = 2_000
"""A dead letter's ``dead_reason`` is cut to this many characters (the entry itself is copied whole)."""


@dataclass(frozen=True, slots=True)
class UndecodableEntry:
    """An entry whose field names or values are not UTF-8 text (kept as raw bytes for the dead letter)."""

    shard: int
    entry_id: str
    fields: dict[Any, Any]
    deliveries: int
    reason: str


def dead_letter_record(
    fields: Mapping[Any, Any], *, stream: str, entry_id: str, deliveries: int, reason: str, consumer: str
) -> dict[Any, Any]:
    """The dead-letter stream entry for one given-up entry (its fields, then the ``dead_*`` fields)."""
    if len(reason) > MAX_REASON_CHARS:
        reason = reason[:MAX_REASON_CHARS] + f"... ({len(reason)} characters)"
    return {
        **fields,
        "dead_source": stream,
        "dead_entry_id": entry_id,
        "dead_deliveries": str(deliveries),
        "dead_reason": reason,
        "dead_consumer": consumer,
    }
