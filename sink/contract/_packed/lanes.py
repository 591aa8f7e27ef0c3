"""Whole-buffer primitives shared by the id and float columns: marshal lanes, repeated lanes, unpacking.

``marshal.dumps(values, 2)`` is the type gate: version 2 writes no
back-references, encodes an exact ``float`` as ``b"g"`` plus its eight
little-endian IEEE-754 bytes and an exact int below 2**31 as ``b"i"`` plus
four little-endian bytes, and refuses subclasses. So a blob of exactly
``5 + 9 * n`` bytes with ``b"g"`` at every ninth offset from 5 is an exact list
of ``n`` exact floats (parse it item by item: each ``g`` item is nine bytes,
which puts the next item on the next tag), and it hands us their float64
bytes. A full 9-byte lane pattern (tag included) can only match aligned,
because any 9-byte window that does not start on a tag contains the next tag.
"""

from __future__ import annotations

import functools
import marshal
import sys
from array import array
from collections.abc import Sequence
from typing import Any, Final, TypeAlias

__all__ = (
    "FLOAT_LANE",
    "HEAD",
    "INT_LANE",
    "LANE_NEG_ZERO",
    "LANE_ONE",
    "LANE_POS_ZERO",
    "NATIVE_LITTLE",
    "Buffers",
    "is_repeat",
    "marshal_list",
    "repeat_views",
    "unpack_list",
)

#: A column in pieces: hashed piece by piece, never concatenated.
Buffers: TypeAlias = Sequence[bytes | bytearray | memoryview]

NATIVE_LITTLE: Final = sys.byteorder == "little"

HEAD: Final = 5  # marshal list header: b"[" + int32 count
FLOAT_LANE: Final = 9  # b"g" + 8 bytes
INT_LANE: Final = 5  # b"i" + 4 bytes
LANE_POS_ZERO: Final = b"g" + bytes(8)
LANE_NEG_ZERO: Final = b"g" + bytes(7) + b"\x80"
LANE_ONE: Final = b"g" + bytes(6) + b"\xf0\x3f"
_CHUNK_LANES: Final = 4096


@functools.cache
def _chunk(lane: bytes) -> bytes:
    return lane * _CHUNK_LANES


def is_repeat(buf: bytes, start: int, count: int, lane: bytes) -> bool:
    """Whether ``buf[start:]`` begins with *lane* repeated *count* times, without building it."""
    chunk = _chunk(lane)
    end = start + len(lane) * count
    if end > len(buf):
        return False
    while end - start > len(chunk):
        if not buf.startswith(chunk, start):
            return False
        start += len(chunk)
    return buf.startswith(memoryview(chunk)[: end - start], start)


def repeat_views(lane: bytes, count: int) -> list[memoryview]:
    """*lane* repeated *count* times, as views of one cached chunk (for hashing)."""
    chunk = memoryview(_chunk(lane))
    full, rest = divmod(count, _CHUNK_LANES)
    views = [chunk] * full
    if rest:
        views.append(chunk[: rest * len(lane)])
    return views


def unpack_list(data: Buffers, typecode: str, *, big_endian: bool = False) -> list[Any]:
    """The values of packed pieces (little-endian unless *big_endian*) as one new list."""
    values = array(typecode)
    for piece in data:
        values.frombytes(piece)
    if big_endian == NATIVE_LITTLE:  # stored order differs from the host's
        values.byteswap()
    return values.tolist()


def marshal_list(values: object, lane: int, tag: bytes) -> bytes | None:
    """``marshal.dumps(values, 2)`` if *values* is a list whose items all use *tag* lanes."""
    if type(values) is not list:
        return None
    n = len(values)
    try:
        blob = marshal.dumps(values, 2)
    except ValueError:  # an item marshal refuses: a subclass, a numpy scalar, ...
        return None
    if len(blob) != HEAD + lane * n or blob[:1] != b"[" or blob[HEAD::lane] != tag * n:
        return None
    return blob
