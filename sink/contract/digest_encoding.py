"""The byte encodings the digests share (contract §4.2): u64, text, hex digests and token columns.

Token columns are encoded with :mod:`array`, :mod:`struct` and ``byteswap``
so that the per-token work runs in C, not in Python loops; the validation
that the contract requires (exact types, ranges, finiteness) is done with
map/count pipelines that also run in C.
"""

from __future__ import annotations

import math
import struct
import sys
from array import array
from collections.abc import Sequence
from typing import Final, TypeGuard

from sink.contract._packed import ids_from_marshal, pack_f32be

__all__ = (
    "U64",
    "U64_LIMIT",
    "decimal_u64",
    "encode_f32s",
    "encode_text",
    "encode_token_ids",
    "encode_u64",
    "hex_bytes",
    "is_digest_hex",
    "is_u64",
    "length_prefixed",
)

_BIG_ENDIAN: Final = sys.byteorder == "big"
#: A u64 big-endian (counts and lengths).
U64: Final = struct.Struct(">Q")
#: Every ``u64`` field (the lengths, ``weight_version``) holds an exact int in ``[0, U64_LIMIT)``.
U64_LIMIT: Final = 1 << 64
_U64_DIGITS: Final = len(str(U64_LIMIT - 1))


def _digest_bytes(value: object) -> bytes | None:
    """The 32 bytes of *value* if it is a ``str`` of exactly 64 lowercase hex digits, else ``None``."""
    if type(value) is not str or len(value) != 64:
        return None
    try:
        raw = bytes.fromhex(value)
    except ValueError:
        return None
    # fromhex also accepts upper case and whitespace; only the canonical spelling round-trips
    return raw if raw.hex() == value else None


def is_digest_hex(value: object) -> bool:
    """Return whether *value* is a ``str`` of exactly 64 lowercase hex digits."""
    return _digest_bytes(value) is not None


def is_u64(value: object) -> TypeGuard[int]:
    """Return whether *value* is an exact int (not a ``bool``) that a ``u64`` field carries: ``[0, 2**64)``."""
    return type(value) is int and 0 <= value < U64_LIMIT


def decimal_u64(text: str) -> int | None:
    """The int a plain ASCII decimal *text* spells when a ``u64`` carries it, else ``None`` (signs, spaces,
    underscores, other digits and more than 20 digits refused)."""
    if not text.isascii() or not text.isdigit() or len(text) > _U64_DIGITS:
        return None
    value = int(text)
    return value if is_u64(value) else None


def encode_u64(n: object) -> bytes:
    """``u64(n)``: an exact int in ``[0, 2**64)`` as 8 bytes big-endian.

    :raises ValueError: *n* is not an exact int or is out of range.
    """
    if type(n) is not int:
        raise ValueError(f"expected an int for a u64 field, got {type(n).__name__}")
    if not 0 <= n < U64_LIMIT:  # is_u64, its type check done just above
        raise ValueError(f"u64 field out of range: {n}")
    return U64.pack(n)


def encode_text(s: object) -> bytes:
    """``text(s)``: the UTF-8 length as u64, then the UTF-8 bytes.

    :raises TypeError: *s* is not a ``str``.
    """
    if type(s) is not str:
        raise TypeError(f"expected str, got {type(s).__name__}")
    raw = s.encode("utf-8")
    return U64.pack(len(raw)) + raw


def hex_bytes(h: object) -> bytes:
    """The 32 raw bytes of a 64-character lowercase hex digest.

    :raises ValueError: *h* is not such a digest.
    """
    raw = _digest_bytes(h)
    if raw is None:
        raise ValueError(f"not a 64-character lowercase hex digest: {h!r}")
    return raw


def length_prefixed(payload: bytes) -> bytes:
    """``lp(payload)``: its byte length as u64, then the payload."""
    return U64.pack(len(payload)) + payload


def encode_token_ids(token_ids: Sequence[int]) -> bytes:
    """Encode ``ids(seq)``: a u64 count, then each id as u64 big-endian.

    :raises ValueError: an id is not an exact ``int``, is negative or is
        ``>= 2**64``.
    """
    # Fast path: marshal proves a list of exact ints in [0, 2**31) and hands over their bytes.
    fast = ids_from_marshal(token_ids, with_le=False) if type(token_ids) is list else None
    if fast is not None:
        return U64.pack(len(token_ids)) + fast.be
    # list.count compares by identity first: one C pass, no set building
    if list(map(type, token_ids)).count(int) != len(token_ids):
        raise ValueError("token ids must be exact ints")
    try:
        packed = array("Q", token_ids)
    except OverflowError:
        raise ValueError("token ids must be in [0, 2**64)") from None
    if not _BIG_ENDIAN:
        packed.byteswap()
    return U64.pack(len(packed)) + packed.tobytes()


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
    return U64.pack(len(values)) + packed
