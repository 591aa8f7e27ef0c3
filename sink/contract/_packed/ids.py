"""Packed token ids: the little-endian u32/u64 storage form and the u64 big-endian digest form."""

from __future__ import annotations

import functools
from array import array
from typing import Any, Final, NamedTuple

from sink.contract._packed.lanes import INT_LANE, NATIVE_LITTLE, marshal_list

__all__ = (
    "ID_TYPECODES",
    "MarshalledIds",
    "ids_from_marshal",
    "ids_u64be",
    "ids_u64be_plain",
    "is_token_id_list",
    "pack_ids",
)

_U32_TYPECODE: Final = next((code for code in "IL" if array(code).itemsize == 4), None)
#: ``array`` typecodes of the stored id widths (4: u32, 8: u64).
ID_TYPECODES: Final = {4: _U32_TYPECODE or "I", 8: "Q"}
_NON_NEGATIVE_TOP_BYTES: Final = bytes(range(0x80))


def pack_ids(token_ids: list[int]) -> tuple[int, bytes] | None:
    """``(4, u32 LE)`` when every id fits, else ``(8, u64 LE)``; ``None`` for a negative,
    too large or non-integer id."""
    packed: array[int] | None = None
    width = 4
    if _U32_TYPECODE is not None:
        try:
            packed = array(_U32_TYPECODE, token_ids)
        except (OverflowError, TypeError):
            packed = None
    if packed is None:
        width = 8
        try:
            packed = array("Q", token_ids)
        except (OverflowError, TypeError):
            return None
    if not NATIVE_LITTLE:
        packed.byteswap()
    return width, packed.tobytes()


@functools.cache
def _numpy() -> Any:
    """numpy if installed (an optional accelerator here), else ``None``."""
    try:
        import numpy
    except ImportError:
        return None
    return numpy


#: Below this many ids the plain path is as fast as numpy's call overhead.
_NUMPY_MIN_IDS: Final = 256


def ids_u64be(ids_le: bytes, width: int, length: int) -> bytes:
    """The digest form of packed ids: each id as u64 big-endian (numpy's cast when installed: ~5x faster)."""
    np = _numpy() if length >= _NUMPY_MIN_IDS else None
    if np is not None:
        wide: bytes = np.frombuffer(ids_le, dtype="<u4" if width == 4 else "<u8").astype(">u8").tobytes()
        return wide
    return ids_u64be_plain(ids_le, width, length)


def ids_u64be_plain(ids_le: bytes, width: int, length: int) -> bytes:
    """:func:`ids_u64be` without numpy."""
    if width == 4:
        out = bytearray(8 * length)
        out[7::8] = ids_le[0::4]
        out[6::8] = ids_le[1::4]
        out[5::8] = ids_le[2::4]
        out[4::8] = ids_le[3::4]
        return bytes(out)
    wide = array("Q")
    wide.frombytes(ids_le)
    wide.byteswap()  # reverses each element's bytes: LE -> BE on any host
    return wide.tobytes()


def _small_ids_blob(values: object) -> tuple[bytes, bytes] | None:
    """``(marshal blob, top byte of every id)`` of a list of exact ints in ``[0, 2**31)``, else ``None``."""
    blob = marshal_list(values, INT_LANE, b"i")
    if blob is None:
        return None
    top = blob[9::5]
    return None if top.translate(None, _NON_NEGATIVE_TOP_BYTES) else (blob, top)


def is_token_id_list(values: object) -> bool:
    """Fast, conservative check: *values* is a list of exact ints in ``[0, 2**31)``.

    ``False`` means "not proved" (the caller falls back to a precise check).
    """
    return _small_ids_blob(values) is not None


class MarshalledIds(NamedTuple):
    """The forms of a list of exact ints in ``[0, 2**31)`` read from its one ``marshal`` pass."""

    le: bytes
    """u32 little-endian (``b""`` when not asked for)."""
    be: bytearray
    """u64 big-endian: the digest form."""
    blob: bytes
    """``marshal.dumps(ids, 2)``, the pass both forms were read from (:mod:`worker.sequence_cache` keys a proof with
    its items)."""


def ids_from_marshal(token_ids: list[int], *, with_le: bool = True) -> MarshalledIds | None:
    """The packed forms of exact ints in ``[0, 2**31)``; ``None`` for anything else.

    With ``with_le=False`` only the u64 BE form is built (``le`` is ``b""``).
    """
    proved = _small_ids_blob(token_ids)
    if proved is None:
        return None
    blob, top = proved
    n = len(token_ids)
    le, be = bytearray(4 * n if with_le else 0), bytearray(8 * n)
    for k, byte_k in enumerate((blob[6::5], blob[7::5], blob[8::5], top)):
        if with_le:
            le[k::4] = byte_k
        be[7 - k :: 8] = byte_k
    return MarshalledIds(bytes(le), be, blob)
