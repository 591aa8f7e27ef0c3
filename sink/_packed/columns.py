"""Packed token columns: the byte forms the call digest and the codec share.

A staged call's three token columns exist as Python lists (the wire model)
and as packed bytes: the big-endian forms the call digest hashes (contract
§4.3) and the little-endian forms the msgpack codec stores (architecture §5).
At 16k tokens a per-element Python loop costs far more than hashing, so every
function here works on whole buffers in C: ``marshal``, ``struct``,
``array`` and bytes slicing, ``translate``, ``find`` and comparison. This
module holds the containers and the per-column primitives;
:mod:`sink._packed.record_columns` proves a record's three columns together.

Soundness rule: a function either proves its result exact or returns
``None``; the caller then runs the reference path of :mod:`sink.digest`,
which raises the precise contract error (or, when the fast path was merely
conservative, computes the same digest slowly). A mistake here may only ever
cost speed, never accept a value the reference path rejects.

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
import itertools
import marshal
import struct
import sys
from array import array
from collections.abc import Sequence
from typing import Any, Final, TypeAlias

#: A column in pieces: hashed piece by piece, never concatenated.
Buffers: TypeAlias = Sequence[bytes | bytearray | memoryview]

__all__ = (
    "ID_TYPECODES",
    "MASK_CODES",
    "Buffers",
    "ColumnCache",
    "PackedColumns",
    "TrustedColumns",
    "carry_log_probs_zero_plain",
    "f32_exact",
    "finite_lanes",
    "ids_u64be",
    "ids_u64be_plain",
    "is_token_id_list",
    "mask_f32be",
    "mask_values_from_codes",
    "pack_ids",
    "unpack_list",
)

_NATIVE_LITTLE: Final = sys.byteorder == "little"
_U32_TYPECODE: Final = next((code for code in "IL" if array(code).itemsize == 4), None)
#: ``array`` typecodes of the stored id widths (4: u32, 8: u64).
ID_TYPECODES: Final = {4: _U32_TYPECODE or "I", 8: "Q"}

#: One byte per mask value: the leading byte of its big-endian float32.
MASK_CODES: Final = b"\x00\x80\x3f"
_ONE_CODE: Final = 0x3F
_ZERO_SIGNS: Final = b"\x00\x80"
_F32BE_ONE: Final = b"\x3f\x80\x00\x00"


def _table(rule: dict[int, int]) -> bytes:
    return bytes(rule.get(byte, 0) for byte in range(256))


# mask code -> byte 1 of the big-endian float32 / byte 6 of the little-endian float64
_F32_BYTE1_OF_CODE: Final = _table({_ONE_CODE: 0x80})
_F64_BYTE6_OF_CODE: Final = _table({_ONE_CODE: 0xF0})
# mask code -> 1 for a carry token (mask 0.0 or -0.0), 0 for a generated one
_CARRY_OF_CODE: Final = _table({0x00: 1, 0x80: 1})
# float64 top bytes (sign + exponent bits 10-4) whose value, if its low 29 mantissa
# bits are zero, is certainly a float32 normal: exponent in [912, 1135], i.e.
# |v| in [2**-111, 2**113). Other exponents are treated as not float32-exact
# unless the value is a zero (conservative: float64 gets stored).
_F32_SAFE_TOP_BYTES: Final = bytes(b for b in range(256) if 57 <= (b & 0x7F) <= 70)
_LOW5_CLEAR_BYTES: Final = bytes(b for b in range(256) if b & 0x1F == 0)
_NON_NEGATIVE_TOP_BYTES: Final = bytes(range(0x80))

_HEAD: Final = 5  # marshal list header: b"[" + int32 count
_FLOAT_LANE: Final = 9  # b"g" + 8 bytes
_INT_LANE: Final = 5  # b"i" + 4 bytes
_LANE_POS_ZERO: Final = b"g" + bytes(8)
_LANE_NEG_ZERO: Final = b"g" + bytes(7) + b"\x80"
_LANE_ONE: Final = b"g" + bytes(6) + b"\xf0\x3f"
_CHUNK_LANES: Final = 4096


@functools.cache
def _chunk(lane: bytes) -> bytes:
    return lane * _CHUNK_LANES


def _is_repeat(buf: bytes, start: int, count: int, lane: bytes) -> bool:
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


def unpack_list(data: Buffers, typecode: str, *, big_endian: bool = False) -> list[Any]:
    """The values of packed pieces (little-endian unless *big_endian*) as one new list."""
    values = array(typecode)
    for piece in data:
        values.frombytes(piece)
    if big_endian == _NATIVE_LITTLE:  # stored order differs from the host's
        values.byteswap()
    return values.tolist()


def _usual_mask_pieces(carry: int, generated: int) -> Buffers:
    """The float32 big-endian mask of *carry* ``+0.0`` then *generated* ``1.0``, as views (no copy)."""
    return [*_repeat_views(bytes(4), carry), *_repeat_views(_F32BE_ONE, generated)]


def _repeat_views(lane: bytes, count: int) -> list[memoryview]:
    """*lane* repeated *count* times, as views of one cached chunk (for hashing)."""
    chunk = memoryview(_chunk(lane))
    full, rest = divmod(count, _CHUNK_LANES)
    views = [chunk] * full
    if rest:
        views.append(chunk[: rest * len(lane)])
    return views


class PackedColumns:
    """Packed forms of one record's validated columns.

    Storage forms (kept): ``ids_le`` (u32 LE when ``ids_width == 4``, else u64
    LE), ``mask_codes`` (one :data:`MASK_CODES` byte per token), ``lp_f32be``
    (log-probabilities as the digest hashes them) and ``lp_f32_exact`` (every
    log-probability round-trips through float32; ``None``: not known yet).
    Digest forms ``ids_u64be`` / ``mask_f32be`` are transient: set when they
    come for free, released once the digest is computed.
    """

    __slots__ = ("ids_le", "ids_u64be", "ids_width", "length", "lp_f32_exact", "lp_f32be", "mask_codes", "mask_f32be")

    def __init__(
        self,
        *,
        length: int,
        mask_codes: bytes,
        lp_f32be: bytes,
        lp_f32_exact: bool | None,
        ids_width: int = 0,
        ids_le: bytes = b"",
        ids_u64be: Buffers | None = None,
        mask_f32be: Buffers | None = None,
    ) -> None:
        self.length = length
        self.ids_width = ids_width
        self.ids_le = ids_le
        self.ids_u64be = ids_u64be
        self.mask_codes = mask_codes
        self.mask_f32be = mask_f32be
        self.lp_f32be = lp_f32be
        self.lp_f32_exact = lp_f32_exact

    def with_ids(self, ids_width: int, ids_le: bytes) -> PackedColumns:
        """A copy holding these packed ids (digest form derived on demand)."""
        return PackedColumns(
            length=self.length,
            mask_codes=self.mask_codes,
            lp_f32be=self.lp_f32be,
            lp_f32_exact=self.lp_f32_exact,
            ids_width=ids_width,
            ids_le=ids_le,
            mask_f32be=self.mask_f32be,
        )

    def token_ids_list(self) -> list[int]:
        """The ids as a new list of Python ints."""
        ids: list[int] = unpack_list((self.ids_le,), ID_TYPECODES[self.ids_width])
        return ids

    def token_mask_list(self) -> list[float]:
        """The mask as a new list of floats (0.0, -0.0, 1.0)."""
        return mask_values_from_codes(self.mask_codes)

    def log_probs_list(self) -> list[float]:
        """The log-probabilities as a new list of floats (their float32 values)."""
        log_probs: list[float] = unpack_list((self.lp_f32be,), "f", big_endian=True)
        return log_probs

    def digest_forms(self) -> tuple[Buffers, Buffers, Buffers]:
        """``(ids u64 BE, mask f32 BE, log-probs f32 BE)`` in pieces; releases the transient forms."""
        ids = self.ids_u64be
        if ids is None:
            ids = (ids_u64be(self.ids_le, self.ids_width, self.length),)
        mask = self.mask_f32be if self.mask_f32be is not None else (mask_f32be(self.mask_codes),)
        self.ids_u64be = self.mask_f32be = None
        return ids, mask, (self.lp_f32be,)


class TrustedColumns:
    """Column lists this package built and owns, with what it proved about them.

    Built only here and by :mod:`sink.codec`, from fresh copies or freshly
    decoded lists. Placed in the validation context, it lets the record
    validators skip per-element validation of exactly these list objects
    (identity is checked) and reuse ``packed``. It guarantees: the float lists
    hold exact, finite ``float`` objects; ``token_ids`` (when not ``None``)
    holds exact ints in ``[0, 2**64)`` and ``packed`` holds them; the mask
    codes are those of ``token_mask``; rules 7 and 8 hold; ``packed.lp_f32be``
    packs ``log_probs``.
    """

    __slots__ = ("log_probs", "packed", "token_ids", "token_mask")

    def __init__(
        self, packed: PackedColumns, token_mask: list[float], log_probs: list[float], token_ids: list[int] | None
    ) -> None:
        self.packed = packed
        self.token_ids = token_ids
        self.token_mask = token_mask
        self.log_probs = log_probs

    def vouches_for(self, field_name: str | None, value: object) -> bool:
        """Whether *value* is the very list object this instance holds for that record field."""
        if field_name == "token_mask_delta":
            return value is self.token_mask
        if field_name == "generation_log_probs_delta":
            return value is self.log_probs
        return field_name == "token_ids_delta" and self.token_ids is not None and value is self.token_ids


class ColumnCache:
    """Storage forms of a validated record's columns plus the list objects they describe.

    A private attribute of the record, not part of its value: it compares
    equal to any other cache and to ``None``, so pydantic's ``==`` (which
    compares private attributes) is unaffected.
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


# --- ids -----------------------------------------------------------------------


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
    if not _NATIVE_LITTLE:
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


def _marshal_list(values: object, lane: int, tag: bytes) -> bytes | None:
    """``marshal.dumps(values, 2)`` if *values* is a list whose items all use *tag* lanes."""
    if type(values) is not list:
        return None
    n = len(values)
    try:
        blob = marshal.dumps(values, 2)
    except ValueError:  # an item marshal refuses: a subclass, a numpy scalar, ...
        return None
    if len(blob) != _HEAD + lane * n or blob[:1] != b"[" or blob[_HEAD::lane] != tag * n:
        return None
    return blob


def _small_ids_blob(values: object) -> tuple[bytes, bytes] | None:
    """``(marshal blob, top byte of every id)`` of a list of exact ints in ``[0, 2**31)``, else ``None``."""
    blob = _marshal_list(values, _INT_LANE, b"i")
    if blob is None:
        return None
    top = blob[9::5]
    return None if top.translate(None, _NON_NEGATIVE_TOP_BYTES) else (blob, top)


def is_token_id_list(values: object) -> bool:
    """Fast, conservative check: *values* is a list of exact ints in ``[0, 2**31)``.

    ``False`` means "not proved" (the caller falls back to a precise check).
    """
    return _small_ids_blob(values) is not None


def _ids_from_marshal(token_ids: list[int], *, with_le: bool = True) -> tuple[bytes, bytearray] | None:
    """``(u32 LE, u64 BE)`` of exact ints in ``[0, 2**31)``; ``None`` for anything else.

    With ``with_le=False`` only the u64 BE form is built (the first item is ``b""``).
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
    return bytes(le), be


# --- masks ---------------------------------------------------------------------


def mask_f32be(codes: bytes) -> bytes:
    """The digest form of a mask column (float32 big-endian) from its codes."""
    out = bytearray(4 * len(codes))
    out[0::4] = codes
    out[1::4] = codes.translate(_F32_BYTE1_OF_CODE)
    return bytes(out)


def _mask_pieces(codes: bytes, carry: int | None) -> Buffers:
    """:func:`mask_f32be` in pieces, given ``_carry_prefix(codes)``; the usual shape (+0.0 carry, then 1.0)
    costs no copy."""
    if carry is not None and codes.count(0) == carry:
        return _usual_mask_pieces(carry, len(codes) - carry)
    return (mask_f32be(codes),)


def _carry_prefix(codes: bytes) -> int | None:
    """Length of the carry (mask 0.0/-0.0) prefix when the generated tokens form the rest, else ``None``."""
    carry = len(codes) - codes.count(_ONE_CODE)
    if carry == len(codes) or codes.find(_ONE_CODE) == carry:
        return carry
    return None


def mask_values_from_codes(codes: bytes) -> list[float]:
    """Mask floats (0.0, -0.0, 1.0) from codes that are all in :data:`MASK_CODES`."""
    carry = _carry_prefix(codes)
    if carry is not None and codes.count(0) == carry:
        return [0.0] * carry + [1.0] * (len(codes) - carry)  # the usual shape
    f32 = array("f")
    f32.frombytes(mask_f32be(codes))
    if _NATIVE_LITTLE:
        f32.byteswap()
    return f32.tolist()


def _mask_from_marshal(blob: bytes, n: int) -> tuple[bytes, Buffers] | None:
    """``(codes, f32 BE pieces)`` of a marshalled float list whose values are all exactly 0.0, -0.0 or 1.0."""
    first_one = blob.find(_LANE_ONE, _HEAD)
    carry = n if first_one < 0 else (first_one - _HEAD) // _FLOAT_LANE
    split = _HEAD + _FLOAT_LANE * carry
    if _is_repeat(blob, _HEAD, carry, _LANE_POS_ZERO) and _is_repeat(blob, split, n - carry, _LANE_ONE):
        # the usual shape: +0.0 carry, then generated
        pieces = _usual_mask_pieces(carry, n - carry)
        return b"\x00" * carry + b"\x3f" * (n - carry), pieces
    codes = blob[13::9]  # byte 7 of every float64 lane
    if codes.translate(None, MASK_CODES):
        return None
    expected = bytearray(len(blob))
    expected[:_HEAD] = blob[:_HEAD]
    expected[_HEAD::_FLOAT_LANE] = b"g" * n
    expected[12::9] = codes.translate(_F64_BYTE6_OF_CODE)
    expected[13::9] = codes
    if expected != blob:
        return None
    return codes, (mask_f32be(codes),)


# --- log-probabilities ---------------------------------------------------------


def _pack_f32be(values: Sequence[float]) -> bytes | None:
    try:
        return struct.pack(f">{len(values)}f", *values)
    except (OverflowError, struct.error):  # beyond binary32 (contract §4.2) or not a float
        return None


def finite_lanes(top_bytes: bytes) -> bool:
    """Whether no lane's exponent field is all ones, given each lane's sign+exponent top byte.

    Conservative: finite values of magnitude >= 2**127 (float32) or 2**1008
    (float64) fail too.
    """
    return top_bytes.count(0x7F) == 0 and top_bytes.count(0xFF) == 0


def _lanes_zero(buf: bytes, start: int, *, lanes: int, stride: int, sign_offset: int, zero_lane: bytes) -> bool:
    """Whether the *lanes* floats from *start* (a lane boundary) are all +0.0 or -0.0."""
    if _is_repeat(buf, start, lanes, zero_lane):
        return True
    region = buf[start : start + stride * lanes]
    signs = region[sign_offset::stride]
    if signs.translate(None, _ZERO_SIGNS):
        return False
    expected = bytearray(zero_lane * lanes)
    expected[sign_offset::stride] = signs
    return expected == region


def _carry_log_probs_zero(codes: bytes, log_probs: list[float], carry_lanes_zero: _LanesZero) -> bool:
    """Rule 8 (carry log-probability == 0.0), with the semantics of :func:`sink.digest.check_mask_values`."""
    carry = _carry_prefix(codes)
    if carry is not None:
        return carry == 0 or carry_lanes_zero(carry)
    return set(itertools.compress(log_probs, codes.translate(_CARRY_OF_CODE))) <= {0.0}


class _LanesZero:
    """``lanes -> bool``: are the first *lanes* floats of a packed buffer all zeros."""

    __slots__ = ("buf", "sign_offset", "start", "stride", "zero_lane")

    def __init__(self, buf: bytes, *, start: int, stride: int, sign_offset: int, zero_lane: bytes) -> None:
        self.buf, self.start, self.stride, self.sign_offset, self.zero_lane = buf, start, stride, sign_offset, zero_lane

    def __call__(self, lanes: int) -> bool:
        return _lanes_zero(
            self.buf,
            self.start,
            lanes=lanes,
            stride=self.stride,
            sign_offset=self.sign_offset,
            zero_lane=self.zero_lane,
        )


def carry_log_probs_zero_plain(codes: bytes, log_probs: list[float], lp_le: bytes, width: int) -> bool:
    """Rule 8 over a plain little-endian float32 (*width* 4) or float64 (8) buffer."""
    zero_lane = bytes(width)
    return _carry_log_probs_zero(
        codes, log_probs, _LanesZero(lp_le, start=0, stride=width, sign_offset=width - 1, zero_lane=zero_lane)
    )


def _f32_exact_from_marshal(blob: bytes, n: int, first_lane: int) -> bool:
    """Whether marshalled float64 lanes ``first_lane..n-1`` equal their float32 rounding.

    Conservative: may say ``False`` for float32 subnormals and extreme exponents.
    """
    start = _HEAD + _FLOAT_LANE * first_lane
    zeros = bytes(n - first_lane)
    # the low 29 mantissa bits are bytes 0-2 and the low five bits of byte 3
    if blob[start + 1 :: 9] != zeros or blob[start + 2 :: 9] != zeros or blob[start + 3 :: 9] != zeros:
        return False
    if blob[start + 4 :: 9].translate(None, _LOW5_CLEAR_BYTES):
        return False
    unsafe_exponents = len(blob[start + 8 :: 9].translate(None, _F32_SAFE_TOP_BYTES))
    if unsafe_exponents == 0:
        return True
    # zeros have an unsafe exponent field yet are exact; no other such lane is
    tail = blob[start:]
    return unsafe_exponents == tail.count(_LANE_POS_ZERO) + tail.count(_LANE_NEG_ZERO)


def f32_exact(values: list[float]) -> bool:
    """Whether every value of an exact-float list round-trips exactly through float32 (conservative)."""
    blob = _marshal_list(values, _FLOAT_LANE, b"g")
    return blob is not None and _f32_exact_from_marshal(blob, len(values), 0)
