"""The trainer side: pulling, verifying and linearizing rollouts, then batches, packing, groups, staleness and export."""

from __future__ import annotations

from sink.trainer.groups import GroupReader, RolloutGroup
from sink.trainer.pulled import PulledRollout
from sink.trainer.reader.guards import AckOutcome
from sink.trainer.reader.rollout_reader import ReaderStatistics, RolloutReader
from sink.trainer.reader.sync_reader import SyncRolloutReader
from sink.trainer.row import LinearizedRow
from sink.trainer.verify import verify_and_linearize

__all__ = (
    "AckOutcome",
    "GroupReader",
    "LinearizedRow",
    "PulledRollout",
    "ReaderStatistics",
    "RolloutGroup",
    "RolloutReader",
    "SyncRolloutReader",
    "verify_and_linearize",
)
