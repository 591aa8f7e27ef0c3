"""Capture-ledger rows: derivation, canonical encoding and manifest assembly (contract §6.2, §6.7).

Storage-neutral and shared by both ledgers. A ledger entry is a flat map of
strings (exactly what a Redis stream entry holds):

* custody entry: ``{"kind": "call", "row": <canonical JSON>}``, where the row
  is ``{"record": <every CallRecord field>, "staging_chain": [...],
  "fingerprint", "context_len", "context_digest", "fingerprint_version"}``.
  The top-level ``fingerprint_version`` is the version of the resolution
  index; ``record.fingerprint_version`` is what the gate stamped on the call.
* failure entry: ``{"kind": "failure", "model_call_id", "reason"}``, plus ``parent_call_id`` when the failed
  call claimed a parent (a multi-chain rollout poisons only that parent's chain, contract §14.2).
* chain-policy entry: ``{"kind": "chains", "policy"}``, at most one per rollout (contract §14.1).

Canonical JSON (sorted keys, no whitespace, UTF-8) makes a replayed commit
byte-identical to the stored row, so idempotency is one comparison.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

from pydantic import ValidationError

from sink.contract.chains import ChainPolicy
from sink.contract.fingerprint import FINGERPRINT_VERSION, assistant_fingerprint, conversation_digest
from sink.contract.records import (
    LEDGER_ROW_MISSING_CHAIN_HASH_REASON,
    LEDGER_ROW_MISSING_RESPONSE_ID_REASON,
    CallRecord,
    CaptureLedgerCommit,
    ManifestFailure,
    RolloutManifest,
)
from sink.errors import CodecError
from sink.keys import validate_rollout_id

__all__ = (
    "CUSTODY_KIND",
    "FAILURE_KIND",
    "KIND_FIELD",
    "POLICY_ID_FIELD",
    "POLICY_KIND",
    "ROW_FIELD",
    "ChainLedgerView",
    "ClaimedFailure",
    "chain_view_from_entries",
    "check_failure_args",
    "commit_rollout_id",
    "custody_entry",
    "custody_id_field",
    "custody_row",
    "decode_custody_rows",
    "decode_row",
    "differing_fields",
    "failure_entry",
    "failure_id_field",
    "manifest_from_entries",
    "normalize_rollout_batch",
    "policy_entry",
    "warn_discarded_call",
    "warn_discarded_failure",
)

KIND_FIELD = "kind"
ROW_FIELD = "row"
CUSTODY_KIND = "call"
FAILURE_KIND = "failure"
POLICY_KIND = "chains"
POLICY_ID_FIELD = "p:chains"

_log = logging.getLogger("sink.ledger")


def commit_rollout_id(commit: CaptureLedgerCommit) -> str:
    """The validated rollout id of a commit passed to ``record()``.

    :raises TypeError: *commit* is not a :class:`CaptureLedgerCommit`.
    :raises ValueError: its rollout id is invalid.
    """
    if not isinstance(commit, CaptureLedgerCommit):
        raise TypeError(f"record() takes a CaptureLedgerCommit, got {type(commit).__name__}")
    return validate_rollout_id(commit.rollout_id)


def check_failure_args(rollout_id: str, model_call_id: str, reason: str) -> None:
    """Validate the arguments of ``record_failure()``.

    :raises ValueError: invalid rollout id, or an empty call id or reason.
    """
    validate_rollout_id(rollout_id)
    if not (isinstance(model_call_id, str) and model_call_id and isinstance(reason, str) and reason):
        raise ValueError("record_failure needs a non-empty model_call_id and reason")


def custody_row(commit: CaptureLedgerCommit) -> dict[str, Any]:
    """The custody row of *commit*: every ``CallRecord`` field plus the resolution index (§6.2).

    Raw items are not stored, only their fingerprint and context digest.

    :raises TypeError: *commit* is not a :class:`CaptureLedgerCommit`.
    :raises ValueError: an item cannot be fingerprinted.
    """
    if not isinstance(commit, CaptureLedgerCommit):
        raise TypeError(f"record() takes a CaptureLedgerCommit, got {type(commit).__name__}")
    request_items = list(commit.request_items)
    return {
        "record": commit.record.model_dump(mode="json"),
        "staging_chain": list(commit.staging_chain),
        "fingerprint": assistant_fingerprint(request_items + list(commit.response_items)),
        "context_len": len(request_items),
        "context_digest": conversation_digest(request_items),
        "fingerprint_version": FINGERPRINT_VERSION,
    }


def _refuse_constant(name: str) -> None:
    raise ValueError(f"{name} is not canonical JSON")


def decode_row(text: str | None) -> dict[str, Any]:
    """Parse a stored custody row.

    :raises CodecError: not JSON (rows are canonical JSON, never NaN), or not an object.
    """
    try:
        row = json.loads(text, parse_constant=_refuse_constant) if text is not None else None
    except ValueError as exc:
        raise CodecError(f"corrupt ledger row: {exc}") from exc
    if not isinstance(row, dict):
        raise CodecError(f"corrupt ledger row: expected a JSON object, got {type(row).__name__}")
    return row


def custody_id_field(model_call_id: str) -> str:
    """Idempotency-index field of a custody row."""
    return f"c:{model_call_id}"


def failure_id_field(model_call_id: str, reason: str) -> str:
    """Idempotency-index field of a failure row; unambiguous for any call id and reason."""
    return "f:" + json.dumps([model_call_id, reason], separators=(",", ":"), ensure_ascii=False)


def custody_entry(row_text: str) -> dict[str, str]:
    """The ledger entry holding one encoded custody row."""
    return {KIND_FIELD: CUSTODY_KIND, ROW_FIELD: row_text}


def failure_entry(
    model_call_id: str, reason: str, parent_call_id: str | None = None, *, root: bool = False
) -> dict[str, str]:
    """The ledger entry of one failure row, with the parent the failed call claimed or ``root`` for a failed
    ``text`` admission (neither: unknown, e.g. ``unresolved_parent``)."""
    entry = {KIND_FIELD: FAILURE_KIND, "model_call_id": model_call_id, "reason": reason}
    if parent_call_id:
        entry["parent_call_id"] = parent_call_id
    elif root:
        entry["root"] = "1"
    return entry


def policy_entry(policy: ChainPolicy) -> dict[str, str]:
    """The ledger entry recording a rollout's chain policy (contract §14.1)."""
    return {KIND_FIELD: POLICY_KIND, "policy": policy.value}


class ChainLedgerView(NamedTuple):
    """What multi-chain assembly reads from the ledger besides the manifest (contract §14.2)."""

    policy: ChainPolicy
    failures: tuple[ClaimedFailure, ...] = ()
    """Every failure row, in append order, with what the failed call claimed."""


class ClaimedFailure(NamedTuple):
    """One failure row and the lineage its call claimed: a parent, a new root, or nothing known."""

    model_call_id: str
    reason: str
    parent_call_id: str | None
    root: bool


def chain_view_from_entries(entries: Iterable[Mapping[str, str]]) -> ChainLedgerView:
    """The chain policy (``single`` when none was recorded) and the failures' claimed parents.

    :raises CodecError: a policy entry names no known policy.
    """
    policy = ChainPolicy.SINGLE
    failures: list[ClaimedFailure] = []
    for entry in entries:
        kind = entry.get(KIND_FIELD)
        if kind == POLICY_KIND:
            try:
                policy = ChainPolicy(entry.get("policy", ""))
            except ValueError as exc:
                raise CodecError(f"corrupt chain-policy row: {exc}") from exc
        elif kind == FAILURE_KIND:
            parent = entry.get("parent_call_id") or None
            call_id, reason = entry.get("model_call_id", ""), entry.get("reason", "")
            failures.append(ClaimedFailure(call_id, reason, parent, parent is None and entry.get("root") == "1"))
    return ChainLedgerView(policy, tuple(failures))


def _differing_fields(stored: Mapping[str, Any], new: Mapping[str, Any], prefix: str = "") -> list[str]:
    names: list[str] = []
    for key in sorted(set(stored) | set(new)):
        old_value, new_value = stored.get(key), new.get(key)
        if isinstance(old_value, Mapping) and isinstance(new_value, Mapping):
            names.extend(_differing_fields(old_value, new_value, f"{prefix}{key}."))
        elif old_value != new_value or key not in stored or key not in new:
            names.append(prefix + key)
    return names


def differing_fields(stored_text: str, new_text: str) -> tuple[str, ...] | None:
    """Dotted names of the fields in which two encoded rows differ; ``None`` when the stored row is unreadable.

    The fields of a :class:`~sink.errors.LedgerConflictError`.
    """
    try:
        return tuple(_differing_fields(decode_row(stored_text), decode_row(new_text)))
    except CodecError:
        return None


def decode_custody_rows(entries: Iterable[Mapping[str, str]]) -> list[dict[str, Any]]:
    """The decoded custody rows among *entries*, in order (other kinds skipped).

    :raises CodecError: a custody row is not a JSON object.
    """
    return [decode_row(entry.get(ROW_FIELD)) for entry in entries if entry.get(KIND_FIELD) == CUSTODY_KIND]


def _manifest_row(rollout_id: str, row: Mapping[str, Any]) -> CallRecord | ManifestFailure:
    record = row.get("record")
    if not isinstance(record, dict):
        raise CodecError("corrupt ledger row: no record object")
    call_id = record.get("model_call_id")
    if not record.get("response_id"):
        reason = LEDGER_ROW_MISSING_RESPONSE_ID_REASON
        return ManifestFailure.model_validate({"model_call_id": call_id, "reason": reason})
    if not record.get("chain_hash") or not record.get("cumulative_hash"):
        reason = LEDGER_ROW_MISSING_CHAIN_HASH_REASON
        return ManifestFailure.model_validate({"model_call_id": call_id, "reason": reason})
    fields = dict(record)
    fields["fingerprint_version"] = record.get("fingerprint_version") or 0
    for name in ("output_fingerprint", "continuation_fingerprint"):
        fields[name] = record.get(name) or None
    fields["capture_key"] = record.get("capture_key") or rollout_id
    return CallRecord.model_validate(fields)


def manifest_from_entries(rollout_id: str, entries: Iterable[Mapping[str, str]]) -> RolloutManifest:
    """Build the manifest from a rollout's entries in append order (contract §6.7).

    :raises CodecError: a row is unreadable or does not validate as a ``CallRecord``.
    """
    records: list[CallRecord] = []
    failures: list[ManifestFailure] = []
    for entry in entries:
        kind = entry.get(KIND_FIELD)
        try:
            if kind == FAILURE_KIND:
                failures.append(
                    ManifestFailure.model_validate(
                        {"model_call_id": entry.get("model_call_id"), "reason": entry.get("reason")}
                    )
                )
            elif kind == CUSTODY_KIND:
                row = _manifest_row(rollout_id, decode_row(entry.get(ROW_FIELD)))
                if isinstance(row, CallRecord):
                    records.append(row)
                else:
                    failures.append(row)
            # other kinds (e.g. generation-cut bookkeeping) are not manifest rows
        except ValidationError as exc:
            raise CodecError(f"corrupt {kind} row in the ledger of rollout {rollout_id!r}: {exc}") from exc
    return RolloutManifest(rollout_id=rollout_id, records=records, failures=failures)


def normalize_rollout_batch(rollout_ids: Iterable[str]) -> list[str]:
    """Validate a whole retire/delete batch and drop duplicates, keeping first occurrences (§6.8).

    :raises TypeError: *rollout_ids* is a bare ``str`` or ``bytes`` (it would read as one-character ids).
    :raises ValueError: any id is invalid; nothing may be changed then.
    """
    if isinstance(rollout_ids, str | bytes):
        raise TypeError("rollout_ids must be a collection of ids, not a bare string")
    ids = list(rollout_ids)
    for rollout_id in ids:
        validate_rollout_id(rollout_id)
    return list(dict.fromkeys(ids))


def warn_discarded_call(rollout_id: str, commit: CaptureLedgerCommit) -> None:
    """Log that a commit for a retired rollout was discarded, naming its staging key."""
    staging_key = commit.staging_chain[-1] if commit.staging_chain else commit.record.staging_key
    _log.warning(
        "discarded ledger row of call %r for retired rollout %r: staging key %r now has no manifest",
        commit.record.model_call_id,
        rollout_id,
        staging_key,
    )


def warn_discarded_failure(rollout_id: str, model_call_id: str, reason: str) -> None:
    """Log that a failure row for a retired rollout was discarded."""
    _log.warning("discarded ledger failure %r of call %r for retired rollout %r", reason, model_call_id, rollout_id)
