"""Packed mask and log-probability columns: codes, float32 big-endian digest forms, rules 7 and 8.

Under the soundness rule of :mod:`sink.contract._packed.columns`: each proof is exact
or answers "not proved" (``None`` / ``False``).
"""

from __future__ import annotations

import itertools
import struct
from array import array
from collections.abc import Sequence
from typing import Final

from sink.contract._packed.lanes import (
    FLOAT_LANE,
    HEAD,
    LANE_NEG_ZERO,
    LANE_ONE,
    LANE_POS_ZERO,
    NATIVE_LITTLE,
    Buffers,
    is_repeat,
    marshal_list,
    repeat_views,
)

__all__ = (
    "MASK_CODES",
    "LanesZero",
    "carry_log_probs_zero",
    "carry_log_probs_zero_plain",
    "carry_prefix",
    "f32_exact",
    "f32_exact_from_marshal",
    "finite_f32le",
    "finite_lanes",
    "lanes_zero",
    "mask_f32be",
    "mask_from_marshal",
    "mask_pieces",
    "mask_values_from_codes",
    "pack_f32be",
    "usual_mask_carry",
    "usual_mask_pieces",
)

#: One byte per mask value: the leading byte of its big-endian float32.
MASK_CODES: Final = b"\x00\x80\x3f"
_ONE_CODE: Final = 0x3F
_ONE: Final = bytes((_ONE_CODE,))
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


def usual_mask_pieces(carry: int, generated: int) -> Buffers:
    """The float32 big-endian mask of *carry* ``+0.0`` then *generated* ``1.0``, as views (no copy)."""
    return [*repeat_views(bytes(4), carry), *repeat_views(_F32BE_ONE, generated)]


# --- masks ---------------------------------------------------------------------


def mask_f32be(codes: bytes) -> bytes:
    """The digest form of a mask column (float32 big-endian) from its codes."""
    out = bytearray(4 * len(codes))
    out[0::4] = codes
    out[1::4] = codes.translate(_F32_BYTE1_OF_CODE)
    return bytes(out)


def mask_pieces(codes: bytes, carry: int | None) -> Buffers:
    """:func:`mask_f32be` in pieces, given ``carry_prefix(codes)``; the usual shape (+0.0 carry, then 1.0)
    costs no copy."""
    if carry is not None and is_repeat(codes, 0, carry, b"\x00"):
        return usual_mask_pieces(carry, len(codes) - carry)
    return (mask_f32be(codes),)


def carry_prefix(codes: bytes) -> int | None:
    """Length of the carry (mask 0.0/-0.0) prefix when the generated tokens form the rest, else ``None``.

    The prefix ends at the first generated code and everything from there must be generated: one ``find``
    and one comparison, no pass counting the codes.
    """
    carry = codes.find(_ONE_CODE)
    if carry < 0:
        return len(codes)
    return carry if is_repeat(codes, carry, len(codes) - carry, _ONE) else None


def usual_mask_carry(codes: bytes) -> int | None:
    """The carry length when *codes* are the usual shape (``+0.0`` carry, then ``1.0``), else ``None``."""
    carry = carry_prefix(codes)
    return carry if carry is not None and is_repeat(codes, 0, carry, b"\x00") else None


def mask_values_from_codes(codes: bytes) -> list[float]:
    """Mask floats (0.0, -0.0, 1.0) from codes that are all in :data:`MASK_CODES`."""
    carry = usual_mask_carry(codes)
    if carry is not None:
        return [0.0] * carry + [1.0] * (len(codes) - carry)  # the usual shape
    f32 = array("f")
    f32.frombytes(mask_f32be(codes))
    if NATIVE_LITTLE:
        f32.byteswap()
    return f32.tolist()


def mask_from_marshal(blob: bytes, n: int) -> tuple[bytes, Buffers] | None:
    """``(codes, f32 BE pieces)`` of a marshalled float list whose values are all exactly 0.0, -0.0 or 1.0."""
    first_one = blob.find(LANE_ONE, HEAD)
    carry = n if first_one < 0 else (first_one - HEAD) // FLOAT_LANE
    split = HEAD + FLOAT_LANE * carry
    if is_repeat(blob, HEAD, carry, LANE_POS_ZERO) and is_repeat(blob, split, n - carry, LANE_ONE):
        # the usual shape: +0.0 carry, then generated
        pieces = usual_mask_pieces(carry, n - carry)
        return b"\x00" * carry + b"\x3f" * (n - carry), pieces
    codes = blob[13::9]  # byte 7 of every float64 lane
    if codes.translate(None, MASK_CODES):
        return None
    expected = bytearray(len(blob))
    expected[:HEAD] = blob[:HEAD]
    expected[HEAD::FLOAT_LANE] = b"g" * n
    expected[12::9] = codes.translate(_F64_BYTE6_OF_CODE)
    expected[13::9] = codes
    if expected != blob:
        return None
    return codes, (mask_f32be(codes),)


# --- log-probabilities ---------------------------------------------------------


def pack_f32be(values: Sequence[float]) -> bytes | None:
    try:
        return struct.pack(f">{len(values)}f", *values)
    except (OverflowError, struct.error):  # beyond binary32 (contract §4.2) or not a float
        return None


def finite_f32le(buf: bytes) -> bool:
    """Whether every little-endian float32 of *buf* (a whole number of them) is finite: exact, in one C pass
    (numpy, a dependency, imported on first use like the rest of this package's accelerators)."""
    import numpy as np

    values = np.frombuffer(buf, dtype="<f4")
    return int(np.count_nonzero(np.isfinite(values))) == values.size  # a plain count: cheaper than .all()


def finite_lanes(top_bytes: bytes) -> bool:
    """Whether no lane's exponent field is all ones, given each lane's sign+exponent top byte.

    Conservative: finite values of magnitude >= 2**127 (float32) or 2**1008
    (float64) fail too.
    """
    return top_bytes.count(0x7F) == 0 and top_bytes.count(0xFF) == 0


def lanes_zero(buf: bytes, start: int, *, lanes: int, stride: int, sign_offset: int, zero_lane: bytes) -> bool:
    """Whether the *lanes* floats from *start* (a lane boundary) are all +0.0 or -0.0."""
    if is_repeat(buf, start, lanes, zero_lane):
        return True
    region = buf[start : start + stride * lanes]
    signs = region[sign_offset::stride]
    if signs.translate(None, _ZERO_SIGNS):
        return False
    expected = bytearray(zero_lane * lanes)
    expected[sign_offset::stride] = signs
    return expected == region


def carry_log_probs_zero(codes: bytes, log_probs: list[float], carry_lanes_zero: LanesZero) -> bool:
    """Rule 8 (carry log-probability == 0.0), with the semantics of :func:`sink.contract.digest.check_mask_values`."""
    carry = carry_prefix(codes)
    if carry is not None:
        return carry == 0 or carry_lanes_zero(carry)
    return set(itertools.compress(log_probs, codes.translate(_CARRY_OF_CODE))) <= {0.0}


class LanesZero:
    """``lanes -> bool``: are the first *lanes* floats of a packed buffer all zeros."""

    __slots__ = ("buf", "sign_offset", "start", "stride", "zero_lane")

    def __init__(self, buf: bytes, *, start: int, stride: int, sign_offset: int, zero_lane: bytes) -> None:
        self.buf, self.start, self.stride, self.sign_offset, self.zero_lane = buf, start, stride, sign_offset, zero_lane

    def __call__(self, lanes: int) -> bool:
        return lanes_zero(
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
    return carry_log_probs_zero(
        codes, log_probs, LanesZero(lp_le, start=0, stride=width, sign_offset=width - 1, zero_lane=zero_lane)
    )


def f32_exact_from_marshal(blob: bytes, n: int, first_lane: int) -> bool:
    """Whether marshalled float64 lanes ``first_lane..n-1`` equal their float32 rounding.

    Conservative: may say ``False`` for float32 subnormals and extreme exponents.
    """
    start = HEAD + FLOAT_LANE * first_lane
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
    return unsafe_exponents == tail.count(LANE_POS_ZERO) + tail.count(LANE_NEG_ZERO)


def f32_exact(values: list[float]) -> bool:
    """Whether every value of an exact-float list round-trips exactly through float32 (conservative)."""
    blob = marshal_list(values, FLOAT_LANE, b"g")
    return blob is not None and f32_exact_from_marshal(blob, len(values), 0)
