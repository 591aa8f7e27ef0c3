"""The v2 digest contract (contract §4), byte-identical to the reference.

Every hash is ``SHA-256(DOMAIN || payload)`` rendered as 64 lowercase hex
characters. Token columns are encoded with :mod:`array`, :mod:`struct` and
``byteswap`` so that the per-token work runs in C, not in Python loops; the
validation that the contract requires (exact types, ranges, finiteness) is
done with map/count/compress pipelines that also run in C.

The public functions check everything (contract §4.3). Record validators,
which have already proved types and rules 1-8, hash pre-packed columns via
``_staging_digest_from_packed`` (see :mod:`sink._packed`); the payload
layout is the same ``_digest_head`` + framed columns + tail either way.
"""

from __future__ import annotations

import hashlib
import itertools
import math
import operator
import re
import struct
import sys
from array import array
from collections.abc import Mapping, Sequence
from typing import Any, Final, TypeAlias

from ._packed import ids_from_marshal, is_token_id_list, pack_f32be

__all__ = (
    "CALL_DIGEST_DOMAIN",
    "CHAIN_HASH_DOMAIN",
    "EMPTY_EXTRAS_DIGEST",
    "EXTRAS_DIGEST_DOMAIN",
    "EXTRAS_DIGEST_VERSION",
    "PREFIX_HASH_DOMAIN",
    "STAGING_DIGEST_VERSION",
    "STAGING_SCHEMA_VERSION",
    "build_staging_delta",
    "chain_hash_of_packed",
    "check_mask_values",
    "compute_chain_hash",
    "compute_extras_digest",
    "compute_staging_digest",
    "encode_f32s",
    "encode_token_ids",
    "hash_packed_token_ids",
    "hash_token_ids",
    "is_digest_hex",
    "is_token_id_list",
)

STAGING_SCHEMA_VERSION: Final = 2
STAGING_DIGEST_VERSION: Final = 2
EXTRAS_DIGEST_VERSION: Final = 1

CALL_DIGEST_DOMAIN = b"nemo-gym-staging-call-v2"
PREFIX_HASH_DOMAIN = b"nemo-gym-staging-prefix-v2"
CHAIN_HASH_DOMAIN = b"nemo-gym-staging-chain-v1"
EXTRAS_DIGEST_DOMAIN = b"nemo-gym-staging-extras-v1"

_BIG_ENDIAN = sys.byteorder == "big"
_U64 = struct.Struct(">Q")
_I64 = struct.Struct(">q")
_F64 = struct.Struct(">d")
_HEX_RE = re.compile(r"[0-9a-f]{64}")
_MASK_VALUES = frozenset({0.0, 1.0})
_ZERO_ONLY = frozenset({0.0})
_MODES = ("text", "token_in")


def is_digest_hex(value: object) -> bool:
    """Return whether *value* is a ``str`` of exactly 64 lowercase hex digits."""
    return type(value) is str and _HEX_RE.fullmatch(value) is not None


def _u64(n: object) -> bytes:
    if type(n) is not int:
        raise ValueError(f"expected an int for a u64 field, got {type(n).__name__}")
    if n < 0 or n >= 1 << 64:
        raise ValueError(f"u64 field out of range: {n}")
    return _U64.pack(n)


def _text(s: object) -> bytes:
    if type(s) is not str:
        raise TypeError(f"expected str, got {type(s).__name__}")
    raw = s.encode("utf-8")
    return _U64.pack(len(raw)) + raw


def _hexbytes(h: object) -> bytes:
    if not is_digest_hex(h):
        raise ValueError(f"not a 64-character lowercase hex digest: {h!r}")
    assert isinstance(h, str)
    return bytes.fromhex(h)


def encode_token_ids(token_ids: Sequence[int]) -> bytes:
    """Encode ``ids(seq)``: a u64 count, then each id as u64 big-endian.

    :raises ValueError: an id is not an exact ``int``, is negative or is
        ``>= 2**64``.
    """
    # Fast path: marshal proves a list of exact ints in [0, 2**31) and hands over their bytes.
    fast = ids_from_marshal(token_ids, with_le=False) if type(token_ids) is list else None
    if fast is not None:
        return _U64.pack(len(token_ids)) + fast[1]
    # list.count compares by identity first: one C pass, no set building
    if list(map(type, token_ids)).count(int) != len(token_ids):
        raise ValueError("token ids must be exact ints")
    try:
        packed = array("Q", token_ids)
    except OverflowError:
        raise ValueError("token ids must be in [0, 2**64)") from None
    if not _BIG_ENDIAN:
        packed.byteswap()
    return _U64.pack(len(packed)) + packed.tobytes()


def encode_f32s(values: Sequence[float]) -> bytes:
    """Encode ``f32s(seq)``: a u64 count, then IEEE-754 binary32 big-endian.

    :raises ValueError: an element is not an exact ``float``, is NaN or
        infinite, or overflows binary32.
    """
    if list(map(type, values)).count(float) != len(values):
        raise ValueError("mask and log-probability values must be exact Python floats")
    # The float64 sum of the inputs is non-finite iff one of them is (a sum of
    # finite floats may overflow to inf too: that is then re-checked exactly).
    if not math.isfinite(sum(values)) and not all(map(math.isfinite, values)):
        raise ValueError("mask and log-probability values must be finite and within binary32 range")
    # struct rounds to nearest binary32 and fails exactly when a finite float64
    # rounds to infinity.
    packed = pack_f32be(values)
    if packed is None:
        raise ValueError("mask and log-probability values must be finite and within binary32 range")
    return _U64.pack(len(values)) + packed


def _lp(payload: bytes) -> bytes:
    return _U64.pack(len(payload)) + payload


def hash_token_ids(token_ids: Sequence[int]) -> str:
    """Cumulative (prefix) hash of a full token sequence (contract §4.4)."""
    return hashlib.sha256(PREFIX_HASH_DOMAIN + encode_token_ids(token_ids)).hexdigest()


def hash_packed_token_ids(parts: Sequence[bytes], count: int) -> str:
    """:func:`hash_token_ids` of ids already packed as u64 big-endian (*parts* concatenated, *count* ids)."""
    digest = hashlib.sha256(PREFIX_HASH_DOMAIN + _U64.pack(count))
    for part in parts:
        digest.update(part)
    return digest.hexdigest()


def _chain_parent(parent_chain_hash: str | None) -> bytes:
    return b"\x00" if parent_chain_hash is None else b"\x01" + _hexbytes(parent_chain_hash)


def chain_hash_of_packed(parent_chain_hash: str | None, ids_u64be: bytes) -> str:
    """:func:`compute_chain_hash` of a delta already packed as u64 big-endian ids."""
    digest = hashlib.sha256(CHAIN_HASH_DOMAIN + _chain_parent(parent_chain_hash) + _U64.pack(len(ids_u64be) // 8))
    digest.update(ids_u64be)
    return digest.hexdigest()


def compute_chain_hash(parent_chain_hash: str | None, token_ids_delta: Sequence[int]) -> str:
    """Chain hash of one delta linked to its parent's chain hash (contract §4.5)."""
    parent = _chain_parent(parent_chain_hash)
    return hashlib.sha256(CHAIN_HASH_DOMAIN + parent + encode_token_ids(token_ids_delta)).hexdigest()


def _check_version(name: str, value: object, expected: int) -> None:
    if type(value) is not int or value != expected:
        raise ValueError(f"unsupported {name}: {value!r} (only {expected} is accepted)")


def check_mask_values(token_mask_delta: Sequence[float], generation_log_probs_delta: Sequence[float]) -> None:
    """Rules 7 and 8 of contract §3.3, shared by the digest pre-checks and validators.

    :raises ValueError: a mask is not 0.0/1.0, or a carry (mask 0.0)
        log-probability is not 0.0.
    """
    if not set(token_mask_delta) <= _MASK_VALUES:
        raise ValueError("masks must be 0.0 or 1.0")
    carry_log_probs = itertools.compress(generation_log_probs_delta, map(operator.not_, token_mask_delta))
    if not set(carry_log_probs) <= _ZERO_ONLY:
        raise ValueError("prompt-carry log probabilities must be 0.0")


def compute_staging_digest(
    *,
    schema_version: int,
    digest_version: int,
    extras_digest_version: int,
    rollout_id: str,
    model_call_id: str,
    parent_call_id: str | None,
    mode: str,
    prev_len: int,
    delta_len: int,
    cum_len: int,
    weight_version: int,
    token_ids_delta: Sequence[int],
    token_mask_delta: Sequence[float],
    generation_log_probs_delta: Sequence[float],
    extras_digest: str,
    chain_hash: str,
    cumulative_hash: str,
) -> str:
    """Call digest of one staged delta (contract §4.3).

    :raises ValueError: a pre-check of contract §4.3 fails.
    :raises TypeError: an id field is not a ``str``.
    """
    _check_version("schema_version", schema_version, STAGING_SCHEMA_VERSION)
    _check_version("digest_version", digest_version, STAGING_DIGEST_VERSION)
    _check_version("extras_digest_version", extras_digest_version, EXTRAS_DIGEST_VERSION)
    if not rollout_id or not model_call_id:
        raise ValueError("rollout_id and model_call_id must be non-empty")
    if parent_call_id == "":
        raise ValueError("parent_call_id must be None or non-empty")
    if mode not in _MODES:
        raise ValueError(f"unknown capture mode: {mode!r}")
    if parent_call_id is None:
        if prev_len != 0 or mode != "text":
            raise ValueError("a parentless call must have prev_len 0 and mode 'text'")
    elif not (type(prev_len) is int and prev_len > 0) or mode != "token_in":
        raise ValueError("a child call must have prev_len > 0 and mode 'token_in'")
    if delta_len == 0:
        raise ValueError("a staged delta must contain at least one token")
    if delta_len != len(token_ids_delta):
        raise ValueError("delta_len must equal the number of token ids")
    n = len(token_ids_delta)
    if len(token_mask_delta) != n or len(generation_log_probs_delta) != n:
        raise ValueError("token, mask and log-probability columns must have equal length")
    check_mask_values(token_mask_delta, generation_log_probs_delta)
    if type(cum_len) is not int or type(prev_len) is not int or type(delta_len) is not int:
        raise ValueError("lengths must be exact ints")
    if cum_len != prev_len + delta_len:
        raise ValueError("cum_len must equal prev_len + delta_len")
    extras_bytes = _hexbytes(extras_digest)
    head = _digest_head(
        (schema_version, digest_version, extras_digest_version),
        rollout_id,
        model_call_id,
        parent_call_id,
        mode,
        (prev_len, delta_len, cum_len, weight_version),
    )
    ids = encode_token_ids(token_ids_delta)
    mask = encode_f32s(token_mask_delta)
    log_probs = encode_f32s(generation_log_probs_delta)
    tail = extras_bytes + b"\x01" + _hexbytes(chain_hash) + b"\x01" + _hexbytes(cumulative_hash)
    digest = hashlib.sha256(CALL_DIGEST_DOMAIN)
    for part in (head, _lp(ids), _lp(mask), _lp(log_probs), tail):
        digest.update(part)
    return digest.hexdigest()


def _digest_head(
    versions: tuple[int, int, int],
    rollout_id: str,
    model_call_id: str,
    parent_call_id: str | None,
    mode: str,
    lengths: tuple[int, int, int, int],
) -> bytes:
    """Payload fields 1-11 of the call digest (contract §4.3)."""
    parent = b"\x00" if parent_call_id is None else b"\x01" + _text(parent_call_id)
    return b"".join(
        (
            bytes(versions),
            _text(rollout_id),
            _text(model_call_id),
            parent,
            _text(mode),
            *map(_u64, lengths),
        )
    )


_Buffers: TypeAlias = Sequence[bytes | bytearray | memoryview]


def _nbytes(pieces: _Buffers) -> int:
    # every piece is a byte-format buffer, so len() counts bytes
    return sum(map(len, pieces))


def _staging_digest_from_packed(
    *,
    versions: tuple[int, int, int],
    rollout_id: str,
    model_call_id: str,
    parent_call_id: str | None,
    mode: str,
    prev_len: int,
    delta_len: int,
    cum_len: int,
    weight_version: int,
    ids_u64be: _Buffers,
    mask_f32be: _Buffers,
    lp_f32be: _Buffers,
    extras_digest: str,
    chain_hash: str,
    cumulative_hash: str,
) -> str:
    """Call digest from columns already packed in their digest form, each given in pieces.

    For record validators that have proved rules 1-8 and the column pre-checks
    of contract §4.3 (exact types, ranges, equal lengths, binary32 range)
    themselves; the scalar pre-checks run here. The caller must fall back to
    :func:`compute_staging_digest` on any exception, which raises the precise
    contract error.

    :raises ValueError: a scalar pre-check fails or a column has the wrong size.
    :raises TypeError: an id field is not a ``str``.
    """
    if (
        versions != (STAGING_SCHEMA_VERSION, STAGING_DIGEST_VERSION, EXTRAS_DIGEST_VERSION)
        or not all(type(version) is int for version in versions)
        or not rollout_id
        or not model_call_id
        or parent_call_id == ""
        or mode not in _MODES
        or (parent_call_id is None) != (mode == "text")
        or (parent_call_id is None) != (prev_len == 0)
        or delta_len == 0
        or cum_len != prev_len + delta_len
        or _nbytes(ids_u64be) != 8 * delta_len
        or _nbytes(mask_f32be) != 4 * delta_len
        or _nbytes(lp_f32be) != 4 * delta_len
    ):
        raise ValueError("a call-digest pre-check failed")
    count = _U64.pack(delta_len)
    digest = hashlib.sha256(CALL_DIGEST_DOMAIN)
    digest.update(
        _digest_head(
            versions, rollout_id, model_call_id, parent_call_id, mode, (prev_len, delta_len, cum_len, weight_version)
        )
    )
    for column in (ids_u64be, mask_f32be, lp_f32be):
        digest.update(_U64.pack(8 + _nbytes(column)) + count)
        for piece in column:
            digest.update(piece)
    digest.update(_hexbytes(extras_digest) + b"\x01" + _hexbytes(chain_hash) + b"\x01" + _hexbytes(cumulative_hash))
    return digest.hexdigest()


_INT64_MIN = -(1 << 63)
_INT64_MAX = (1 << 63) - 1


def _encode_extras_value(value: Any, out: list[bytes]) -> None:
    kind = type(value)
    if value is None:
        out.append(b"N")
    elif kind is bool:
        out.append(b"B\x01" if value else b"B\x00")
    elif kind is int:
        if not _INT64_MIN <= value <= _INT64_MAX:
            raise ValueError(f"extras int out of int64 range: {value}")
        out.append(b"I" + _I64.pack(value))
    elif kind is float:
        if not math.isfinite(value):
            raise ValueError("extras floats must be finite")
        out.append(b"F" + _F64.pack(value))
    elif kind is str:
        out.append(b"S" + _text(value))
    elif kind is list:
        out.append(b"L" + _U64.pack(len(value)))
        for item in value:
            _encode_extras_value(item, out)
    elif kind is dict:
        _encode_extras_dict(value, out)
    else:
        raise TypeError(f"unsupported extras value type: {kind.__name__}")


def _encode_extras_dict(value: dict[Any, Any], out: list[bytes]) -> None:
    encoded_keys = []
    for key in value:
        if type(key) is not str:
            raise TypeError(f"extras dict keys must be str, got {type(key).__name__}")
        encoded_keys.append((key.encode("utf-8"), key))
    encoded_keys.sort()
    out.append(b"D" + _U64.pack(len(value)))
    for raw, key in encoded_keys:
        out.append(_U64.pack(len(raw)) + raw)
        _encode_extras_value(value[key], out)


def compute_extras_digest(extras: Mapping[str, Any] | None) -> str:
    """Digest of an engine-native extras payload (contract §4.6).

    :raises TypeError: *extras* is not ``None`` or a mapping, or holds an
        unsupported value or key type.
    :raises ValueError: an int is outside int64 or a float is not finite.
    """
    out = [EXTRAS_DIGEST_DOMAIN, bytes((EXTRAS_DIGEST_VERSION,))]
    if extras is None:
        out.append(b"N")
    elif isinstance(extras, Mapping):
        _encode_extras_dict(dict(extras), out)
    else:
        raise TypeError(f"extras must be None or a mapping, got {type(extras).__name__}")
    return hashlib.sha256(b"".join(out)).hexdigest()


EMPTY_EXTRAS_DIGEST = compute_extras_digest(None)
assert EMPTY_EXTRAS_DIGEST == "a1edc33c107616cf344faf0103daa025cfb125f8e1c784ae5f6a49faf2b768b6"


def build_staging_delta(
    prompt_ids: Sequence[int],
    generated_ids: Sequence[int],
    generated_logprobs: Sequence[float],
    prev_len: int,
) -> tuple[list[int], list[float], list[float]]:
    """Build ``(ids, mask, logprobs)`` of one call's delta (contract §5.4).

    :raises ValueError: ``prev_len`` outside ``[0, len(prompt_ids)]``, the
        generation columns differ in length, or the delta is empty.
    """
    if type(prev_len) is not int or prev_len < 0 or prev_len > len(prompt_ids):
        raise ValueError(f"prev_len {prev_len!r} is outside [0, {len(prompt_ids)}]")
    if len(generated_ids) != len(generated_logprobs):
        raise ValueError("generated ids and log-probabilities differ in length")
    carry = len(prompt_ids) - prev_len
    ids = list(prompt_ids[prev_len:])
    ids.extend(generated_ids)
    if not ids:
        raise ValueError("a staged delta must contain at least one token")
    mask = [0.0] * carry + [1.0] * len(generated_ids)
    logprobs = [0.0] * carry
    logprobs.extend(generated_logprobs)
    return ids, mask, logprobs
