"""staging-sink: durable token staging for RL training of LLM agents.

Inference workers stage each model call's exact token delta in Redis/Valkey
before the response returns; a ledger records committed calls; an assembler
builds receipts; the trainer pulls, verifies every digest and chain link, and
gets exact training rows. Records are wire-compatible with NeMo Gym's token
staging contract (schema 2); the records themselves live in :mod:`sink.records`.
"""

from __future__ import annotations

from .assembler import Assembler, AssemblerStatistics
from .done_event import finished
from .errors import (
    BatchInputError,
    ClusterModeMismatchError,
    CodecError,
    FingerprintInputError,
    InvalidCallIdError,
    LedgerConflictError,
    MetricsExtraMissingError,
    RebuildError,
    ReceiptVerificationError,
    RolloutRetiredError,
    RowUnavailableError,
    ServerNotFoundError,
    ServerProcessError,
    StagingConnectionError,
    StagingError,
    StagingKeyOwnershipError,
    UnrecoverableServiceError,
)
from .groups import GroupReader, RolloutGroup
from .ledger.gate import CaptureGate
from .ledger.memory import MemoryCaptureLedger
from .ledger.redis import RedisCaptureLedger
from .packed import PackedSnapshot
from .pulled import PulledRollout
from .reader import ReaderStatistics, RolloutReader
from .reader_guards import AckOutcome
from .records import (
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
from .row import LinearizedRow
from .server import DurableServer, durable_server
from .settings import (
    AssemblerSettings,
    ConnectionSettings,
    LedgerSettings,
    ProxySettings,
    PruneSettings,
    ReaderSettings,
    SinkSettings,
    SourceSettings,
)
from .store.sink import AsyncRedisStagingSink, RedisStagingSink, SinkStatistics
from .store.source import AsyncRedisStagingSource, RedisStagingSource
from .sync_reader import SyncRolloutReader
from .verify import verify_and_linearize

# Grouped by role, as httpcore does; the wire records themselves are all in sink.records.
__all__ = (  # noqa: RUF022 (grouped by role, not sorted)
    # staging (inference side)
    "AsyncRedisStagingSink",
    "RedisStagingSink",
    "SinkStatistics",
    "StageResult",
    "StagedCallRecord",
    "staging_key",
    # reading staged calls back
    "AsyncRedisStagingSource",
    "RedisStagingSource",
    "StagedCallSnapshot",
    "PackedSnapshot",
    # the capture ledger and the gate
    "CaptureGate",
    "RedisCaptureLedger",
    "MemoryCaptureLedger",
    "CaptureAdmission",
    "CommitCoords",
    "RolloutManifest",
    "RolloutRemoval",
    # rollout end: finished events, receipts
    "finished",
    "Assembler",
    "AssemblerStatistics",
    "RolloutReceipt",
    # the trainer side
    "RolloutReader",
    "SyncRolloutReader",
    "ReaderStatistics",
    "PulledRollout",
    "AckOutcome",
    "GroupReader",
    "RolloutGroup",
    "verify_and_linearize",
    "LinearizedRow",
    # servers
    "durable_server",
    "DurableServer",
    # settings
    "ConnectionSettings",
    "SinkSettings",
    "SourceSettings",
    "LedgerSettings",
    "AssemblerSettings",
    "ReaderSettings",
    "PruneSettings",
    "ProxySettings",
    # exceptions
    "StagingError",
    "StagingConnectionError",
    "CodecError",
    "LedgerConflictError",
    "RolloutRetiredError",
    "ReceiptVerificationError",
    "RebuildError",
    "ServerNotFoundError",
    "ServerProcessError",
    "MetricsExtraMissingError",
    "StagingKeyOwnershipError",
    "InvalidCallIdError",
    "FingerprintInputError",
    "BatchInputError",
    "RowUnavailableError",
    "ClusterModeMismatchError",
    "UnrecoverableServiceError",
)
