"""Trainer-side verification and linearization (contract §8).

:func:`verify_and_linearize` proves a token-free :class:`RolloutReceipt`
against the staged snapshots fetched for it (every digest, every lineage link,
the terminal's chain and cumulative hash) and concatenates the terminal call's
ancestry, root first, into one :class:`LinearizedRow`. Checks run in exactly
the order of contract §8.1; the first failure raises a
:class:`ReceiptVerificationError` (steps 2-8 and 14) or :class:`RebuildError`
(steps 9-13) whose ``code`` names the check. Verification reads no extras but
the chain calls' ``sampling`` entries (step 14: the row's sampling provenance),
has no side effects, and is deterministic, so it is safe to retry.

Snapshots come as :class:`~sink.contract.records.StagedCallBaseSnapshot` models or as
:class:`~sink.contract.packed.PackedSnapshot` (the trainer's decode form,
whose digest was recomputed over its bytes when it was decoded and which is
immutable). A row built only from packed snapshots keeps their bytes and
builds Python tuples only when a column is read (see :mod:`sink.trainer.row`).
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Final

from sink.contract.packed import PackedSnapshot
from sink.contract.record_form import cached_packed_columns, packed_digest
from sink.contract.record_schema import IDENTITY_FIELDS, SUPPORTED_VERSIONS, unsupported_version
from sink.contract.records import CallRecord, RolloutReceipt, StagedCallBaseSnapshot
from sink.contract.skip_codes import SkipCode
from sink.errors import RebuildError, ReceiptVerificationError
from sink.trainer.rebuild import PackedCall, Snapshot, chain_positions, linearize_chain, verify_lineage
from sink.trainer.row import ExtrasCommitment, LinearizedRow, LinkSpan, NumpyColumns, WeightVersionSpan

__all__ = (
    "ExtrasCommitment",
    "LinearizedRow",
    "LinkSpan",
    "NumpyColumns",
    "WeightVersionSpan",
    "linearize",
    "verify_and_linearize",
    "verify_decoded_and_linearize",
)

# Step 2: the code for each unsupported receipt version.
_VERSION_CODES: Final = {
    "schema_version": "unsupported_schema",
    "digest_version": "unsupported_digest",
    "extras_digest_version": "unsupported_extras_digest",
}
_MISSING: Final = object()


def _check_argument_types(receipt: object, snapshots: object) -> None:
    # Step 1, plus the type of the snapshots argument (a programming error,
    # reported before anything about the receipt's state).
    if not isinstance(receipt, RolloutReceipt):
        raise TypeError(f"receipt must be a RolloutReceipt, got {type(receipt).__name__}")
    if not isinstance(snapshots, Sequence) or isinstance(snapshots, (str, bytes, bytearray)):
        raise TypeError(f"snapshots must be a sequence of StagedCallBaseSnapshot, got {type(snapshots).__name__}")


def _check_receipt_state(receipt: RolloutReceipt) -> None:
    # Steps 2-5.
    for name, expected in SUPPORTED_VERSIONS.items():
        if problem := unsupported_version(f"receipt {name}", getattr(receipt, name, _MISSING), expected):
            raise ReceiptVerificationError(_VERSION_CODES[name], problem)
    if receipt.failure_reason is not None:
        raise ReceiptVerificationError(
            SkipCode.ROLLOUT_FAILED, f"rollout {receipt.rollout_id!r} failed: {receipt.failure_reason}"
        )
    if receipt.capture_poisoned:
        raise ReceiptVerificationError(SkipCode.CAPTURE_POISONED, f"rollout {receipt.rollout_id!r} is capture-poisoned")
    if not receipt.manifest:
        raise ReceiptVerificationError("empty_manifest", f"rollout {receipt.rollout_id!r} has an empty manifest")


def _index_manifest(manifest: Sequence[CallRecord]) -> dict[str, int]:
    # Step 6: one pass; per row the id is checked before the key.
    index_by_id: dict[str, int] = {}
    seen_keys: set[str] = set()
    for position, record in enumerate(manifest):
        if not isinstance(record, CallRecord):
            raise TypeError(f"manifest row {position} is a {type(record).__name__}, not a CallRecord")
        if record.model_call_id in index_by_id:
            raise ReceiptVerificationError(
                "duplicate_manifest_row", f"model_call_id {record.model_call_id!r} appears twice"
            )
        if record.staging_key in seen_keys:
            raise ReceiptVerificationError("duplicate_staging_key", f"staging key {record.staging_key!r} appears twice")
        index_by_id[record.model_call_id] = position
        seen_keys.add(record.staging_key)
    return index_by_id


_IDENTITY_OF: Final = operator.attrgetter(*IDENTITY_FIELDS)


def _same_identity(snapshot: object, record: CallRecord) -> bool:
    """Step 8f in one pass: ``!=`` compares every identity field pair in order, exactly as the loop of
    :func:`_verify_snapshot` does (no identity shortcut); ``False`` sends it to that loop, which names the first
    mismatch (a snapshot lacking a field included)."""
    try:
        staged, recorded = _IDENTITY_OF(snapshot), _IDENTITY_OF(record)
    except AttributeError:
        return False
    return not any(map(operator.ne, staged, recorded))


def _where(position: int, record: CallRecord) -> str:
    """A manifest position as its failures name it (only spelled out for a failure)."""
    return f"position {position} ({record.model_call_id!r})"


def _verify_snapshot(
    position: int,
    snapshot: object,
    record: CallRecord,
    receipt: RolloutReceipt,
    index_by_id: dict[str, int],
    seen_ids: set[object],
    own_decode: bool,
) -> PackedCall | None:
    # Steps 8a-8h for one manifest position. With packed columns, returns them
    # with the ids' digest form, which the chain and row hashes reuse.
    if not isinstance(snapshot, StagedCallBaseSnapshot) and not (own_decode and isinstance(snapshot, PackedSnapshot)):
        raise TypeError(f"snapshot {position} is a {type(snapshot).__name__}, not a StagedCallBaseSnapshot")
    call_id = getattr(snapshot, "model_call_id", _MISSING)
    if call_id in seen_ids:
        raise ReceiptVerificationError(
            "duplicate_snapshot", f"{_where(position, record)}: snapshot {call_id!r} was already supplied"
        )
    seen_ids.add(call_id)
    if call_id not in index_by_id:
        raise ReceiptVerificationError(
            "snapshot_identity_mismatch", f"{_where(position, record)}: snapshot {call_id!r} is not in the manifest"
        )
    if call_id != record.model_call_id:
        raise ReceiptVerificationError(
            "snapshot_order_mismatch", f"{_where(position, record)}: got snapshot {call_id!r} out of manifest order"
        )
    owner = record.capture_key or receipt.rollout_id
    staged_owner = getattr(snapshot, "rollout_id", _MISSING)
    if staged_owner != owner:
        raise ReceiptVerificationError(
            "wrong_rollout", f"{_where(position, record)}: snapshot staged under {staged_owner!r}, expected {owner!r}"
        )
    if not _same_identity(snapshot, record):
        for name in IDENTITY_FIELDS:  # step 8f: first mismatch wins
            staged, recorded = getattr(snapshot, name, _MISSING), getattr(record, name)
            if staged != recorded:
                raise ReceiptVerificationError(
                    f"wrong_{name}", f"{_where(position, record)}: snapshot {name} {staged!r} != manifest {recorded!r}"
                )
    for name in SUPPORTED_VERSIONS:  # step 8g: equal on snapshot, manifest row and receipt
        values = (getattr(snapshot, name, _MISSING), getattr(record, name), getattr(receipt, name))
        if not values[0] == values[1] == values[2]:
            raise ReceiptVerificationError(
                f"wrong_{name}",
                f"{_where(position, record)}: {name} differs (snapshot, manifest, receipt) = {values!r}",
            )
    if isinstance(snapshot, PackedSnapshot):
        # Step 8h ran when the caller decoded it: its digest was recomputed over
        # exactly these (immutable) bytes and compared.
        return PackedCall(snapshot.columns, snapshot.ids_u64be)
    packed_call = None
    packed = cached_packed_columns(snapshot) if own_decode else None
    try:
        # With packed columns proved at decode time the digest is hashed from
        # them; the result is the same digest, only the packing is skipped.
        recomputed = None
        if packed is not None:
            forms = packed.digest_forms()
            packed_call = PackedCall(packed, b"".join(forms[0]))
            recomputed = packed_digest(snapshot, forms)
        recomputed = recomputed or snapshot.recompute_digest()
    except Exception as exc:  # any failure to recompute is reported, typed, with its cause chained
        raise ReceiptVerificationError(
            "invalid_snapshot", f"{_where(position, record)}: cannot recompute the call digest: {exc}"
        ) from exc
    if recomputed != snapshot.digest:
        raise ReceiptVerificationError(
            "corrupt_digest",
            f"{_where(position, record)}: recorded digest {snapshot.digest} != recomputed {recomputed}",
        )
    return packed_call


# --- public entry points ---------------------------------------------------------


def verify_and_linearize(receipt: RolloutReceipt, snapshots: Sequence[StagedCallBaseSnapshot]) -> LinearizedRow:
    """Verify *receipt* against *snapshots* (in manifest order) and linearize its terminal chain.

    Runs every check of contract §8.1 in order. Side branches are verified
    (steps 8 and 9) but not linearized. Of the extras only a chain call's
    ``sampling`` entry is read (step 14, checked against its extras digest);
    the row's ``extras_commitments`` let consumers verify the rest at point of use.

    :raises TypeError: *receipt* is not a ``RolloutReceipt``, *snapshots* is
        not a sequence, or an element is not a ``StagedCallBaseSnapshot``.
    :raises ReceiptVerificationError: steps 2-8 or 14 fail (``.code`` names the check).
    :raises RebuildError: steps 9-13 fail (lineage, terminal, chain, masks, hashes).
    """
    return _verify_and_linearize(receipt, snapshots, use_cached_columns=False)


def verify_decoded_and_linearize(receipt: RolloutReceipt, snapshots: Sequence[Snapshot]) -> LinearizedRow:
    """:func:`verify_and_linearize` for snapshots the caller decoded itself and never handed out.

    A :class:`PackedSnapshot` is accepted (its digest was checked when it was decoded) and proved packed columns
    are hashed as they are. Only for snapshots straight from :mod:`sink.contract.codec` (the trainer reader, its
    benchmark); callers holding arbitrary snapshots use :func:`verify_and_linearize`.
    """
    return _verify_and_linearize(receipt, snapshots, use_cached_columns=True)


def _verify_and_linearize(
    receipt: RolloutReceipt, snapshots: Sequence[Snapshot], *, use_cached_columns: bool
) -> LinearizedRow:
    """:func:`verify_and_linearize`; with *use_cached_columns*, for snapshots the caller decoded itself.

    Then a :class:`PackedSnapshot` is accepted (its digest was checked when it
    was decoded), and a model snapshot's packed columns, proved at decode
    time, are hashed instead of re-packing its lists. Only the trainer reader
    and its benchmark set it, for snapshots they decoded and never handed out:
    a record's cache cannot notice element assignment after validation, and a
    ``PackedSnapshot`` built by hand is not checked, so callers holding
    arbitrary snapshots use the public function.
    """
    _check_argument_types(receipt, snapshots)
    _check_receipt_state(receipt)
    manifest = receipt.manifest
    index_by_id = _index_manifest(manifest)
    if len(snapshots) != len(manifest):
        raise ReceiptVerificationError(
            "row_count_mismatch", f"{len(snapshots)} snapshots for {len(manifest)} manifest rows"
        )
    seen_ids: set[object] = set()
    packed_calls = [
        _verify_snapshot(position, snapshot, record, receipt, index_by_id, seen_ids, use_cached_columns)
        for position, (snapshot, record) in enumerate(zip(snapshots, manifest, strict=True))
    ]
    verify_lineage(manifest, index_by_id)
    chain = chain_positions(receipt, index_by_id)
    return linearize_chain(receipt, snapshots, chain, packed_calls)


def linearize(
    rollout_id: str,
    snapshots: Sequence[StagedCallBaseSnapshot],
    manifest: Sequence[CallRecord],
    *,
    terminal_hint: str | None = None,
) -> LinearizedRow:
    """Linearize a manifest with a declared terminal (contract §8.4).

    Builds an unpoisoned receipt with ``terminal_selection="declared"`` and
    calls :func:`verify_and_linearize`. The receipt is assembled without
    pydantic validation on purpose: verification re-checks everything the
    receipt validators would (empty manifest, duplicate ids, absent terminal)
    and reports each with its precise §8.1 code instead of a ``ValidationError``.

    :raises RebuildError: ``missing_terminal`` when *terminal_hint* is ``None``
        (or names no manifest row).
    :raises TypeError: an argument has the wrong type.
    :raises ValueError: *rollout_id* is empty.
    :raises ReceiptVerificationError: any other check of §8.1 fails.
    """
    if terminal_hint is None:
        raise RebuildError("missing_terminal", f"no terminal hint for rollout {rollout_id!r}")
    if type(rollout_id) is not str or type(terminal_hint) is not str:
        raise TypeError("rollout_id and terminal_hint must be str")
    if not rollout_id:
        raise ValueError("rollout_id must be non-empty")
    if not isinstance(manifest, Sequence) or isinstance(manifest, (str, bytes, bytearray)):
        raise TypeError(f"manifest must be a sequence of CallRecord, got {type(manifest).__name__}")
    receipt = RolloutReceipt.model_construct(
        rollout_id=rollout_id,
        manifest=list(manifest),
        terminal_model_call_id=terminal_hint,
        terminal_selection="declared",
    )
    return verify_and_linearize(receipt, snapshots)
