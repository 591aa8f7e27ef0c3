"""The trainer readers' counters (:meth:`~sink.trainer.reader.RolloutReader.statistics`,
:meth:`~sink.trainer.groups.GroupReader.statistics`)."""

from __future__ import annotations

from typing import NamedTuple

__all__ = ("GroupStatistics", "ReaderStatistics")


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


class GroupStatistics(NamedTuple):
    """Counters of one :class:`~sink.trainer.groups.GroupReader`: groups delivered (``partial``: sealed at the
    timeout), dropped by ``drop_group``, dead-lettered at the timeout, handed to another rank; ``waiting``: groups
    this rank holds members of, not complete; ``late``: members after their group went out
    (:data:`~sink.trainer.groups.LATE_MEMBER`); ``size_mismatches``: groups whose members disagreed on
    ``group_size``."""

    delivered: int
    partial: int
    dropped: int
    dead_lettered: int
    handed_over: int
    waiting: int
    late: int = 0
    size_mismatches: int = 0
