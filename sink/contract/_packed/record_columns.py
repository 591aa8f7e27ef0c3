"""Whole-record column proofs: a staged call's three columns proved together (contract §3.3 rules 6-8, §4.3).

Built from the per-column primitives of :mod:`sink.contract._packed.ids` and :mod:`sink.contract._packed.floats` and under the
same soundness rule: each function proves its result exact or returns
``None``, and the caller then runs the reference path, which raises the
precise contract error. Four entry points, one per source of columns:

* :func:`pack_validated_columns`: columns of a validated record, packed again;
* :func:`trusted_components`: raw ``from_components`` lists (copied, then proved);
* :func:`prove_stored_columns`: the stored bytes of a record blob, lists never built;
* :func:`staging_delta_columns`: the worker's delta, built and proved in one pass.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

from sink.contract._packed.columns import PackedColumns, TrustedColumns
from sink.contract._packed.floats import (
    LanesZero,
    carry_log_probs_zero,
    carry_prefix,
    f32_exact_from_marshal,
    finite_f32le,
    finite_lanes,
    lanes_zero,
    mask_f32be,
    mask_from_marshal,
    pack_f32be,
    usual_mask_pieces,
)
from sink.contract._packed.ids import ids_from_marshal, pack_ids
from sink.contract._packed.lanes import FLOAT_LANE, HEAD, LANE_POS_ZERO, marshal_list

__all__ = ("pack_validated_columns", "prove_stored_columns", "staging_delta_columns", "trusted_components")


def _prove_floats(token_mask: list[float], log_probs: list[float], *, exactness: bool) -> PackedColumns | None:
    """Rules 7 and 8, exact finite floats, binary32 range: the float half of a :class:`PackedColumns`."""
    n = len(token_mask)
    if len(log_probs) != n:
        return None
    mask_blob = marshal_list(token_mask, FLOAT_LANE, b"g")
    mask = None if mask_blob is None else mask_from_marshal(mask_blob, n)
    lp_blob = marshal_list(log_probs, FLOAT_LANE, b"g")
    if mask is None or lp_blob is None or not finite_lanes(lp_blob[13::9]):
        return None
    codes, mask_be = mask
    lanes_zero = LanesZero(lp_blob, start=HEAD, stride=FLOAT_LANE, sign_offset=8, zero_lane=LANE_POS_ZERO)
    if not carry_log_probs_zero(codes, log_probs, lanes_zero):
        return None
    lp_f32be = pack_f32be(log_probs)
    if lp_f32be is None:
        return None
    exact = None
    if exactness:
        carry = carry_prefix(codes)  # carry lanes are proved zeros: skip them
        exact = f32_exact_from_marshal(lp_blob, n, carry or 0)
    return PackedColumns(length=n, mask_codes=codes, mask_f32be=mask_be, lp_f32be=lp_f32be, lp_f32_exact=exact)


def prove_stored_columns(
    ids_le: bytes, ids_width: int, mask_codes: bytes, lp_le: bytes, lp_width: int
) -> PackedColumns | None:
    """Prove rules 6-8 and the column pre-checks of §4.3 on a stored record's column bytes, lists never built.

    The caller has checked the sizes (``width * length`` bytes each) and that every mask code is in
    :data:`~sink.contract._packed.floats.MASK_CODES`. Ids are unsigned by storage (rule 6 and the u64 range hold). Proved here, or
    ``None``: float32 log-probabilities (``lp_width`` 4; the float64 form is rare and goes to the
    reference path), all finite, and the masks carry zeros followed by ones with every carry
    log-probability ``+0.0`` or ``-0.0``.
    """
    length = len(mask_codes)
    if lp_width != 4 or not finite_f32le(lp_le):
        return None
    lp = array("f")
    lp.frombytes(lp_le)
    lp.byteswap()  # reverses each element's bytes: LE -> BE on any host
    columns = PackedColumns(
        length=length,
        ids_width=ids_width,
        ids_le=ids_le,
        mask_codes=mask_codes,
        lp_f32be=lp.tobytes(),
        lp_f32_exact=True,
    )
    carry = columns.carry_length()  # kept by the columns for verification and as_numpy
    if carry is None:
        return None
    if carry and not lanes_zero(lp_le, 0, lanes=carry, stride=4, sign_offset=3, zero_lane=bytes(4)):
        return None
    usual = columns.usual_carry_length() is not None
    columns.mask_f32be = usual_mask_pieces(carry, length - carry) if usual else (mask_f32be(mask_codes),)
    return columns


def pack_validated_columns(
    token_ids: list[int], token_mask: list[float], log_probs: list[float]
) -> PackedColumns | None:
    """Pack three columns of exact types and prove rules 6-8 and the column pre-checks of §4.3.

    ``None`` when any of them fails or cannot be proved cheaply.
    """
    if len(token_ids) != len(token_mask):
        return None
    packed = _prove_floats(token_mask, log_probs, exactness=False)
    ids = None if packed is None else pack_ids(token_ids)
    return None if packed is None or ids is None else packed.with_ids(*ids)


def trusted_components(token_ids: object, token_mask: object, log_probs: object) -> TrustedColumns | None:
    """Private copies of raw ``from_components`` columns plus everything proved about them.

    ``None`` unless the float columns are lists of exact, finite floats of
    equal length that satisfy rules 7 and 8 and fit binary32; the caller then
    applies the contract's type gate and the reference path. The ids are
    vouched for (and packed) only when they are exact ints in ``[0, 2**31)``;
    otherwise ``token_ids`` is ``None`` and ordinary validation handles them.
    """
    if type(token_mask) is not list or type(log_probs) is not list:
        return None
    mask_copy: list[float] = list(token_mask)
    lp_copy: list[float] = list(log_probs)
    packed = _prove_floats(mask_copy, lp_copy, exactness=True)
    if packed is None:
        return None
    ids_copy: list[int] | None = list(token_ids) if type(token_ids) is list else None
    ids = None if ids_copy is None or len(ids_copy) != packed.length else ids_from_marshal(ids_copy)
    if ids is None:
        return TrustedColumns(packed, mask_copy, lp_copy, None)
    packed.ids_width, packed.ids_le, packed.ids_u64be = 4, ids.le, (ids.be,)
    return TrustedColumns(packed, mask_copy, lp_copy, ids_copy, ids.blob)


def staging_delta_columns(
    prompt_tail: Sequence[int], generated_ids: Sequence[int], generated_log_probs: object
) -> TrustedColumns | None:
    """A call's delta (contract §5.4) built and proved in one go, for the worker's trusted record build.

    The build is :meth:`sink.contract.packed_record.PackedCallRecord.from_trusted_columns`. The delta's
    ids ``prompt_tail + generated_ids``; masks ``0.0`` per carried id then ``1.0`` per generated one;
    log-probabilities ``0.0`` per carried id then *generated_log_probs*. The three lists are new and owned
    by the result. The masks and the carry zeros are exact by construction, so only the generated
    log-probabilities are proved (exact finite floats within binary32) and the ids packed (exact ints in
    ``[0, 2**31)``, their digest form kept in ``packed.ids_u64be``). ``None`` when anything is not proved,
    or the delta is empty or the generation columns differ in length: the caller then builds the delta
    the reference way (:func:`sink.contract.digest.build_staging_delta` and ``from_components``), which raises the
    precise error or accepts values this path does not prove (ids beyond ``2**31``).
    """
    carry, generated = len(prompt_tail), len(generated_ids)
    if type(generated_log_probs) is not list or len(generated_log_probs) != generated or carry + generated == 0:
        return None
    lp_blob = marshal_list(generated_log_probs, FLOAT_LANE, b"g")
    if lp_blob is None or not finite_lanes(lp_blob[13::9]):
        return None
    generated_f32be = pack_f32be(generated_log_probs)
    token_ids = [*prompt_tail, *generated_ids]
    ids = ids_from_marshal(token_ids)
    if generated_f32be is None or ids is None:
        return None
    packed = PackedColumns(
        length=carry + generated,
        ids_width=4,
        ids_le=ids.le,
        ids_u64be=(bytes(ids.be),),
        mask_codes=b"\x00" * carry + b"\x3f" * generated,
        mask_f32be=usual_mask_pieces(carry, generated),
        lp_f32be=bytes(4 * carry) + generated_f32be,
        lp_f32_exact=f32_exact_from_marshal(lp_blob, generated, 0),
    )
    mask = [0.0] * carry + [1.0] * generated
    log_probs = [0.0] * carry + generated_log_probs
    return TrustedColumns(packed, mask, log_probs, token_ids, ids.blob)
