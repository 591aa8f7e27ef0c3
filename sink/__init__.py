"""staging-sink: durable token staging for RL training of LLM agents.

Inference workers stage each model call's exact token delta in Redis/Valkey
before the response returns; a ledger records committed calls; an assembler
builds receipts; the trainer pulls, verifies every digest and chain link, and
gets exact training rows. Records are wire-compatible with NeMo Gym's token
staging contract (schema 2); the records themselves live in :mod:`sink.contract.records`.
"""

from __future__ import annotations

from sink.contract.packed import PackedSnapshot
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
from sink.errors import (
    BatchInputError,
    ClusterModeMismatchError,
    CodecError,
    ExtraMissingError,
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
from sink.ledger.gate import CaptureGate
from sink.ledger.memory import MemoryCaptureLedger
from sink.ledger.redis import RedisCaptureLedger
from sink.rollout.assembler import Assembler, AssemblerStatistics
from sink.rollout.done_event import finished
from sink.server import DurableServer, durable_server
from sink.settings import (
    AssemblerSettings,
    ConnectionSettings,
    LedgerSettings,
    ProxySettings,
    PruneSettings,
    ReaderSettings,
    SinkSettings,
    SourceSettings,
)
from sink.store.sink import AsyncRedisStagingSink, RedisStagingSink, SinkStatistics
from sink.store.source import AsyncRedisStagingSource, RedisStagingSource
from sink.trainer.groups import GroupReader, RolloutGroup
from sink.trainer.pulled import PulledRollout
from sink.trainer.reader import ReaderStatistics, RolloutReader
from sink.trainer.reader_guards import AckOutcome
from sink.trainer.row import LinearizedRow
from sink.trainer.sync_reader import SyncRolloutReader
from sink.trainer.verify import verify_and_linearize

# Grouped by role, as httpcore does; the wire records themselves are all in sink.contract.records.
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
    "ExtraMissingError",
    "MetricsExtraMissingError",
    "StagingKeyOwnershipError",
    "InvalidCallIdError",
    "FingerprintInputError",
    "BatchInputError",
    "RowUnavailableError",
    "ClusterModeMismatchError",
    "UnrecoverableServiceError",
)
