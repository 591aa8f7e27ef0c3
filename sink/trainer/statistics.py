"""A trainer reader's counters (:meth:`~sink.trainer.reader.RolloutReader.statistics`)."""

from __future__ import annotations

from typing import NamedTuple

__all__ = ("ReaderStatistics",)


class ReaderStatistics(NamedTuple):
    """Counters of one :class:`~sink.trainer.reader.RolloutReader` since it was opened; ``held``: pulled, not acked.

    ``skipped_by_code``: skipped rollouts per skip code (e.g. ``stale_weights``, ``rollout_failed``), sorted.
    """

    pulled: int
    trainable: int
    skipped: int
    duplicates_dropped: int
    acked: int
    reclaimed: int
    dead_lettered: int
    lost: int
    held: int
    skipped_by_code: tuple[tuple[str, int], ...] = ()
    double_deliveries: int = 0
    """Rollouts this reader claimed from an entry delivered before (another rank, or this one before a
    restart, may have trained them too)."""
