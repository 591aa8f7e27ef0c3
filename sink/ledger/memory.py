"""In-process capture ledger: the second implementation of the ledger contract.

Same API and semantics as :class:`sink.ledger.RedisCaptureLedger`, sharing
its row encoding, manifest assembly and resolution (:mod:`sink.ledger.rows`,
:mod:`sink.ledger.lineage`), so the contract suite can run against both and the two
cannot drift. Each operation runs under one lock without awaiting, so it is
atomic for asyncio tasks and threads alike. Not durable and not shared
between processes; ledgers built on one :class:`MemoryLedgerStore` share it.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Self

from ..errors import LedgerConflictError, RolloutRetiredError
from ..fingerprint import assistant_fingerprint
from ..keys import validate_rollout_id
from ..records import CaptureLedgerCommit, RolloutManifest, RolloutRemoval
from .lineage import RETIRED_REASON, LineageResolution, LineageStatus, resolve_from_rows
from .rows import (
    check_failure_args,
    commit_rollout_id,
    conflict_message,
    custody_entry,
    custody_id_field,
    custody_row,
    decode_custody_rows,
    encode_row,
    failure_entry,
    failure_id_field,
    manifest_from_entries,
    normalize_rollout_batch,
    warn_discarded_call,
    warn_discarded_failure,
)

__all__ = ("MemoryCaptureLedger", "MemoryLedgerStore")


@dataclass
class _RolloutLedger:
    entries: list[dict[str, str]] = field(default_factory=list)
    ids: dict[str, str] = field(default_factory=dict)


class MemoryLedgerStore:
    """The state behind one or more :class:`MemoryCaptureLedger` instances (ledgers, fences, one lock)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.ledgers: dict[str, _RolloutLedger] = {}
        self.fences: set[str] = set()

    def append(self, rollout_id: str, id_field: str, id_value: str, entry: dict[str, str]) -> str:
        """Append atomically: ``"fenced"``, ``"duplicate"``, ``"appended"``, or the conflicting stored value."""
        with self.lock:
            if rollout_id in self.fences:
                return "fenced"
            ledger = self.ledgers.setdefault(rollout_id, _RolloutLedger())
            stored = ledger.ids.get(id_field)
            if stored is not None:
                return "duplicate" if stored == id_value else stored
            ledger.entries.append(dict(entry))
            ledger.ids[id_field] = id_value
            return "appended"

    def read(self, rollout_id: str) -> list[dict[str, str]] | None:
        """A copy of the entries in append order, or ``None`` when fenced."""
        with self.lock:
            if rollout_id in self.fences:
                return None
            ledger = self.ledgers.get(rollout_id)
            return [dict(entry) for entry in ledger.entries] if ledger is not None else []


class MemoryCaptureLedger:
    """Async capture ledger kept in process memory (tests, demos, the contract suite).

    Pass a shared :class:`MemoryLedgerStore` to make several instances see
    one ledger, the way several gate processes see one Redis.
    """

    def __init__(self, store: MemoryLedgerStore | None = None) -> None:
        self.store = store if store is not None else MemoryLedgerStore()
        self._closed = False

    def __repr__(self) -> str:
        with self.store.lock:
            live, fenced = len(self.store.ledgers), len(self.store.fences)
        return f"<MemoryCaptureLedger ledgers={live} fences={fenced}{' closed' if self._closed else ''}>"

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Mark the ledger closed; idempotent. The store stays usable by other instances."""
        self._closed = True

    async def close(self) -> None:
        """Alias of :meth:`aclose` (the contract's name)."""
        await self.aclose()

    def is_process_shared(self) -> bool:
        """``False``: the ledger lives in this process only."""
        return False

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the capture ledger is closed")

    async def record(self, commit: CaptureLedgerCommit) -> None:
        """Append *commit*'s custody row (contract §6.3); see :meth:`RedisCaptureLedger.record`.

        :raises TypeError: *commit* is not a ``CaptureLedgerCommit``.
        :raises ValueError: invalid rollout id, or unfingerprintable items.
        :raises LedgerConflictError: a different row exists for the same ``model_call_id``.
        """
        rollout_id = commit_rollout_id(commit)
        self._check_open()
        text = encode_row(custody_row(commit))
        call_id = commit.record.model_call_id
        outcome = self.store.append(rollout_id, custody_id_field(call_id), text, custody_entry(text))
        if outcome == "fenced":
            warn_discarded_call(rollout_id, commit)
        elif outcome not in ("appended", "duplicate"):
            raise LedgerConflictError(conflict_message(rollout_id, call_id, outcome, text))

    async def record_failure(self, rollout_id: str, model_call_id: str, reason: str) -> None:
        """Append a failure row; an identical ``(call, reason)`` is a no-op, a retired rollout discards it.

        :raises ValueError: invalid rollout id, or an empty call id or reason.
        """
        check_failure_args(rollout_id, model_call_id, reason)
        self._check_open()
        entry = failure_entry(model_call_id, reason)
        if self.store.append(rollout_id, failure_id_field(model_call_id, reason), "1", entry) == "fenced":
            warn_discarded_failure(rollout_id, model_call_id, reason)

    async def manifest(self, rollout_id: str) -> RolloutManifest:
        """The rollout's manifest in append order (contract §6.7).

        :raises RolloutRetiredError: the rollout is retired.
        :raises CodecError: a stored row is corrupt.
        """
        validate_rollout_id(rollout_id)
        self._check_open()
        entries = self.store.read(rollout_id)
        if entries is None:
            raise RolloutRetiredError(rollout_id)
        return manifest_from_entries(rollout_id, entries)

    async def has_rows(self, rollout_id: str) -> bool:
        """Whether committed or failure rows exist.

        :raises RolloutRetiredError: the rollout is retired.
        """
        validate_rollout_id(rollout_id)
        self._check_open()
        entries = self.store.read(rollout_id)
        if entries is None:
            raise RolloutRetiredError(rollout_id)
        return bool(entries)

    async def resolve(self, rollout_id: str, request_items: Sequence[dict[str, Any]]) -> LineageResolution:
        """Resolve the parent call a request continues (contract §6.5).

        :raises ValueError: invalid rollout id, or unfingerprintable items.
        """
        validate_rollout_id(rollout_id)
        self._check_open()
        items = list(request_items)
        assistant_fingerprint(items)  # shape errors raise before the fence is consulted, as in Redis
        entries = self.store.read(rollout_id)
        if entries is None:
            return LineageResolution(LineageStatus.UNRESOLVED, reason=RETIRED_REASON)
        return resolve_from_rows(items, decode_custody_rows(entries))

    async def retire(self, rollout_ids: Iterable[str]) -> RolloutRemoval:
        """Fence each rollout and remove its ledger (contract §6.9).

        :raises TypeError: *rollout_ids* is a bare ``str``/``bytes``.
        :raises ValueError: any id is invalid (nothing changed).
        """
        ids = normalize_rollout_batch(rollout_ids)
        self._check_open()
        removal = RolloutRemoval()
        with self.store.lock:
            for rollout_id in ids:
                had_rows = bool(self._pop_entries(rollout_id))
                fresh_fence = rollout_id not in self.store.fences
                self.store.fences.add(rollout_id)
                (removal.removed if had_rows and fresh_fence else removal.absent).append(rollout_id)
        return removal

    async def delete(self, rollout_ids: Iterable[str]) -> RolloutRemoval:
        """Remove each rollout's ledger and fence; the ids become reusable (contract §6.9).

        :raises TypeError: *rollout_ids* is a bare ``str``/``bytes``.
        :raises ValueError: any id is invalid (nothing changed).
        """
        ids = normalize_rollout_batch(rollout_ids)
        self._check_open()
        removal = RolloutRemoval()
        with self.store.lock:
            for rollout_id in ids:
                had_rows = bool(self._pop_entries(rollout_id))
                self.store.fences.discard(rollout_id)
                (removal.removed if had_rows else removal.absent).append(rollout_id)
        return removal

    def _pop_entries(self, rollout_id: str) -> list[dict[str, str]]:
        ledger = self.store.ledgers.pop(rollout_id, None)
        return ledger.entries if ledger is not None else []

    def _inject_entry(self, rollout_id: str, entry: Mapping[str, str]) -> None:
        """Test hook: append a raw entry (e.g. a malformed custody row) without any check."""
        with self.store.lock:
            self.store.ledgers.setdefault(rollout_id, _RolloutLedger()).entries.append(dict(entry))
