"""The capture ledger's one front class: every operation's orchestration, over a backend's storage primitives.

:class:`CaptureLedger` validates arguments, derives and encodes rows
(:mod:`sink.ledger.rows`), detects conflicts, assembles manifests and resolves
parents (:mod:`sink.ledger.lineage`) once. A backend subclass supplies the
atomic per-rollout primitives: append with idempotency and fence checks, read
(or see the fence), the fence state, and batch retire/delete.
:class:`~sink.ledger.redis.RedisCaptureLedger` runs them as Lua scripts on
Redis/Valkey; :class:`~sink.ledger.memory.MemoryCaptureLedger` under one lock
in process memory. The two therefore cannot drift apart.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from enum import Enum
from typing import Any

from sink.canonical import canonical_json
from sink.contract.chains import ChainPolicy
from sink.contract.records import CaptureLedgerCommit, RolloutManifest, RolloutRemoval
from sink.errors import LedgerConflictError, RolloutRetiredError
from sink.keys import validate_rollout_id
from sink.ledger.lineage import RETIRED_REASON, LineageResolution, LineageStatus, is_root_request, resolve_from_rows
from sink.ledger.ownership import check_chain_ownership, check_row_ownership
from sink.ledger.rows import (
    POLICY_ID_FIELD,
    ChainLedgerView,
    chain_view_from_entries,
    check_failure_args,
    commit_rollout_id,
    custody_entry,
    custody_id_field,
    custody_row,
    decode_custody_rows,
    differing_fields,
    failure_entry,
    failure_id_field,
    manifest_from_entries,
    normalize_rollout_batch,
    policy_entry,
    warn_discarded_call,
    warn_discarded_failure,
)
from sink.store.resource import AsyncResource

__all__ = ("AppendOutcome", "CaptureLedger")


class AppendOutcome(Enum):
    """What one atomic append did."""

    APPENDED = "appended"
    DUPLICATE = "duplicate"
    """An identical row was stored already: nothing written."""
    FENCED = "fenced"
    """The rollout is retired: the row was discarded."""
    CONFLICT = "conflict"
    """A different row is stored under the same idempotency field: nothing written."""


class CaptureLedger(AsyncResource):
    """The capture ledger contract (contract §6) over a backend's primitives; use a backend subclass.

    Use it as an async context manager. Every method validates its arguments
    before touching storage and raises ``RuntimeError`` once the ledger is
    closed.
    """

    _appended = _duplicates = _discarded = 0

    # --- backend primitives (atomic per rollout) ---------------------------------

    def is_process_shared(self) -> bool:
        """Whether other processes see the same ledger."""
        raise NotImplementedError

    async def _append(
        self, rollout_id: str, id_field: str, id_value: str, entry: dict[str, str]
    ) -> tuple[AppendOutcome, str | None]:
        """Append *entry* unless fenced or *id_field* is taken; the stored value comes with ``CONFLICT``."""
        raise NotImplementedError

    async def _read_entries(self, rollout_id: str) -> list[dict[str, str]] | None:
        """All entries in append order, or ``None`` when the rollout is retired (one atomic read)."""
        raise NotImplementedError

    async def _fence_state(self, rollout_id: str) -> tuple[bool, bool]:
        """``(fenced, has_rows)`` in one atomic read; ``has_rows`` is ``False`` when fenced."""
        raise NotImplementedError

    async def _retire_ids(self, rollout_ids: list[str]) -> RolloutRemoval:
        """Fence each (validated, distinct) id and remove its ledger."""
        raise NotImplementedError

    async def _delete_ids(self, rollout_ids: list[str]) -> RolloutRemoval:
        """Remove each (validated, distinct) id's ledger and fence."""
        raise NotImplementedError

    # --- lifecycle ------------------------------------------------------------------

    async def _close_resources(self) -> None:
        """Nothing to close unless the backend owns a client."""

    async def close(self) -> None:
        """Alias of :meth:`aclose` (the contract's name)."""
        await self.aclose()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the capture ledger is closed")

    async def _append_counted(
        self, rollout_id: str, id_field: str, id_value: str, entry: dict[str, str]
    ) -> tuple[AppendOutcome, str | None]:
        self._check_open()
        outcome, stored = await self._append(rollout_id, id_field, id_value, entry)
        if outcome is AppendOutcome.APPENDED:
            self._appended += 1
        elif outcome is AppendOutcome.DUPLICATE:
            self._duplicates += 1
        elif outcome is AppendOutcome.FENCED:
            self._discarded += 1
        return outcome, stored

    # --- writes ---------------------------------------------------------------------

    async def record(self, commit: CaptureLedgerCommit) -> None:
        """Append *commit*'s custody row (contract §6.3); the row is visible to every reader on return.

        A replay of an identical commit is a no-op; for a retired rollout the
        row is discarded with a warning naming its staging key.

        :raises TypeError: *commit* is not a ``CaptureLedgerCommit``.
        :raises ValueError: invalid rollout id, or unfingerprintable items.
        :raises StagingKeyOwnershipError: the row names a staging key or capture key that is not this
            rollout's (a ``ValueError``; nothing changed).
        :raises LedgerConflictError: a different row exists for the same ``model_call_id`` (nothing changed).
        """
        rollout_id, id_field, text, entry = self._custody(commit)
        outcome, stored = await self._append_counted(rollout_id, id_field, text, entry)
        if outcome is AppendOutcome.FENCED:
            warn_discarded_call(rollout_id, commit)
        elif outcome is AppendOutcome.CONFLICT:
            assert stored is not None
            raise LedgerConflictError(rollout_id, commit.record.model_call_id, differing_fields(stored, text))

    def _custody(self, commit: CaptureLedgerCommit) -> tuple[str, str, str, dict[str, str]]:
        """*commit*'s rollout id, idempotency field, row text and stream entry, its ownership checked (see
        :meth:`record` for what it raises)."""
        rollout_id = commit_rollout_id(commit)
        check_row_ownership(rollout_id, commit.record)
        check_chain_ownership(rollout_id, commit.staging_chain)
        text = canonical_json(custody_row(commit))  # sorted keys, no whitespace
        return rollout_id, custody_id_field(commit.record.model_call_id), text, custody_entry(text)

    async def record_failure(
        self, rollout_id: str, model_call_id: str, reason: str, *, parent_call_id: str | None = None, root: bool = False
    ) -> None:
        """Append a failure row; an identical ``(call, reason)`` is a no-op, a retired rollout discards it.

        *parent_call_id* / *root*: the parent the failed call claimed, or that it was a ``text`` root (kept beside
        the row, never in the manifest), so a multi-chain rollout poisons only that chain (contract §14.2).

        :raises ValueError: invalid rollout id, or an empty call id or reason.
        """
        check_failure_args(rollout_id, model_call_id, reason)
        entry = failure_entry(model_call_id, reason, parent_call_id, root=root)
        outcome, _ = await self._append_counted(rollout_id, failure_id_field(model_call_id, reason), "1", entry)
        if outcome is AppendOutcome.FENCED:
            warn_discarded_failure(rollout_id, model_call_id, reason)

    async def record_chain_policy(self, rollout_id: str, policy: ChainPolicy) -> ChainPolicy | None:
        """Record the rollout's chain policy once (contract §14.1); the first recorded policy wins.

        :returns: the policy in force (``None`` when the rollout is retired).
        :raises ValueError: invalid rollout id, or *policy* is not a multi-chain policy.
        """
        validate_rollout_id(rollout_id)
        policy = ChainPolicy(policy)
        if policy is ChainPolicy.SINGLE:
            raise ValueError("only a multi-chain policy is recorded; single is the default")
        outcome, stored = await self._append_counted(rollout_id, POLICY_ID_FIELD, policy.value, policy_entry(policy))
        if outcome is AppendOutcome.FENCED:
            return None
        if outcome is AppendOutcome.CONFLICT and stored is not None:
            return ChainPolicy(stored)
        return policy

    # --- reads ----------------------------------------------------------------------

    async def manifest(self, rollout_id: str) -> RolloutManifest:
        """The rollout's manifest in append order (contract §6.7); empty for a never-touched rollout.

        :raises RolloutRetiredError: the rollout is retired.
        :raises CodecError: a stored row is corrupt.
        """
        validate_rollout_id(rollout_id)
        self._check_open()
        entries = await self._read_entries(rollout_id)
        if entries is None:
            raise RolloutRetiredError(rollout_id)
        return manifest_from_entries(rollout_id, entries)

    async def manifest_and_chains(self, rollout_id: str) -> tuple[RolloutManifest, ChainLedgerView]:
        """The manifest and its chain view (policy, failures' claimed parents) from one atomic read.

        :raises RolloutRetiredError: the rollout is retired.
        :raises CodecError: a stored row is corrupt.
        """
        validate_rollout_id(rollout_id)
        self._check_open()
        entries = await self._read_entries(rollout_id)
        if entries is None:
            raise RolloutRetiredError(rollout_id)
        return manifest_from_entries(rollout_id, entries), chain_view_from_entries(entries)

    async def chain_policy(self, rollout_id: str) -> ChainPolicy:
        """The rollout's recorded chain policy (contract §14.1), ``single`` when none was recorded.

        :raises RolloutRetiredError: the rollout is retired.
        :raises CodecError: a stored row is corrupt.
        """
        return (await self.manifest_and_chains(rollout_id))[1].policy

    async def has_rows(self, rollout_id: str) -> bool:
        """Whether committed or failure rows exist.

        :raises RolloutRetiredError: the rollout is retired.
        """
        validate_rollout_id(rollout_id)
        self._check_open()
        fenced, has_rows = await self._fence_state(rollout_id)
        if fenced:
            raise RolloutRetiredError(rollout_id)
        return has_rows

    async def resolve(self, rollout_id: str, request_items: Sequence[dict[str, Any]]) -> LineageResolution:
        """Resolve the parent call a request continues (contract §6.5).

        The retired check (step 1) reads the fence atomically with the rows;
        the rest is :func:`~sink.ledger.lineage.resolve_from_rows`.

        :raises ValueError: invalid rollout id, or unfingerprintable items.
        :raises CodecError: a stored row is corrupt.
        """
        validate_rollout_id(rollout_id)
        items = list(request_items)
        is_root = is_root_request(items)  # shape errors raise before storage is consulted
        self._check_open()
        if is_root:
            # A root needs no rows, only the fence.
            fenced, _ = await self._fence_state(rollout_id)
            entries: list[dict[str, str]] | None = None if fenced else []
        else:
            entries = await self._read_entries(rollout_id)
        if entries is None:
            return LineageResolution(LineageStatus.UNRESOLVED, reason=RETIRED_REASON)
        return resolve_from_rows(items, decode_custody_rows(entries))

    # --- retire / delete ------------------------------------------------------------

    async def retire(self, rollout_ids: Iterable[str]) -> RolloutRemoval:
        """Fence each rollout and remove its ledger (contract §6.9); atomic per id.

        ``removed``: had rows, now removed; ``absent``: no rows (never started or
        already retired). The whole batch is validated before any change;
        duplicates keep their first occurrence.

        :raises TypeError: *rollout_ids* is a bare ``str``/``bytes``.
        :raises ValueError: any id is invalid (nothing changed).
        """
        ids = normalize_rollout_batch(rollout_ids)
        self._check_open()
        return await self._retire_ids(ids)

    async def delete(self, rollout_ids: Iterable[str]) -> RolloutRemoval:
        """Remove each rollout's ledger and fence; the ids become reusable (contract §6.9). Atomic per id.

        The Redis backend removes every key under the rollout's hash tag: also its receipt, trainer claim,
        staged records and ``calls`` stream, so a reused id never meets the old run's receipt or records.
        ``removed``: had a live ledger; fence-only and unknown ids are ``absent``.

        :raises TypeError: *rollout_ids* is a bare ``str``/``bytes``.
        :raises ValueError: any id is invalid (nothing changed).
        """
        ids = normalize_rollout_batch(rollout_ids)
        self._check_open()
        return await self._delete_ids(ids)
