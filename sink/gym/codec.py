"""One ``TokenEntry`` <-> one compact blob, and the rules a stored entry and a rollout id must follow.

Layout: ``b"GE"``, the CRC-32 of the body (4 bytes, big-endian), then the body, a msgpack map:

* ``p``, ``g``: the prompt and generated ids in the staged records' packed form (:mod:`sink.contract.packed`):
  little-endian u32 per token when every id fits (``pw`` 4), else u64 (``pw`` 8; ``gw`` likewise);
* ``l``: the log-probabilities, little-endian float32 when every value round-trips exactly (``lw`` 4: what an
  engine's float32 log-probs always do), else float64 (``lw`` 8), so a stored value is the value put; a
  non-finite one (NaN, ±inf) is refused, as the RL path's records refuse it;
* ``f``: every other field (extras included) as ``model_dump(mode="json")`` gives it, dict keys sorted.

So a 2,048-token call takes about 8 bytes per generated token instead of about 15 as JSON. The encoding is
canonical: two entries whose JSON dumps are equal encode to the same body, so the body's SHA-256 (the
entry's digest) is the identity ``put`` compares under a known ``model_call_id``. A read checks the CRC and
the structure and refuses an entry whose ``schema_version`` is newer than :data:`SCHEMA_VERSION`
(:class:`~sink.errors.CodecError`); it builds entries without re-validating them (they were checked at put).
"""

from __future__ import annotations

import hashlib
import re
import struct
import zlib
from array import array
from typing import Any, Final, NamedTuple

import msgpack
import numpy as np
from pydantic import BaseModel
from pydantic_core import PydanticSerializationError

from sink.contract.packed import pack_ids
from sink.errors import CodecError, GymInputError
from sink.gym.entry import SCHEMA_VERSION

__all__ = ("EncodedEntry", "check_call_id", "check_rollout_id", "decode_entry", "encode_entry")

_MAGIC: Final = b"GE"
_HEAD: Final = struct.Struct(">2sI")
_COLUMNS: Final = ("prompt_token_ids", "generation_token_ids", "generation_log_probs")
_EXCLUDE: Final = frozenset(_COLUMNS)
_F4: Final[np.dtype[Any]] = np.dtype("<f4")
_F8: Final[np.dtype[Any]] = np.dtype("<f8")
_ID_DTYPES: Final[dict[int, np.dtype[Any]]] = {4: np.dtype("<u4"), 8: np.dtype("<u8")}
_LOG_PROB_DTYPES: Final[dict[int, np.dtype[Any]]] = {4: _F4, 8: _F8}
_ROLLOUT_ID_RE: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_MAX_ID_CHARS: Final = 512


def check_rollout_id(rollout_id: object) -> str:
    """*rollout_id* if Gym would accept it as an explicit id: an ASCII letter or digit, then letters, digits,
    ``.``, ``_``, ``-`` (at most 512 characters).

    :raises GymInputError: (a ``ValueError``) anything else (nothing is written).
    """
    if type(rollout_id) is not str or len(rollout_id) > _MAX_ID_CHARS or not _ROLLOUT_ID_RE.fullmatch(rollout_id):
        raise GymInputError(
            f"invalid rollout id {rollout_id!r}: it must start with an ASCII letter or digit and contain only "
            "letters, digits, '.', '_' and '-'"
        )
    return rollout_id


def check_call_id(model_call_id: object, *, allow_empty: bool = False) -> str:
    """*model_call_id* if it is a ``str`` (non-empty unless *allow_empty*) of at most 512 characters.

    :raises GymInputError: (a ``ValueError``) anything else.
    """
    if type(model_call_id) is not str or len(model_call_id) > _MAX_ID_CHARS or (not model_call_id and not allow_empty):
        raise GymInputError(f"invalid model_call_id {model_call_id!r}: a non-empty str of at most 512 characters")
    return model_call_id


class EncodedEntry(NamedTuple):
    """An entry ready to store: its rollout, call id, digest (hex SHA-256 of the body) and blob."""

    rollout_id: str
    model_call_id: str
    digest: str
    blob: bytes


def _sorted(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: _sorted(value[key]) for key in sorted(value)}
    if isinstance(value, list):
        return [_sorted(item) for item in value]
    return value


def _pack_ids(name: str, values: object) -> tuple[int, bytes]:
    packed = pack_ids(values) if type(values) is list else None
    if packed is None:
        raise GymInputError(f"{name} must be a list of non-negative ints below 2**64")
    return packed


def _pack_log_probs(values: object) -> tuple[int, bytes]:
    if type(values) is not list:
        raise GymInputError("generation_log_probs must be a list of floats")
    try:
        wide = np.frombuffer(array("d", values), dtype=np.float64)
    except TypeError as exc:
        raise GymInputError(f"generation_log_probs must be a list of floats: {exc}") from exc
    if not np.isfinite(wide).all():
        raise GymInputError("generation_log_probs must be finite: NaN, inf and -inf are refused, as on the RL path")
    with np.errstate(over="ignore"):  # a value beyond float32's range is stored as float64
        narrow = wide.astype(_F4)
    if np.array_equal(narrow, wide):
        return 4, narrow.tobytes()
    return 8, wide.astype(_F8).tobytes()


def encode_entry(entry: object) -> EncodedEntry:
    """Check and encode one ``TokenEntry`` (Gym's or :class:`~sink.gym.entry.LocalTokenEntry`).

    :raises TypeError: *entry* is not a pydantic model.
    :raises GymInputError: (a ``ValueError``) a field breaks the entry's rules (ids, lengths, a non-finite
        log-prob, ``token_item_index``, version).
    """
    if not isinstance(entry, BaseModel):
        raise TypeError(f"put() takes a TokenEntry (a pydantic model), got {type(entry).__name__}")
    columns = [getattr(entry, name, None) for name in _COLUMNS]
    try:
        fields = _sorted(entry.model_dump(mode="json", exclude=set(_EXCLUDE), warnings=False))
    except PydanticSerializationError as exc:
        raise GymInputError(f"entry cannot be serialized: {exc}") from exc
    rollout_id = check_rollout_id(fields.get("rollout_id"))
    call_id = check_call_id(fields.get("model_call_id"))
    version = fields.get("schema_version")
    if type(version) is not int or not 1 <= version <= SCHEMA_VERSION:
        raise GymInputError(f"schema_version must be an int from 1 to {SCHEMA_VERSION}, got {version!r}")
    pw, prompt = _pack_ids("prompt_token_ids", columns[0])
    gw, generated = _pack_ids("generation_token_ids", columns[1])
    lw, log_probs = _pack_log_probs(columns[2])
    if len(log_probs) // lw != len(generated) // gw:
        raise GymInputError(
            f"generation_log_probs has {len(log_probs) // lw} values for {len(generated) // gw} generation_token_ids"
        )
    index, items = fields.get("token_item_index"), fields.get("output_items")
    if index is not None and not (type(index) is int and type(items) is list and 0 <= index < len(items)):
        raise GymInputError(f"token_item_index {index!r} does not index output_items")
    try:
        body = msgpack.packb(
            {"p": prompt, "pw": pw, "g": generated, "gw": gw, "l": log_probs, "lw": lw, "f": fields}, use_bin_type=True
        )
    except (TypeError, ValueError, OverflowError) as exc:
        raise GymInputError(f"entry cannot be encoded: {exc}") from exc
    return EncodedEntry(
        rollout_id, call_id, hashlib.sha256(body).hexdigest(), _HEAD.pack(_MAGIC, zlib.crc32(body)) + body
    )


def _unpack(data: object, dtype: np.dtype[Any]) -> list[Any]:
    if type(data) is not bytes:
        raise CodecError("a token column is not binary")
    try:
        return np.frombuffer(data, dtype=dtype).tolist()  # type: ignore[no-any-return]
    except ValueError as exc:
        raise CodecError(f"a token column has a partial value: {exc}") from exc


def _width(body: dict[str, Any], name: str, dtypes: dict[int, np.dtype[Any]]) -> np.dtype[Any]:
    dtype = dtypes.get(body.get(name))  # type: ignore[arg-type]
    if dtype is None:
        raise CodecError(f"stored entry has an invalid {name!r}")
    return dtype


def decode_entry(blob: bytes, entry_type: type[Any]) -> Any:
    """The *entry_type* instance (Gym's ``TokenEntry`` or the local one) stored as *blob*.

    :raises CodecError: the blob is corrupt or truncated, or holds a newer ``schema_version``.
    """
    if len(blob) < _HEAD.size:
        raise CodecError("stored entry is truncated")
    magic, crc = _HEAD.unpack_from(blob)
    body = memoryview(blob)[_HEAD.size :]
    if magic != _MAGIC or zlib.crc32(body) != crc:
        raise CodecError("stored entry is corrupt (bad magic or CRC)")
    try:
        stored = msgpack.unpackb(body, raw=False)
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise CodecError(f"stored entry cannot be decoded: {exc}") from exc
    if type(stored) is not dict or type(stored.get("f")) is not dict:
        raise CodecError("stored entry has no field map")
    fields: dict[str, Any] = stored["f"]
    version = fields.get("schema_version")
    if type(version) is not int or version > SCHEMA_VERSION:
        raise CodecError(
            f"stored entry {fields.get('model_call_id')!r} has schema_version {version!r}; this reader supports "
            f"versions up to {SCHEMA_VERSION}: upgrade staging-sink"
        )
    fields["prompt_token_ids"] = _unpack(stored.get("p"), _width(stored, "pw", _ID_DTYPES))
    fields["generation_token_ids"] = _unpack(stored.get("g"), _width(stored, "gw", _ID_DTYPES))
    fields["generation_log_probs"] = _unpack(stored.get("l"), _width(stored, "lw", _LOG_PROB_DTYPES))
    return entry_type.model_construct(**fields)
