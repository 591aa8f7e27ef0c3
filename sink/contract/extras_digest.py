"""The extras digest (contract §4.6): a typed, key-sorted encoding of an engine-native payload."""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Mapping
from typing import Any, Final

from sink.contract.digest_encoding import U64, encode_text
from sink.contract.record_schema import EXTRAS_DIGEST_VERSION

__all__ = ("EMPTY_EXTRAS_DIGEST", "EXTRAS_DIGEST_DOMAIN", "compute_extras_digest")

EXTRAS_DIGEST_DOMAIN: Final = b"nemo-gym-staging-extras-v1"

_I64: Final = struct.Struct(">q")
_F64: Final = struct.Struct(">d")
_INT64_MIN: Final = -(1 << 63)
_INT64_MAX: Final = (1 << 63) - 1


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
        out.append(b"S" + encode_text(value))
    elif kind is list:
        out.append(b"L" + U64.pack(len(value)))
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
    out.append(b"D" + U64.pack(len(value)))
    for raw, key in encoded_keys:
        out.append(U64.pack(len(raw)) + raw)
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


EMPTY_EXTRAS_DIGEST: Final = compute_extras_digest(None)
assert EMPTY_EXTRAS_DIGEST == "a1edc33c107616cf344faf0103daa025cfb125f8e1c784ae5f6a49faf2b768b6"
