"""The packed write form of a staged call: what the worker builds and the sinks and the codec take.

A :class:`PackedCallRecord` holds what a validated :class:`~sink.contract.records.StagedCallRecord`
holds (every scalar validated exactly as the model validates it, the record rules proved, the call
digest computed once), without the pydantic model: its token columns come from
:class:`~sink.contract._packed.TrustedColumns` this package built and proved itself, and keep the
packed bytes the codec writes. The seed's model is built at the public boundary only
(:meth:`PackedCallRecord.to_record`); ``stage()`` of every sink and
:func:`~sink.contract.codec.encode_record` take either form (:data:`StageableRecord`) and write
byte-identical blobs for the same call.

Two builds, both checked, and no other (the constructor refuses any other caller):
:meth:`PackedCallRecord.from_trusted_columns` (the worker's, over
:func:`~sink.contract.packed.staging_delta_columns`) and :meth:`PackedCallRecord.of` (from a model).
The object is frozen; its column lists and its extras are its own: read them, never mutate them
(records are values). :func:`verified_record` is the check every sink runs before storing either form.
"""

from __future__ import annotations

from dataclasses import InitVar, dataclass, fields
from typing import Any, Final, TypeAlias, overload

from pydantic import ValidationError
from pydantic_core import PydanticSerializationError

from sink.contract._packed import PackedColumns, TrustedColumns
from sink.contract.digest import EMPTY_EXTRAS_DIGEST, compute_extras_digest, staging_digest_from_packed
from sink.contract.record_base import CaptureMode, staging_key
from sink.contract.record_form import packed_columns, unchanged_since_validation
from sink.contract.record_schema import COLUMN_FIELDS, RECORD_FIELDS
from sink.contract.staged_records import (
    TRUSTED_COLUMNS_KEY,
    StagedCallRecord,
    StagedCallScalars,
    check_trusted_columns,
    record_from_trusted_columns,
    trusted_record_fields,
)

__all__ = ("PackedCallRecord", "StageableRecord", "require_stageable", "verified_record")

# Held by this module's builders only: the constructor refuses any other caller (see PackedCallRecord).
_BUILT: Final = object()
_RECORD_FIELD_NAMES: Final = tuple(field.name for field in RECORD_FIELDS)


@dataclass(frozen=True, slots=True, eq=False, repr=False)
class PackedCallRecord:
    """One staged call, validated, with its token columns packed (see the module docstring).

    The fields are the record's (the field table's, in its order) plus ``extras`` and ``packed``: the
    columns' proved packed forms, from which the codec writes the blob. Build one with
    :meth:`from_trusted_columns` or :meth:`of`; the constructor raises ``TypeError`` for anyone else.
    Compared by identity: compare ``digest`` (and ``staging_key``) to compare calls.
    """

    schema_version: int
    digest_version: int
    extras_digest_version: int
    rollout_id: str
    model_call_id: str
    parent_call_id: str | None
    mode: CaptureMode
    prev_len: int
    delta_len: int
    cum_len: int
    weight_version: int
    digest: str
    token_ids_delta: list[int]
    token_mask_delta: list[float]
    generation_log_probs_delta: list[float]
    extras_digest: str
    chain_hash: str
    cumulative_hash: str
    extras: dict[str, Any] | None
    packed: PackedColumns
    _token: InitVar[object]

    def __post_init__(self, _token: object) -> None:
        if _token is not _BUILT:
            raise TypeError("build a PackedCallRecord with PackedCallRecord.from_trusted_columns() or .of()")

    @property
    def staging_key(self) -> str:
        """The default key ``rollout_id/model_call_id`` (not necessarily the sink's key)."""
        return staging_key(self.rollout_id, self.model_call_id)

    @classmethod
    def from_trusted_columns(cls, columns: TrustedColumns, **scalars: Any) -> PackedCallRecord:
        """The record of *columns* (proved by :func:`~sink.contract.packed.staging_delta_columns`) and *scalars*.

        *scalars* are the other components except the lengths, which are derived, exactly as for
        :func:`~sink.contract.staged_records.record_from_trusted_columns` (the model form of this build): each is
        validated as the model validates it (:data:`~sink.contract.staged_records.StagedCallScalars`), the record
        rules are proved and the digest is computed once over the packed columns. Anything not proved here goes
        to that model build, which raises exactly the model's error (or, when this path was merely conservative,
        validates the record, which is then packed). The columns' lists become the record's: the caller must not
        reuse them.

        :raises TypeError: *columns* vouches for no ids, or an extras value is unsupported.
        :raises pydantic.ValidationError: a component fails validation.
        """
        check_trusted_columns(columns, "PackedCallRecord.from_trusted_columns")
        record = _proved(columns, trusted_record_fields(columns, scalars))
        return record if record is not None else cls.of(record_from_trusted_columns(columns, **scalars))

    @classmethod
    def of(cls, record: StagedCallRecord) -> PackedCallRecord:
        """The packed form of a model record (validated again unless provably unchanged since validation).

        The lists and the extras are copied, so the model stays the caller's.

        :raises TypeError: *record* is not a ``StagedCallRecord``, or an extras value is unsupported.
        :raises ValueError: the record is invalid (``pydantic.ValidationError``: built unvalidated, or changed
            since), or its columns do not pack (a validated record's always do).
        """
        if not isinstance(record, StagedCallRecord):
            raise TypeError(f"PackedCallRecord.of() takes a StagedCallRecord, got {type(record).__name__}")
        record = verified_record(record)
        packed = packed_columns(record)
        if packed is None:
            raise ValueError(f"record {record.staging_key!r}: its token columns do not satisfy the staging contract")
        values = {name: getattr(record, name) for name in _RECORD_FIELD_NAMES}
        for name in COLUMN_FIELDS:
            values[name] = list(values[name])
        extras = None if record.extras is None else dict(record.extras)
        return cls(**values, extras=extras, packed=packed, _token=_BUILT)

    def to_record(self) -> StagedCallRecord:
        """This call as the seed's :class:`~sink.contract.records.StagedCallRecord`, for the public boundary.

        Validated in full (the digest recomputed over the packed columns and compared); the model owns copies of
        the columns, and encodes to the same blob.
        """
        values = {name: getattr(self, name) for name in _RECORD_FIELD_NAMES}
        ids, mask, log_probs = (list(values[name]) for name in COLUMN_FIELDS)
        values.update(token_ids_delta=ids, token_mask_delta=mask, generation_log_probs_delta=log_probs)
        trusted = TrustedColumns(self.packed, mask, log_probs, ids)
        return StagedCallRecord.model_validate(
            {**values, "extras": self.extras}, context={TRUSTED_COLUMNS_KEY: trusted}
        )

    def __repr__(self) -> str:  # the columns are large: keep logs readable
        return f"PackedCallRecord({self.staging_key!r}, delta_len={self.delta_len}, digest={self.digest[:12]}...)"


# The dataclass spells the table's fields out with their types; it must list them in table order.
assert tuple(field.name for field in fields(PackedCallRecord))[: len(RECORD_FIELDS)] == _RECORD_FIELD_NAMES, (
    "PackedCallRecord drifted from RECORD_FIELDS"
)

StageableRecord: TypeAlias = StagedCallRecord | PackedCallRecord
"""Either form of a staged call, as every sink's ``stage()`` and :func:`~sink.contract.codec.encode_record` take it."""


def require_stageable(record: object, caller: str) -> StageableRecord:
    """*record*, if it is either form of a staged call (what *caller* takes).

    :raises TypeError: *record* is neither a ``StagedCallRecord`` nor a ``PackedCallRecord``.
    """
    if not isinstance(record, StagedCallRecord | PackedCallRecord):
        raise TypeError(f"{caller} takes a StagedCallRecord or a PackedCallRecord, got {type(record).__name__}")
    return record


def _proved(columns: TrustedColumns, record_fields: dict[str, Any]) -> PackedCallRecord | None:
    """The record of :func:`~sink.contract.staged_records.trusted_record_fields`, or ``None`` if anything is not
    proved (the model build then decides)."""
    extras = record_fields.pop("extras", None)
    scalars = {name: value for name, value in record_fields.items() if name not in COLUMN_FIELDS}
    try:
        values = dict(StagedCallScalars.model_validate(scalars).__dict__)  # the validated values, by name
    except ValidationError:
        return None
    if extras is not None and type(extras) is not dict:
        return None
    try:
        if (EMPTY_EXTRAS_DIGEST if extras is None else compute_extras_digest(extras)) != values["extras_digest"]:
            return None
        values["digest"] = staging_digest_from_packed(values, *columns.packed.digest_forms())
    except (ValueError, TypeError, KeyError):  # a pre-check failed: the model build reports it precisely
        return None
    return PackedCallRecord(
        **values,
        **{name: record_fields[name] for name in COLUMN_FIELDS},
        extras=None if extras is None else dict(extras),
        packed=columns.packed,
        _token=_BUILT,
    )


@overload
def verified_record(record: PackedCallRecord) -> PackedCallRecord: ...
@overload
def verified_record(record: StagedCallRecord) -> StagedCallRecord: ...
def verified_record(record: StageableRecord) -> StageableRecord:
    """*record*, checked before a sink stores it: provably valid as it is, or else validated again.

    A :class:`PackedCallRecord` was validated when it was built and is frozen; only its extras (a dict) could
    have changed, so they are hashed again if it has any. A model record is returned if it is unchanged since
    it was validated, else as a freshly validated copy: a record built by ``model_construct``, or whose fields
    were reassigned after validation, is validated again, so a sink never stores a blob the source would
    reject. (Element assignment inside a column after validation is not detected: records are values, do not
    mutate them.)

    :raises ValueError: the record is invalid (``pydantic.ValidationError`` is a ``ValueError``).
    :raises TypeError: an extras value is unsupported.
    """
    if isinstance(record, PackedCallRecord):
        if record.extras is not None and compute_extras_digest(record.extras) != record.extras_digest:
            raise ValueError("extras_digest does not match extras")
        return record
    if unchanged_since_validation(record) and (
        record.extras is None or compute_extras_digest(record.extras) == record.extras_digest
    ):
        return record
    try:
        data = record.model_dump(warnings=False)
    except PydanticSerializationError as exc:
        raise ValueError(f"record cannot be serialized: {exc}") from exc
    return StagedCallRecord.model_validate(data)
