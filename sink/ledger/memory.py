"""In-process capture ledger: the second backend of the ledger contract.

Same API and semantics as :class:`sink.ledger.redis.RedisCaptureLedger`: both
are backends of the front class :class:`~sink.ledger.ledger.CaptureLedger`,
which holds the orchestration, so the contract suite can run against both and
the two cannot drift. Each primitive runs under one lock without awaiting, so
it is atomic for asyncio tasks and threads alike. Not durable and not shared
between processes; ledgers built on one :class:`MemoryLedgerStore` share it.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass, field

from sink.contract.records import RolloutRemoval
from sink.ledger.ledger import AppendOutcome, CaptureLedger

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


class MemoryCaptureLedger(CaptureLedger):
    """Async capture ledger kept in process memory (tests, demos, the contract suite).

    Pass a shared :class:`MemoryLedgerStore` to make several instances see
    one ledger, the way several gate processes see one Redis. Closing an
    instance leaves the store usable by the others.
    """

    def __init__(self, store: MemoryLedgerStore | None = None) -> None:
        self.store = store if store is not None else MemoryLedgerStore()

    def __repr__(self) -> str:
        with self.store.lock:
            live, fenced = len(self.store.ledgers), len(self.store.fences)
        return f"<MemoryCaptureLedger ledgers={live} fences={fenced}{' closed' if self._closed else ''}>"

    def is_process_shared(self) -> bool:
        """``False``: the ledger lives in this process only."""
        return False

    # --- storage primitives -------------------------------------------------------

    async def _append(
        self, rollout_id: str, id_field: str, id_value: str, entry: dict[str, str]
    ) -> tuple[AppendOutcome, str | None]:
        outcome = self.store.append(rollout_id, id_field, id_value, entry)
        if outcome in ("fenced", "duplicate", "appended"):
            return AppendOutcome(outcome), None
        return AppendOutcome.CONFLICT, outcome

    async def _read_entries(self, rollout_id: str) -> list[dict[str, str]] | None:
        return self.store.read(rollout_id)

    async def _fence_state(self, rollout_id: str) -> tuple[bool, bool]:
        entries = self.store.read(rollout_id)
        return (True, False) if entries is None else (False, bool(entries))

    async def _retire_ids(self, rollout_ids: list[str]) -> RolloutRemoval:
        removal = RolloutRemoval()
        with self.store.lock:
            for rollout_id in rollout_ids:
                had_rows = bool(self._pop_entries(rollout_id))
                fresh_fence = rollout_id not in self.store.fences
                self.store.fences.add(rollout_id)
                (removal.removed if had_rows and fresh_fence else removal.absent).append(rollout_id)
        return removal

    async def _delete_ids(self, rollout_ids: list[str]) -> RolloutRemoval:
        removal = RolloutRemoval()
        with self.store.lock:
            for rollout_id in rollout_ids:
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
