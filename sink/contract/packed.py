"""Staged calls whose token columns stay packed: the decode form of the trainer and the chain resolver.

A :class:`PackedSnapshot` holds the same verified content as a
:class:`~sink.contract.records.StagedCallSnapshot` (record rules 1-10 hold and the
call digest was recomputed over the stored column bytes and compared), but it
keeps the three token columns as the bytes they were stored as. No Python
object per token is created unless a caller asks for a column as a list, so
fetching and verifying a 64k-token chain costs little more than hashing it.

It is immutable (strings, ints and ``bytes``), so what was proved when it was
built stays true: the trainer reader verifies receipts against the packed
snapshots it fetched itself without hashing their digests a second time.
Build one only through :func:`sink.contract.codec.decode_packed_record` (or
:meth:`PackedSnapshot.of` from a validated snapshot); the constructor does no
checking, which is why the public :func:`sink.trainer.verify.verify_and_linearize`
takes model snapshots only (:meth:`PackedSnapshot.to_snapshot` converts).
"""

from __future__ import annotations

import operator
from typing import Any, Final, NamedTuple

from sink.contract._packed import (
    ID_TYPECODES,
    PackedColumns,
    TrustedColumns,
    f32_exact,
    ids_from_marshal,
    ids_u64be,
    pack_ids,
    prove_stored_columns,
    staging_delta_columns,
    unpack_list,
)
from sink.contract.digest import EMPTY_EXTRAS_DIGEST, compute_extras_digest, staging_digest_from_packed
from sink.contract.record_base import staging_key
from sink.contract.record_form import packed_columns, unchanged_since_validation
from sink.contract.record_schema import SCALAR_FIELDS
from sink.contract.staged_records import StagedCallSnapshot
from sink.errors import CodecError

# The packed-column API the worker and the Gym transport build on (sink.contract._packed stays private).
__all__ = (
    "ID_TYPECODES",
    "PackedColumns",
    "PackedSnapshot",
    "TrustedColumns",
    "ids_from_marshal",
    "ids_u64be",
    "pack_ids",
    "staging_delta_columns",
    "unpack_list",
    "verified_packed_snapshot",
)

#: Scalar names read from a stored blob, versions included.
SCALAR_NAMES: Final = SCALAR_FIELDS
# A blob's scalars, in PackedSnapshot field order.
_SCALARS_OF: Final = operator.itemgetter(*SCALAR_NAMES)


class PackedSnapshot(NamedTuple):
    """One verified staged call with its token columns packed (see the module docstring).

    A named tuple: immutable and cheap to build (one per staged call on the trainer's hot path).

    ``columns`` holds the stored forms (ids little-endian u32/u64, one mask
    code per token, log-probabilities float32 big-endian); ``ids_u64be`` the
    ids as the digests hash them. The ``token_*`` properties build a new
    list on every access.
    """

    schema_version: int
    digest_version: int
    extras_digest_version: int
    rollout_id: str
    model_call_id: str
    parent_call_id: str | None
    mode: str
    prev_len: int
    delta_len: int
    cum_len: int
    weight_version: int
    digest: str
    extras_digest: str
    chain_hash: str
    cumulative_hash: str
    extras: dict[str, Any] | None
    columns: PackedColumns
    ids_u64be: bytes
    #: The log-probabilities when float32 cannot hold them exactly (``columns.lp_f32_exact`` is then False).
    exact_log_probs: tuple[float, ...] | None = None

    @property
    def staging_key(self) -> str:
        """The default key ``rollout_id/model_call_id`` (not necessarily the sink's key)."""
        return staging_key(self.rollout_id, self.model_call_id)

    @property
    def token_ids_delta(self) -> list[int]:
        """The ids as a new list."""
        return self.columns.token_ids_list()

    @property
    def token_mask_delta(self) -> list[float]:
        """The mask as a new list."""
        return self.columns.token_mask_list()

    @property
    def generation_log_probs_delta(self) -> list[float]:
        """The log-probabilities as a new list."""
        if self.exact_log_probs is not None:
            return list(self.exact_log_probs)
        return self.columns.log_probs_list()

    def to_snapshot(self) -> StagedCallSnapshot:
        """The same call as a (fully re-validated) :class:`~sink.contract.records.StagedCallSnapshot`."""
        scalars = {name: getattr(self, name) for name in SCALAR_NAMES}
        return StagedCallSnapshot.model_validate(
            {
                **scalars,
                "token_ids_delta": self.token_ids_delta,
                "token_mask_delta": self.token_mask_delta,
                "generation_log_probs_delta": self.generation_log_probs_delta,
                "extras": self.extras,
            }
        )

    @classmethod
    def of(cls, snapshot: StagedCallSnapshot) -> PackedSnapshot:
        """The packed form of a snapshot, validated again unless it is provably unchanged since validation.

        :raises CodecError: it is not a valid record (built unvalidated, or mutated after validation).
        """
        if not unchanged_since_validation(snapshot):
            try:
                snapshot = StagedCallSnapshot.model_validate(snapshot.model_dump())
            except (ValueError, TypeError) as exc:  # pydantic's ValidationError is a ValueError
                raise CodecError(f"snapshot {snapshot.staging_key!r} does not verify: {exc}") from exc
        columns = packed_columns(snapshot)
        if columns is None:
            raise CodecError(f"snapshot {snapshot.staging_key!r}: its token columns do not satisfy the contract")
        log_probs = snapshot.generation_log_probs_delta
        if columns.lp_f32_exact is None:
            columns.lp_f32_exact = f32_exact(log_probs)
        return PackedSnapshot(
            **{name: getattr(snapshot, name) for name in SCALAR_NAMES},
            extras=snapshot.extras,
            columns=columns,
            ids_u64be=ids_u64be(columns.ids_le, columns.ids_width, columns.length),
            exact_log_probs=None if columns.lp_f32_exact else tuple(log_probs),
        )

    def __repr__(self) -> str:  # the columns are large: keep logs readable
        return f"PackedSnapshot({self.staging_key!r}, delta_len={self.delta_len}, digest={self.digest[:12]}...)"


# The named tuple spells the table's scalars out for type checkers; it must list them in table order.
assert PackedSnapshot._fields[: len(SCALAR_FIELDS)] == SCALAR_FIELDS, "PackedSnapshot drifted from RECORD_FIELDS"


def verified_packed_snapshot(
    fields: dict[str, Any], ids_le: bytes, ids_width: int, mask_codes: bytes, lp_le: bytes, lp_width: int
) -> PackedSnapshot | None:
    """Prove a decoded blob's record rules on its bytes and build the snapshot, or ``None``.

    *fields* are the blob's scalars and ``extras``; the column bytes have the
    sizes ``delta_len`` requires and every mask code is valid (the codec checked
    both). ``None`` means "not proved here": the record is invalid, or merely
    of a shape this path does not handle (float64 log-probabilities, masks
    that are not carry zeros then ones); the caller then decodes it the
    reference way, which raises the precise error or returns a valid snapshot.
    """
    columns = prove_stored_columns(ids_le, ids_width, mask_codes, lp_le, lp_width)
    if columns is None:
        return None
    extras = fields["extras"]
    if extras is not None and type(extras) is not dict:
        return None
    # The scalars as stored, checked where they are hashed: the digest's pre-checks and encoders accept exactly
    # the values the record's scalar fields do (the supported versions, non-empty exact strs, exact ints in the
    # u64 range, canonical lowercase hex digests, the lineage rule) and raise on anything else, and the digest
    # recomputed over them must equal the stored one, which is then a canonical digest too. The digest reads
    # them by name straight from *fields* (which hold the columns too, under names it does not read).
    mask_be = columns.mask_f32be or ()
    columns.mask_f32be = None  # a transient digest form (PackedColumns): not kept by the snapshot
    try:
        ids_be = ids_u64be(ids_le, ids_width, columns.length)
        digest = staging_digest_from_packed(fields, (ids_be,), mask_be, (columns.lp_f32be,))
        extras_digest = EMPTY_EXTRAS_DIGEST if extras is None else compute_extras_digest(extras)
        if digest != fields["digest"] or extras_digest != fields["extras_digest"]:
            return None
    except (ValueError, TypeError):  # the reference decode reports it precisely
        return None
    # Every field in order: the scalars, extras, columns, ids_u64be, and no exact_log_probs (float32 held them).
    return PackedSnapshot._make((*_SCALARS_OF(fields), extras, columns, ids_be, None))
