"""The capture ledger (contract section 6): lineage, committed and failure rows, the gate, one front class over Redis and in-memory backends."""

from __future__ import annotations

from sink.ledger.gate import CaptureGate
from sink.ledger.memory import MemoryCaptureLedger
from sink.ledger.redis import RedisCaptureLedger

__all__ = (
    "CaptureGate",
    "MemoryCaptureLedger",
    "RedisCaptureLedger",
)
