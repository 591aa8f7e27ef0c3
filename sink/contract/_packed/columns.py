"""Packed token columns: the byte forms the call digest and the codec share.

A staged call's three token columns exist as Python lists (the wire model)
and as packed bytes: the big-endian forms the call digest hashes (contract
§4.3) and the little-endian forms the msgpack codec stores (contract §11.4).
At 16k tokens a per-element Python loop costs far more than hashing, so every
function here works on whole buffers in C: ``marshal``, ``struct``,
``array`` and bytes slicing, ``translate``, ``find`` and comparison. This
module holds the containers; :mod:`sink.contract._packed.lanes` (shared buffer
primitives), :mod:`sink.contract._packed.ids` and :mod:`sink.contract._packed.floats` the
per-column primitives; :mod:`sink.contract._packed.record_columns` proves a record's
three columns together.

Soundness rule: a function either proves its result exact or returns
``None``; the caller then runs the reference path of :mod:`sink.contract.digest`,
which raises the precise contract error (or, when the fast path was merely
conservative, computes the same digest slowly). A mistake here may only ever
cost speed, never accept a value the reference path rejects.
"""

from __future__ import annotations

from sink.contract._packed.floats import carry_prefix, mask_f32be, mask_values_from_codes
from sink.contract._packed.ids import ID_TYPECODES, ids_u64be
from sink.contract._packed.lanes import Buffers, is_repeat, unpack_list

__all__ = ("PackedColumns", "TrustedColumns")


class PackedColumns:
    """Packed forms of one record's validated columns.

    Storage forms (kept): ``ids_le`` (u32 LE when ``ids_width == 4``, else u64
    LE), ``mask_codes`` (one :data:`MASK_CODES` byte per token), ``lp_f32be``
    (log-probabilities as the digest hashes them) and ``lp_f32_exact`` (every
    log-probability round-trips through float32; ``None``: not known yet).
    Digest forms ``ids_u64be`` / ``mask_f32be`` are transient: set when they
    come for free, released once the digest is computed. The shape of the mask
    (:meth:`carry_length`, :meth:`usual_carry_length`) is worked out once per
    ``mask_codes`` object: decoding, verification and ``as_numpy`` all ask for it.
    """

    __slots__ = (
        "_mask_shape",
        "ids_le",
        "ids_u64be",
        "ids_width",
        "length",
        "lp_f32_exact",
        "lp_f32be",
        "mask_codes",
        "mask_f32be",
    )

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
        # (the codes it describes, carry_prefix of them, whether that carry is all +0.0)
        self._mask_shape: tuple[bytes, int | None, bool] | None = None

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

    def carry_length(self) -> int | None:
        """How many carry codes (mask 0.0 or -0.0) lead when every code after them is generated (1.0), else
        ``None`` (the masks are not carry then generation)."""
        return self._shape()[1]

    def usual_carry_length(self) -> int | None:
        """:meth:`carry_length` when the carry is all ``+0.0`` (the usual shape), else ``None``."""
        _, carry, usual = self._shape()
        return carry if usual else None

    def _shape(self) -> tuple[bytes, int | None, bool]:
        codes, shape = self.mask_codes, self._mask_shape
        if shape is None or shape[0] is not codes:  # computed for these very (immutable) codes, or again
            carry = carry_prefix(codes)
            shape = self._mask_shape = (codes, carry, carry is not None and is_repeat(codes, 0, carry, b"\x00"))
        return shape

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

    Built only here and by :mod:`sink.contract.codec`, from fresh copies or freshly
    decoded lists. Placed in the validation context, it lets the record
    validators skip per-element validation of exactly these list objects
    (identity is checked) and reuse ``packed``. It guarantees: the float lists
    hold exact, finite ``float`` objects; ``token_ids`` (when not ``None``)
    holds exact ints in ``[0, 2**64)`` and ``packed`` holds them; the mask
    codes are those of ``token_mask``; rules 7 and 8 hold; ``packed.lp_f32be``
    packs ``log_probs``; ``ids_marshal``, when set, is ``marshal.dumps(token_ids, 2)``, the pass ``packed`` read the
    ids from.
    """

    __slots__ = ("ids_marshal", "log_probs", "packed", "token_ids", "token_mask")

    def __init__(
        self,
        packed: PackedColumns,
        token_mask: list[float],
        log_probs: list[float],
        token_ids: list[int] | None,
        ids_marshal: bytes | None = None,
    ) -> None:
        self.packed = packed
        self.token_ids = token_ids
        self.token_mask = token_mask
        self.log_probs = log_probs
        self.ids_marshal = ids_marshal

    def vouches_for(self, field_name: str | None, value: object) -> bool:
        """Whether *value* is the very list object this instance holds for that record field."""
        if field_name == "token_mask_delta":
            return value is self.token_mask
        if field_name == "generation_log_probs_delta":
            return value is self.log_probs
        return field_name == "token_ids_delta" and self.token_ids is not None and value is self.token_ids
