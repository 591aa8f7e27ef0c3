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
:mod:`sink.errors`).
"""

from __future__ import annotations

from sink.contract.records import RolloutReceipt, StagedCallRecord
from sink.errors import StagingError
from sink.ledger.gate import CaptureGate
from sink.ledger.redis import RedisCaptureLedger
from sink.rollout.assembler import Assembler
from sink.rollout.done_event import finished
from sink.store.sink import AsyncRedisStagingSink
from sink.trainer.reader.rollout_reader import RolloutReader

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
