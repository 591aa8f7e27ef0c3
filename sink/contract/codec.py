"""The msgpack record codec: one staged call <-> one compact, self-verifying blob.

Layout (contract §11.4): a msgpack map whose first entry is the codec
version (``"v": CODEC_VERSION``) and whose second is the call digest as hex
text, so the digest always sits within the first :data:`DIGEST_HEAD_BYTES`
bytes (the staging script compares digests with ``GETRANGE``). Scalars are
msgpack scalars under their record field names (``STORED_SCALAR_FIELDS`` of
:mod:`sink.contract.record_schema`, in that order), ``extras`` a msgpack map (or
nil), and the token columns are msgpack ``bin`` values:

* ``ids``: little-endian u32 per token when every id fits (``ids_width`` 4),
  else u64 (``ids_width`` 8);
* ``mask``: one byte per token, the leading byte of the big-endian float32:
  ``0x00`` for 0.0, ``0x80`` for -0.0, ``0x3f`` for 1.0;
* ``log_probs``: little-endian float32 when every value round-trips exactly
  (``log_prob_width`` 4), else float64 (``log_prob_width`` 8).

That is 9 bytes per token plus a few hundred per record, against about 22
for msgpack lists. Decoding checks the structure strictly, then builds the
snapshot through ``StagedCallSnapshot.model_validate``: every record rule
runs and the digest is recomputed from bytes derived from the stored columns
and compared, so a tampered blob is rejected. Every failure is a
:class:`~sink.errors.CodecError`; nothing partial is returned. Never pickle.
"""

from __future__ import annotations

import struct
from array import array
from collections.abc import Iterable
from typing import Any, Final, NamedTuple

import msgpack
from pydantic import ValidationError

from sink.contract._packed import (
    ID_TYPECODES,
    MASK_CODES,
    PackedColumns,
    TrustedColumns,
    carry_log_probs_zero_plain,
    f32_exact,
    finite_lanes,
    mask_values_from_codes,
    unpack_list,
)
from sink.contract.packed import PackedSnapshot, verified_packed_snapshot
from sink.contract.packed_record import PackedCallRecord, StageableRecord, require_stageable
from sink.contract.record_form import packed_columns
from sink.contract.record_schema import STORED_SCALAR_FIELDS, unsupported_version
from sink.contract.staged_records import TRUSTED_COLUMNS_KEY, StagedCallSnapshot
from sink.errors import CodecError

__all__ = (
    "CODEC_VERSION",
    "DEFAULT_MAX_RECORD_BYTES",
    "DIGEST_HEAD_BYTES",
    "decode_packed_record",
    "decode_record",
    "encode_record",
)

CODEC_VERSION: Final = 1
DEFAULT_MAX_RECORD_BYTES: Final = 64 * 1024 * 1024
#: The hex digest ends within this many leading bytes of every blob
#: (map16 header 3 + "v" 2 + version 1 + "digest" 7 + str8 header 2 + 64).
DIGEST_HEAD_BYTES: Final = 79

_FLOAT_TYPECODES: Final = {4: "f", 8: "d"}

_COLUMN_KEYS: Final = ("ids_width", "ids", "mask", "log_prob_width", "log_probs")
_KEYS: Final = frozenset(("v", "digest", *STORED_SCALAR_FIELDS, *_COLUMN_KEYS, "extras"))


# --- encoding -----------------------------------------------------------------


def _log_prob_column(packed: PackedColumns, log_probs: list[float]) -> tuple[int, bytes]:
    exact = packed.lp_f32_exact
    if exact is None:
        exact = packed.lp_f32_exact = f32_exact(log_probs)
    if exact:
        f32 = array("f")
        f32.frombytes(packed.lp_f32be)
        f32.byteswap()  # big-endian -> little-endian on any host
        return 4, f32.tobytes()
    return 8, struct.pack(f"<{len(log_probs)}d", *log_probs)


def encode_record(record: StageableRecord) -> bytes:
    """Encode a validated staged call, in either form, as a codec blob (the same blob for the same call).

    A :class:`~sink.contract.packed_record.PackedCallRecord` is written from its packed columns; a
    ``StagedCallRecord`` from the columns packed while it was validated (packed again if its lists were
    replaced). Neither is validated here (the sinks run :func:`~sink.contract.packed_record.verified_record`).

    :raises TypeError: *record* is neither a ``StagedCallRecord`` nor a ``PackedCallRecord``.
    :raises CodecError: the record cannot be encoded (its columns or extras
        were mutated into values the contract rejects).
    """
    record = require_stageable(record, "encode_record()")
    packed = record.packed if isinstance(record, PackedCallRecord) else packed_columns(record)
    if packed is None:
        raise CodecError(
            "cannot encode record: its token columns do not satisfy the staging contract"
            " (was it mutated after validation?)"
        )
    log_prob_width, log_probs = _log_prob_column(packed, record.generation_log_probs_delta)
    payload: dict[str, Any] = {"v": CODEC_VERSION, "digest": record.digest}
    for name in STORED_SCALAR_FIELDS:
        payload[name] = getattr(record, name)
    payload["ids_width"] = packed.ids_width
    payload["ids"] = packed.ids_le
    payload["mask"] = packed.mask_codes
    payload["log_prob_width"] = log_prob_width
    payload["log_probs"] = log_probs
    payload["extras"] = record.extras
    try:
        blob: bytes = msgpack.packb(payload, use_bin_type=True, strict_types=True, datetime=False)
    except (TypeError, ValueError, OverflowError) as exc:
        raise CodecError(f"cannot encode record {record.staging_key!r}: {exc}") from exc
    return blob


# --- decoding -----------------------------------------------------------------


def _unique_map(pairs: list[tuple[Any, Any]]) -> dict[Any, Any]:
    mapping = dict(pairs)
    if len(mapping) != len(pairs):
        raise CodecError("malformed record blob: duplicate map key")
    return mapping


def _reject_ext(code: int, data: bytes) -> Any:
    raise CodecError(f"malformed record blob: msgpack extension type {code} is not allowed")


def _names(keys: Iterable[object]) -> str:
    return ", ".join(sorted(map(repr, keys)))


def _check_structure(obj: object) -> dict[str, Any]:
    if type(obj) is not dict:
        raise CodecError(f"malformed record blob: top level is {type(obj).__name__}, not a map")
    if next(iter(obj), None) != "v":
        raise CodecError("malformed record blob: the codec version must be the first map entry")
    if problem := unsupported_version("codec version", obj["v"], CODEC_VERSION):
        raise CodecError(problem)
    if obj.keys() != _KEYS:
        missing, unknown = _KEYS - obj.keys(), obj.keys() - _KEYS
        raise CodecError(f"malformed record blob: missing keys [{_names(missing)}], unknown keys [{_names(unknown)}]")
    return obj


def _column(obj: dict[str, Any], key: str, width: int, length: int) -> bytes:
    data = obj[key]
    if type(data) is not bytes:
        raise CodecError(f"malformed record blob: {key!r} must be msgpack bin, got {type(data).__name__}")
    if len(data) != width * length:
        raise CodecError(
            f"malformed record blob: {key!r} holds {len(data)} bytes, expected {width} x delta_len {length}"
        )
    return data


def _width(obj: dict[str, Any], key: str) -> int:
    width = obj[key]
    if type(width) is not int or width not in (4, 8):
        raise CodecError(f"malformed record blob: {key!r} must be 4 or 8, got {width!r}")
    return width


def _trust(
    ids: list[int],
    ids_width: int,
    ids_le: bytes,
    mask: list[float],
    codes: bytes,
    log_probs: list[float],
    lp_width: int,
    lp_le: bytes,
) -> TrustedColumns | None:
    """What the stored bytes prove about the decoded lists; ``None`` sends validation down the reference path."""
    if not finite_lanes(lp_le[lp_width - 1 :: lp_width]):
        return None
    if not carry_log_probs_zero_plain(codes, log_probs, lp_le, lp_width):
        return None
    if lp_width == 4:
        f32 = array("f")
        f32.frombytes(lp_le)
        f32.byteswap()
        lp_f32be = f32.tobytes()
    else:
        try:
            lp_f32be = struct.pack(f">{len(log_probs)}f", *log_probs)
        except OverflowError:
            return None
    packed = PackedColumns(
        length=len(codes),
        ids_width=ids_width,
        ids_le=ids_le,
        mask_codes=codes,
        lp_f32be=lp_f32be,
        lp_f32_exact=True if lp_width == 4 else None,
    )
    return TrustedColumns(packed, mask, log_probs, ids)


def _validation_summary(exc: ValidationError) -> str:
    parts = []
    for error in exc.errors(include_url=False, include_input=False)[:3]:
        location = ".".join(map(str, error["loc"])) or "record"
        parts.append(f"{location}: {error['msg']}")
    return "; ".join(parts)


class _Blob(NamedTuple):
    """A structurally valid blob: its fields and its column bytes (sizes and mask codes checked)."""

    fields: dict[str, Any]
    ids_width: int
    ids_le: bytes
    codes: bytes
    lp_width: int
    lp_le: bytes


def _parse(data: bytes, max_record_bytes: int) -> _Blob:
    """Unpack *data* and check its structure; the record rules are not checked here."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise TypeError(f"a record blob must be bytes, got {type(data).__name__}")
    if type(max_record_bytes) is not int:
        raise TypeError(f"max_record_bytes must be an int, got {type(max_record_bytes).__name__}")
    if max_record_bytes < 1:
        raise ValueError(f"max_record_bytes must be positive, got {max_record_bytes}")
    size = memoryview(data).nbytes
    if size > max_record_bytes:
        raise CodecError(f"record blob of {size} bytes exceeds max_record_bytes={max_record_bytes}")
    try:
        obj = msgpack.unpackb(
            data, raw=False, strict_map_key=True, use_list=True, object_pairs_hook=_unique_map, ext_hook=_reject_ext
        )
    except CodecError:
        raise
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise CodecError(f"malformed record blob: {exc}") from exc
    fields = _check_structure(obj)
    length = fields["delta_len"]
    if type(length) is not int or length < 0:
        raise CodecError(f"malformed record blob: delta_len must be a non-negative int, got {length!r}")
    ids_width, lp_width = _width(fields, "ids_width"), _width(fields, "log_prob_width")
    ids_le = _column(fields, "ids", ids_width, length)
    codes = _column(fields, "mask", 1, length)
    lp_le = _column(fields, "log_probs", lp_width, length)
    if bad_codes := codes.translate(None, MASK_CODES):
        raise CodecError(f"malformed record blob: mask code 0x{bad_codes[0]:02x} is not 0x00, 0x80 or 0x3f")
    return _Blob(fields, ids_width, ids_le, codes, lp_width, lp_le)


def _snapshot(blob: _Blob) -> StagedCallSnapshot:
    """The reference decode: build the lists and validate every record rule."""
    fields, ids_width, ids_le, codes, lp_width, lp_le = blob
    ids = unpack_list((ids_le,), ID_TYPECODES[ids_width])
    mask = mask_values_from_codes(codes)
    log_probs = unpack_list((lp_le,), _FLOAT_TYPECODES[lp_width])
    trusted = _trust(ids, ids_width, ids_le, mask, codes, log_probs, lp_width, lp_le)
    record = {name: fields[name] for name in STORED_SCALAR_FIELDS}
    record.update(
        digest=fields["digest"],
        token_ids_delta=ids,
        token_mask_delta=mask,
        generation_log_probs_delta=log_probs,
        extras=fields["extras"],
    )
    context = None if trusted is None else {TRUSTED_COLUMNS_KEY: trusted}
    try:
        return StagedCallSnapshot.model_validate(record, context=context)
    except ValidationError as exc:
        raise CodecError(f"record failed verification: {_validation_summary(exc)}") from exc
    except (ValueError, TypeError) as exc:  # TypeError: unsupported extras value (contract §2.2)
        raise CodecError(f"record failed verification: {exc}") from exc


def decode_record(data: bytes, *, max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES) -> StagedCallSnapshot:
    """Decode and fully verify a codec blob.

    Every record rule runs and the call digest is recomputed and compared.

    :raises TypeError: *data* is not bytes-like or *max_record_bytes* is not an int.
    :raises ValueError: *max_record_bytes* is not positive.
    :raises CodecError: the blob is oversized, malformed, truncated, of
        another codec version, or tampered with; the message names what is wrong.
    """
    return _snapshot(_parse(data, max_record_bytes))


def decode_packed_record(data: bytes, *, max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES) -> PackedSnapshot:
    """Decode and fully verify a codec blob into a :class:`~sink.contract.packed.PackedSnapshot`.

    The same checks as :func:`decode_record`, proved on the stored bytes
    without building per-token Python objects; a blob this path cannot prove
    is decoded by :func:`decode_record` (which raises the precise error).

    :raises TypeError: as :func:`decode_record`.
    :raises ValueError: as :func:`decode_record`.
    :raises CodecError: as :func:`decode_record`.
    """
    blob = _parse(data, max_record_bytes)
    packed = verified_packed_snapshot(blob.fields, blob.ids_le, blob.ids_width, blob.codes, blob.lp_le, blob.lp_width)
    return packed if packed is not None else PackedSnapshot.of(_snapshot(blob))
