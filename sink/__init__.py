"""staging-sink: durable token staging for RL training of LLM agents.

Inference workers stage each model call's exact token delta in Redis/Valkey
before the response returns; a ledger records committed calls; an assembler
builds receipts; the trainer pulls, verifies every digest and chain link, and
gets exact training rows. Records are wire-compatible with NeMo Gym's token
staging contract (schema 2); the records themselves live in :mod:`sink.contract.records`.

The top level holds the entry points of the README's example: the sink, the gate and its ledger, the
``finished`` event and the assembler, the trainer's reader, the records they pass and the exception root.
Everything else is exported by its sub-package (:mod:`sink.contract`, :mod:`sink.store`, :mod:`sink.ledger`,
:mod:`sink.rollout`, :mod:`sink.trainer`, :mod:`sink.server`) or module (:mod:`sink.settings`,
:mod:`sink.errors`); the names the top level exported before still resolve, with a ``DeprecationWarning``.
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any

from sink.contract.records import RolloutReceipt, StagedCallRecord
from sink.errors import StagingError
from sink.ledger.gate import CaptureGate
from sink.ledger.redis import RedisCaptureLedger
from sink.rollout.assembler import Assembler
from sink.rollout.done_event import finished
from sink.store.sink import AsyncRedisStagingSink
from sink.trainer.reader import RolloutReader

# In the order the data flows, as in the README's example.
__all__ = (  # noqa: RUF022 (data-flow order, not sorted)
    "AsyncRedisStagingSink",
    "StagedCallRecord",
    "CaptureGate",
    "RedisCaptureLedger",
    "finished",
    "Assembler",
    "RolloutReceipt",
    "RolloutReader",
    "StagingError",
)

_MOVED = {
    # sink.store
    "AsyncRedisStagingSource": "sink.store",
    "RedisStagingSink": "sink.store",
    "RedisStagingSource": "sink.store",
    "SinkStatistics": "sink.store",
    # sink.contract
    "CaptureAdmission": "sink.contract",
    "CommitCoords": "sink.contract",
    "PackedSnapshot": "sink.contract",
    "RolloutManifest": "sink.contract",
    "RolloutRemoval": "sink.contract",
    "StageResult": "sink.contract",
    "StagedCallSnapshot": "sink.contract",
    "staging_key": "sink.contract",
    # sink.ledger
    "MemoryCaptureLedger": "sink.ledger",
    # sink.rollout
    "AssemblerStatistics": "sink.rollout",
    # sink.trainer
    "AckOutcome": "sink.trainer",
    "GroupReader": "sink.trainer",
    "LinearizedRow": "sink.trainer",
    "PulledRollout": "sink.trainer",
    "ReaderStatistics": "sink.trainer",
    "RolloutGroup": "sink.trainer",
    "SyncRolloutReader": "sink.trainer",
    "verify_and_linearize": "sink.trainer",
    # sink.server
    "DurableServer": "sink.server",
    "durable_server": "sink.server",
    # sink.settings
    "AssemblerSettings": "sink.settings",
    "ConnectionSettings": "sink.settings",
    "LedgerSettings": "sink.settings",
    "ProxySettings": "sink.settings",
    "PruneSettings": "sink.settings",
    "ReaderSettings": "sink.settings",
    "SinkSettings": "sink.settings",
    "SourceSettings": "sink.settings",
    # sink.errors
    "BatchInputError": "sink.errors",
    "ClusterModeMismatchError": "sink.errors",
    "CodecError": "sink.errors",
    "FingerprintInputError": "sink.errors",
    "InvalidCallIdError": "sink.errors",
    "LedgerConflictError": "sink.errors",
    "MetricsExtraMissingError": "sink.errors",
    "RebuildError": "sink.errors",
    "ReceiptVerificationError": "sink.errors",
    "RolloutRetiredError": "sink.errors",
    "RowUnavailableError": "sink.errors",
    "ServerNotFoundError": "sink.errors",
    "ServerProcessError": "sink.errors",
    "StagingConnectionError": "sink.errors",
    "StagingKeyOwnershipError": "sink.errors",
    "UnrecoverableServiceError": "sink.errors",
}
"""Names the top level exported before, and where they live now."""


def __getattr__(name: str) -> Any:
    home = _MOVED.get(name)
    if home is None:
        raise AttributeError(f"module 'sink' has no attribute {name!r}")
    warnings.warn(f"sink.{name} moved: import it from {home}", DeprecationWarning, stacklevel=2)
    return getattr(importlib.import_module(home), name)
