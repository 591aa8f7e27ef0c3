"""staging-sink: durable token staging for RL training of LLM agents.

Inference workers stage each model call's exact token delta in Redis/Valkey
before the response returns; a ledger records committed calls; an assembler
builds receipts; the trainer pulls, verifies every digest and chain link, and
gets exact training rows. Records are wire-compatible with NeMo Gym's token
staging contract (schema 2); the records themselves live in :mod:`sink.records`.
"""

from __future__ import annotations

from .assembler import Assembler as Assembler
from .assembler import finished as finished
from .errors import CodecError as CodecError
from .errors import ReceiptVerificationError as ReceiptVerificationError
from .errors import StagingConnectionError as StagingConnectionError
from .errors import StagingError as StagingError
from .ledger.gate import CaptureGate as CaptureGate
from .ledger.redis import RedisCaptureLedger as RedisCaptureLedger
from .reader import RolloutReader as RolloutReader
from .server import durable_server as durable_server
from .store.sink import AsyncRedisStagingSink as AsyncRedisStagingSink
from .store.sink import RedisStagingSink as RedisStagingSink
from .store.source import AsyncRedisStagingSource as AsyncRedisStagingSource
from .store.source import RedisStagingSource as RedisStagingSource
from .verify import LinearizedRow as LinearizedRow
from .verify import verify_and_linearize as verify_and_linearize

__all__ = (
    "Assembler",
    "AsyncRedisStagingSink",
    "AsyncRedisStagingSource",
    "CaptureGate",
    "CodecError",
    "LinearizedRow",
    "ReceiptVerificationError",
    "RedisCaptureLedger",
    "RedisStagingSink",
    "RedisStagingSource",
    "RolloutReader",
    "StagingConnectionError",
    "StagingError",
    "durable_server",
    "finished",
    "verify_and_linearize",
)
