"""The staged-call field table, the supported versions and the lineage rule: one home for each.

Every place that lists a staged call's fields derives its list from
:data:`RECORD_FIELDS`: the call digest's inputs and their encodings (contract
§4.3), the codec's stored scalars (contract §11.4), the packed snapshot's
scalars, the identity fields verification compares (contract §8.1 step 8f)
and the token-free ``calls`` stream entry the sink writes. The table is in
the field order of :class:`~sink.contract.records.StagedCallBaseSnapshot`; the
payload ``extras`` of :class:`~sink.contract.records.StagedCallRecord` is not in it
(it is hashed on its own, contract §4.6).

Adding a field means a row here, the field (with its type) on
``StagedCallBaseSnapshot`` and on ``sink.contract.packed.PackedSnapshot`` (both check
at import that they list exactly the table's fields, in order). Every
scalar is stored by the codec: a new one changes the blob's key set, so
decide on ``sink.contract.codec.CODEC_VERSION`` too; a new digest input is a new
digest version (contract §4).
"""

from __future__ import annotations

from typing import Final, NamedTuple

__all__ = (
    "CALLS_ENTRY_FIELDS",
    "COLUMN_FIELDS",
    "DIGEST_HEAD_INPUTS",
    "DIGEST_SCALAR_FIELDS",
    "DIGEST_TAIL_INPUTS",
    "EXTRAS_DIGEST_VERSION",
    "IDENTITY_FIELDS",
    "RECORD_FIELDS",
    "SCALAR_FIELDS",
    "STAGING_DIGEST_VERSION",
    "STAGING_SCHEMA_VERSION",
    "STORED_SCALAR_FIELDS",
    "SUPPORTED_VERSIONS",
    "RecordField",
    "calls_entry",
    "lineage_problem",
    "unsupported_version",
)

STAGING_SCHEMA_VERSION: Final = 2
STAGING_DIGEST_VERSION: Final = 2
EXTRAS_DIGEST_VERSION: Final = 1


class RecordField(NamedTuple):
    """One field of a staged call and every role it plays on the wire."""

    name: str
    #: How the call digest encodes it (contract §4.3), ``None`` if it is no digest input:
    #: ``version`` one byte; ``text`` u64 length + UTF-8; ``optional_text`` 0x00, or 0x01 + text;
    #: ``u64`` big-endian; ``hex`` 32 raw bytes; ``present_hex`` 0x01 + 32 raw bytes;
    #: ``ids`` / ``f32s`` a length-prefixed token column.
    digest: str | None
    #: Compared between snapshot and manifest row (contract §8.1 step 8f, in table order).
    identity: bool = False
    #: ``(slot, name)`` in the token-free ``calls`` stream entry (slot 0 is the staging key,
    #: the last slot the blob size), ``None`` if the entry does not carry it.
    calls_entry: tuple[int, str] | None = None


RECORD_FIELDS: Final = (
    RecordField("schema_version", "version"),
    RecordField("digest_version", "version"),
    RecordField("extras_digest_version", "version"),
    RecordField("rollout_id", "text"),
    RecordField("model_call_id", "text", identity=True, calls_entry=(1, "call")),
    RecordField("parent_call_id", "optional_text", identity=True, calls_entry=(2, "parent")),
    RecordField("mode", "text", identity=True),
    RecordField("prev_len", "u64", identity=True, calls_entry=(4, "prev_len")),
    RecordField("delta_len", "u64", identity=True, calls_entry=(5, "delta_len")),
    RecordField("cum_len", "u64", identity=True, calls_entry=(6, "cum_len")),
    RecordField("weight_version", "u64", identity=True, calls_entry=(7, "weight")),
    RecordField("digest", None, identity=True, calls_entry=(3, "digest")),
    RecordField("token_ids_delta", "ids"),
    RecordField("token_mask_delta", "f32s"),
    RecordField("generation_log_probs_delta", "f32s"),
    RecordField("extras_digest", "hex", identity=True),
    RecordField("chain_hash", "present_hex", identity=True),
    RecordField("cumulative_hash", "present_hex", identity=True),
)

_COLUMN_ENCODINGS: Final = ("ids", "f32s")

#: The three token columns, in digest order.
COLUMN_FIELDS: Final = tuple(field.name for field in RECORD_FIELDS if field.digest in _COLUMN_ENCODINGS)
#: Every scalar field (the digest included), in table order: a packed snapshot's scalars.
SCALAR_FIELDS: Final = tuple(field.name for field in RECORD_FIELDS if field.digest not in _COLUMN_ENCODINGS)
#: The scalars the codec stores under their own names, in this order (the digest sits in the blob's head).
STORED_SCALAR_FIELDS: Final = tuple(name for name in SCALAR_FIELDS if name != "digest")
_DIGEST_SCALARS: Final = tuple(
    (index, field.name, field.digest)
    for index, field in enumerate(RECORD_FIELDS)
    if field.digest is not None and field.digest not in _COLUMN_ENCODINGS
)
_FIRST_COLUMN: Final = min(index for index, field in enumerate(RECORD_FIELDS) if field.digest in _COLUMN_ENCODINGS)
#: ``(name, encoding)`` of the digest inputs hashed before the columns, in payload order.
DIGEST_HEAD_INPUTS: Final = tuple((name, kind) for index, name, kind in _DIGEST_SCALARS if index < _FIRST_COLUMN)
#: ``(name, encoding)`` of the digest inputs hashed after the columns, in payload order.
DIGEST_TAIL_INPUTS: Final = tuple((name, kind) for index, name, kind in _DIGEST_SCALARS if index > _FIRST_COLUMN)
#: Every scalar (non-column) input of the call digest, in payload order.
DIGEST_SCALAR_FIELDS: Final = tuple(name for _, name, _ in _DIGEST_SCALARS)
#: Step 8f of contract §8.1: compared between snapshot and manifest row, first mismatch wins.
IDENTITY_FIELDS: Final = tuple(field.name for field in RECORD_FIELDS if field.identity)
#: The only accepted value of each version field.
SUPPORTED_VERSIONS: Final = {
    "schema_version": STAGING_SCHEMA_VERSION,
    "digest_version": STAGING_DIGEST_VERSION,
    "extras_digest_version": EXTRAS_DIGEST_VERSION,
}

# (slot, entry name, record field) of every field the calls entry carries, in slot order.
_ENTRY_SLOTS: Final = sorted((*field.calls_entry, field.name) for field in RECORD_FIELDS if field.calls_entry)
assert [slot for slot, _, _ in _ENTRY_SLOTS] == list(range(1, len(_ENTRY_SLOTS) + 1))
_ENTRY_RECORD_FIELDS: Final = tuple(name for _, _, name in _ENTRY_SLOTS)
#: Field names of one token-free entry in ``ns:{R}:calls``, in XADD order.
CALLS_ENTRY_FIELDS: Final = ("key", *(entry_name for _, entry_name, _ in _ENTRY_SLOTS), "bytes")


def calls_entry(staging_key: str, record: object, blob_size: int) -> tuple[str, ...]:
    """The values of :data:`CALLS_ENTRY_FIELDS` for one staged record (``None`` is written as ``""``)."""
    values = (getattr(record, name) for name in _ENTRY_RECORD_FIELDS)
    return (staging_key, *("" if value is None else str(value) for value in values), str(blob_size))


def unsupported_version(name: str, value: object, expected: int) -> str | None:
    """Why *value* is not the supported version *expected* of *name*, or ``None`` if it is.

    Versions are exact ints: ``True`` and ``2.0`` are not version 2.
    """
    if type(value) is int and value == expected:
        return None
    return f"unsupported {name} {value!r}: only {expected} is accepted"


def lineage_problem(parent_call_id: str | None, prev_len: object, mode: str | None) -> str | None:
    """The lineage rule: a parentless call has ``prev_len == 0`` and mode ``text``; a call with a parent
    has ``prev_len > 0`` and mode ``token_in``. Returns what is wrong, or ``None``.

    *mode* ``None`` checks the lengths only (for records without a mode).
    """
    if parent_call_id is None:
        if prev_len != 0:
            return "a parentless call must have prev_len == 0"
        if mode is not None and mode != "text":
            return "a parentless call must have mode 'text'"
        return None
    if type(prev_len) is not int or prev_len <= 0:
        return "a call with a parent must have prev_len > 0"
    if mode is not None and mode != "token_in":
        return "a call with a parent must have mode 'token_in'"
    return None
