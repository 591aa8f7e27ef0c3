"""A model record's packed columns: the columns its validation proved, and the one place sink reads them.

Validating a :class:`~sink.contract.staged_records.StagedCallBaseSnapshot` packs its three
token columns in C, proves record rules 6-8 on the packed bytes and hashes the call digest over
them (:func:`prove_columns`, :func:`packed_digest`). The record keeps what was proved as a
:class:`ColumnCache` (``StagedCallBaseSnapshot.packed_form``); it is not part of the record's value.
The codec, the sink, :class:`~sink.contract.packed.PackedSnapshot`, the worker and the verifier
read it only through the functions here:

* :func:`cached_packed_columns`: the proved packed columns, while they still describe the lists;
* :func:`packed_columns`: those, or the lists packed (and proved) again;
* :func:`unchanged_since_validation`: whether the record is provably as it was validated;
* :func:`packed_digest`: the call digest over packed columns' digest forms.

The cache notices replaced or resized columns and reassigned scalars, never element assignment
inside a column after validation: records are values, do not mutate them. The worker's records
need no cache: they are built packed (:mod:`sink.contract.packed_record`).
"""

from __future__ import annotations

import operator
from typing import Final, Protocol

from sink.contract._packed import Buffers, PackedColumns, TrustedColumns, pack_ids, pack_validated_columns
from sink.contract.digest import staging_digest_from_packed
from sink.contract.record_schema import DIGEST_SCALAR_FIELDS

__all__ = (
    "ColumnCache",
    "cached_packed_columns",
    "packed_columns",
    "packed_digest",
    "prove_columns",
    "unchanged_since_validation",
)

# A record's scalar digest inputs and its digest, as one tuple (see ColumnCache).
_scalar_digest_inputs: Final = operator.attrgetter(*DIGEST_SCALAR_FIELDS, "digest")


class _Record(Protocol):
    """What this module reads of a :class:`~sink.contract.staged_records.StagedCallBaseSnapshot` (which imports it)."""

    delta_len: int
    token_ids_delta: list[int]
    token_mask_delta: list[float]
    generation_log_probs_delta: list[float]

    @property
    def packed_form(self) -> ColumnCache | None: ...


class ColumnCache:
    """Storage forms of a validated record's columns plus the list objects they describe.

    Kept by the record, not part of its value: it compares equal to any other
    cache and to ``None``, so pydantic's ``==`` (which compares private
    attributes) is unaffected.
    """

    __slots__ = ("digest_inputs", "log_probs", "packed", "token_ids", "token_mask")

    def __init__(
        self,
        packed: PackedColumns,
        token_ids: list[int],
        token_mask: list[float],
        log_probs: list[float],
        digest_inputs: tuple[object, ...],
    ) -> None:
        self.packed = packed
        self.token_ids = token_ids
        self.token_mask = token_mask
        self.log_probs = log_probs
        # The record's scalar digest inputs (and digest) when it was validated.
        self.digest_inputs = digest_inputs

    @classmethod
    def of(cls, record: _Record, packed: PackedColumns) -> ColumnCache:
        """The cache of *record*, just validated with *packed* proved for its current column lists."""
        return cls(
            packed,
            record.token_ids_delta,
            record.token_mask_delta,
            record.generation_log_probs_delta,
            _scalar_digest_inputs(record),
        )

    def __eq__(self, other: object) -> bool:
        return other is None or isinstance(other, ColumnCache)

    __hash__ = None  # type: ignore[assignment]

    def describes(self, token_ids: object, token_mask: object, log_probs: object) -> bool:
        """Whether the cache still describes these columns (same list objects, same lengths).

        Replacing or resizing a column is detected; assigning elements in place
        after validation is not (records are values: do not mutate them).
        """
        n = self.packed.length
        return (
            token_ids is self.token_ids
            and token_mask is self.token_mask
            and log_probs is self.log_probs
            and len(self.token_ids) == n
            and len(self.token_mask) == n
            and len(self.log_probs) == n
        )


def prove_columns(record: _Record, trusted: TrustedColumns | None) -> PackedColumns | None:
    """*record*'s columns packed with rules 6-8 proved, or ``None`` (then the reference path decides).

    *trusted* (from the validation context) vouches for some of the very lists the record holds; they are
    taken as proved instead of being packed again.
    """
    ids, mask, log_probs = record.token_ids_delta, record.token_mask_delta, record.generation_log_probs_delta
    n = len(ids)
    if n != record.delta_len or len(mask) != n or len(log_probs) != n:
        return None
    if trusted is None or mask is not trusted.token_mask or log_probs is not trusted.log_probs:
        return pack_validated_columns(ids, mask, log_probs)
    if ids is trusted.token_ids:
        return trusted.packed
    packed_ids = pack_ids(ids)
    return None if packed_ids is None else trusted.packed.with_ids(*packed_ids)


def packed_digest(record: _Record, digest_forms: tuple[Buffers, Buffers, Buffers]) -> str | None:
    """*record*'s call digest over ``PackedColumns.digest_forms()`` of proved columns, or ``None`` if a pre-check fails."""
    try:
        return staging_digest_from_packed(record.__dict__, *digest_forms)  # the field values, by name
    except (ValueError, TypeError, KeyError):
        return None


def cached_packed_columns(record: _Record) -> PackedColumns | None:
    """The packed columns *record*'s validation proved, if they still describe its column lists.

    Replaced or resized columns are detected; element assignment after validation is not, so only code that
    owns a record fresh from validation or decoding (the trainer reader, right after decoding) may rely on it.
    """
    cache = record.packed_form
    if cache is None or not cache.describes(
        record.token_ids_delta, record.token_mask_delta, record.generation_log_probs_delta
    ):
        return None
    return cache.packed


def packed_columns(record: _Record) -> PackedColumns | None:
    """*record*'s proved packed columns (:func:`cached_packed_columns`), else its lists packed and proved again.

    ``None``: its lists do not satisfy rules 6-8 (a validated record's lists were mutated), or not provably.
    """
    return cached_packed_columns(record) or pack_validated_columns(
        record.token_ids_delta, record.token_mask_delta, record.generation_log_probs_delta
    )


def unchanged_since_validation(record: _Record) -> bool:
    """Whether *record*'s columns (by identity and length) and every scalar digest input are as validated.

    O(1), with the limits of :func:`cached_packed_columns` (records are values: do not mutate them). ``False``
    for a record that was never validated (``model_construct``) or whose columns were not proved packed.
    """
    cache = record.packed_form
    return (
        cache is not None
        and cache.digest_inputs == _scalar_digest_inputs(record)
        and cache.describes(record.token_ids_delta, record.token_mask_delta, record.generation_log_probs_delta)
    )
