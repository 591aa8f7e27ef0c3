"""The wire contract: record models, the field table, digests, fingerprints, the codec and packed columns (pure code, no I/O)."""

from __future__ import annotations

from sink.contract.packed import PackedSnapshot
from sink.contract.packed_record import PackedCallRecord
from sink.contract.records import (
    CaptureAdmission,
    CommitCoords,
    RolloutManifest,
    RolloutReceipt,
    RolloutRemoval,
    StagedCallRecord,
    StagedCallSnapshot,
    StageResult,
    staging_key,
)

__all__ = (
    "CaptureAdmission",
    "CommitCoords",
    "PackedCallRecord",
    "PackedSnapshot",
    "RolloutManifest",
    "RolloutReceipt",
    "RolloutRemoval",
    "StageResult",
    "StagedCallRecord",
    "StagedCallSnapshot",
    "staging_key",
)
