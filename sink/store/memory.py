"""In-process staging store: the second implementation of the sink/source contract.

It exists for unit tests and for the contract test suite that runs the same
cases against Redis, so the two cannot drift. It is not durable; never use it
in production.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from sink.contract.packed_record import PackedCallRecord, StageableRecord, require_stageable
from sink.contract.records import StagedCallSnapshot, StageResult
from sink.store.sink import CONFLICT_ERROR

__all__ = ("MemoryStagingStore",)


class MemoryStagingStore:
    """A thread-safe dict of staging key -> record implementing ``stage``/``fetch``/``clear``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._records: dict[str, StagedCallSnapshot] = {}

    def stage(self, record: StageableRecord) -> StageResult:
        """Store *record* (either form) under its default staging key (idempotent by digest)."""
        record = require_stageable(record, "stage()")
        if isinstance(record, PackedCallRecord):
            record = record.to_record()
        key = record.staging_key
        snapshot = StagedCallSnapshot.model_validate(record.model_dump())
        with self._lock:
            existing = self._records.get(key)
            if existing is not None and existing.digest != record.digest:
                return StageResult(ok=False, staging_key=key, error=CONFLICT_ERROR)
            self._records.setdefault(key, snapshot)
        return StageResult(ok=True, staging_key=key)

    def fetch(self, staging_keys: Sequence[str]) -> list[StagedCallSnapshot]:
        """One snapshot per key in request order; ``KeyError`` naming every missing key."""
        with self._lock:
            missing = [key for key in staging_keys if key not in self._records]
            if missing:
                raise KeyError(f"no staged record for keys: {missing}")
            return [self._records[key].model_copy(deep=True) for key in staging_keys]

    def clear(self, staging_keys: Sequence[str]) -> int:
        """Delete the named records; return how many existed."""
        with self._lock:
            return sum(self._records.pop(key, None) is not None for key in staging_keys)

    def __len__(self) -> int:
        with self._lock:
            return len(self._records)
