"""The staged-call records: one token delta with its digest, as staged (contract §3.3-§3.4).

Every digest-bearing record recomputes its digest on validation; only
:meth:`StagedCallRecord.from_components` (and :func:`record_from_trusted_columns`)
computes it instead (once). The fields' digest roles come from the table in
:mod:`sink.contract.record_schema`; what validation proved about the packed columns
is kept and read by :mod:`sink.contract.record_form`. :data:`StagedCallScalars`
validates a call's scalars exactly as the record does, for the packed write form
(:mod:`sink.contract.packed_record`); the packed read form checks them where the digest reads them
(:func:`sink.contract.packed.verified_packed_snapshot`).
"""

from __future__ import annotations

from typing import Any, Final, Self

from pydantic import (
    BaseModel,
    PrivateAttr,
    StrictFloat,
    StrictInt,
    ValidationInfo,
    ValidatorFunctionWrapHandler,
    create_model,
    field_validator,
    model_validator,
)

from sink.contract._packed import TrustedColumns, trusted_components
from sink.contract.digest import (
    EMPTY_EXTRAS_DIGEST,
    check_mask_values,
    compute_extras_digest,
    compute_staging_digest,
)
from sink.contract.record_base import CaptureMode, DigestHex, DigestWireModel, Identifier, NonNegativeInt, staging_key
from sink.contract.record_form import ColumnCache, packed_digest, prove_columns
from sink.contract.record_schema import (
    COLUMN_FIELDS,
    DIGEST_SCALAR_FIELDS,
    RECORD_FIELDS,
    SCALAR_FIELDS,
    lineage_problem,
)

__all__ = (
    "BUILD_STAGING_DIGEST",
    "TRUSTED_COLUMNS_KEY",
    "StagedCallBaseSnapshot",
    "StagedCallRecord",
    "StagedCallScalars",
    "StagedCallSnapshot",
    "check_trusted_columns",
    "record_from_trusted_columns",
    "trusted_record_fields",
)

# In-process marker that switches rule 9 from "compare" to "compute" (§3.4).
# Its identity cannot be carried by wire data (``BUILD_STAGING_DIGEST`` in the seed API).
BUILD_STAGING_DIGEST: Final = object()
#: Validation-context key for a :class:`~sink.contract._packed.TrustedColumns`: column lists this
#: package built itself (copies in from_components, lists decoded by sink.contract.codec)
#: with their packed bytes. Like the sentinel, it only exists in-process.
TRUSTED_COLUMNS_KEY: Final = "columns"


def _trusted_columns(context: object) -> TrustedColumns | None:
    if not isinstance(context, dict):
        return None
    trusted = context.get(TRUSTED_COLUMNS_KEY)
    return trusted if type(trusted) is TrustedColumns else None


class StagedCallBaseSnapshot(DigestWireModel):
    """Token columns and metadata for one staged call.

    Validation recomputes the call digest from these fields and the recorded
    ``extras_digest``; it does not check that an extras payload exists. A
    consumer that loads extras must verify them with ``compute_extras_digest``.
    """

    rollout_id: Identifier
    model_call_id: Identifier
    parent_call_id: Identifier | None = None
    mode: CaptureMode
    prev_len: NonNegativeInt
    delta_len: NonNegativeInt
    cum_len: NonNegativeInt
    weight_version: NonNegativeInt
    digest: DigestHex
    token_ids_delta: list[StrictInt]
    token_mask_delta: list[StrictFloat]
    generation_log_probs_delta: list[StrictFloat]
    """Behaviour log-probs; carry positions are ``0.0`` (§3.3). A positive generated value is accepted on purpose:
    §3.3 sets no upper bound (engines round log-softmax in low precision, ``+1e-7``), and refusing it would refuse
    records other producers of the contract stage. Bound them in the trainer if a loss needs ``<= 0``."""
    extras_digest: DigestHex = EMPTY_EXTRAS_DIGEST
    chain_hash: DigestHex
    cumulative_hash: DigestHex

    @property
    def staging_key(self) -> str:
        """The default key ``rollout_id/model_call_id`` (not necessarily the sink's key)."""
        return staging_key(self.rollout_id, self.model_call_id)

    def recompute_digest(self) -> str:
        """Recompute the call digest from the fields (raises ``ValueError`` on a pre-check failure)."""
        return compute_staging_digest(**{name: getattr(self, name) for name in DIGEST_SCALAR_FIELDS + COLUMN_FIELDS})

    # Packed columns proved during validation (sink.contract.record_form). Not part of the
    # record's value (see ColumnCache).
    _columns: ColumnCache | None = PrivateAttr(default=None)

    @property
    def packed_form(self) -> ColumnCache | None:
        """What validation proved about the token columns (packed), or ``None``; not part of the record's value.

        Read through :mod:`sink.contract.record_form`, which knows when it still describes the record.
        """
        return self._columns

    @field_validator(*COLUMN_FIELDS, mode="wrap")
    @classmethod
    def _accept_trusted_columns(cls, value: Any, handler: ValidatorFunctionWrapHandler, info: ValidationInfo) -> Any:
        # A list this package built and proved (exact, finite elements) is taken
        # as is; everything else gets the normal strict element validation.
        trusted = _trusted_columns(info.context)
        if trusted is not None and trusted.vouches_for(info.field_name, value):
            return value
        return handler(value)

    def _reference_digest(self) -> str:
        """Rules 6-8 and the §4.3 digest with every pre-check, raising the precise error."""
        if self.token_ids_delta and min(self.token_ids_delta) < 0:
            raise ValueError("token ids must be non-negative")
        check_mask_values(self.token_mask_delta, self.generation_log_probs_delta)
        try:
            return self.recompute_digest()
        except (ValueError, TypeError) as exc:
            raise ValueError(f"digest does not match staged call contents: {exc}") from None

    @model_validator(mode="after")
    def _validate_base_integrity(self, info: ValidationInfo) -> Self:
        if problem := lineage_problem(self.parent_call_id, self.prev_len, self.mode):
            raise ValueError(problem)
        if self.delta_len == 0:
            raise ValueError("a staged delta must contain at least one token")
        # Fast path: whole-buffer packing proves rules 6-8 and hashes the packed
        # columns. Anything it cannot prove goes to the reference path, which
        # raises exactly the error the contract names.
        packed = prove_columns(self, _trusted_columns(info.context))
        computed = None if packed is None else packed_digest(self, packed.digest_forms())
        if computed is None:
            packed = None
            computed = self._reference_digest()
        if info.context is not None and info.context.get("build") is BUILD_STAGING_DIGEST:
            self.digest = computed
        elif computed != self.digest:
            raise ValueError("digest does not match staged call contents")
        self._columns = None if packed is None else ColumnCache.of(self, packed)
        return self


# The model spells the table's fields out with their types; it must list them in table order.
assert tuple(StagedCallBaseSnapshot.model_fields) == tuple(field.name for field in RECORD_FIELDS), (
    "StagedCallBaseSnapshot drifted from RECORD_FIELDS"
)


#: The scalar fields of a staged call (the table's ``SCALAR_FIELDS``) with exactly the types and constraints of
#: :class:`StagedCallBaseSnapshot` (taken from it, so the two cannot drift apart). Field checks only: the record's
#: integrity rules (lineage, lengths, digest, extras) are not part of it.
StagedCallScalars: Final[type[BaseModel]] = create_model(
    "StagedCallScalars",
    __base__=DigestWireModel,
    **{  # type: ignore[call-overload]
        name: (StagedCallBaseSnapshot.model_fields[name].annotation, StagedCallBaseSnapshot.model_fields[name])
        for name in SCALAR_FIELDS
        if name not in DigestWireModel.model_fields
    },
)


class StagedCallRecord(StagedCallBaseSnapshot):
    """One normalized token delta made durable by a framework staging sink."""

    extras: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _validate_extras_integrity(self) -> Self:
        # compute_extras_digest raises TypeError for unsupported values; it
        # propagates unchanged (contract §2.2).
        if compute_extras_digest(self.extras) != self.extras_digest:
            raise ValueError("extras_digest does not match extras")
        return self

    @classmethod
    def from_components(
        cls,
        rollout_id: str,
        model_call_id: str,
        parent_call_id: str | None,
        mode: CaptureMode,
        prev_len: int,
        delta_len: int,
        cum_len: int,
        weight_version: int,
        token_ids_delta: list[int],
        token_mask_delta: list[float],
        generation_log_probs_delta: list[float],
        extras: dict[str, Any] | None,
        extras_digest: str,
        chain_hash: str,
        cumulative_hash: str,
    ) -> Self:
        """Validate local components and compute their digest exactly once.

        Runs normal field, integrity, and extras validators. Wire constructors
        still require a supplied digest and verify it against the contents.

        :raises ValueError: a mask or log probability is not an exact Python float.
        :raises pydantic.ValidationError: other components fail validation.
        """
        context: dict[str, object] = {"build": BUILD_STAGING_DIGEST}
        # Copies the columns and proves them in a few C passes; None means "not
        # provable cheaply" and the contract's type gate and validators decide.
        trusted = trusted_components(token_ids_delta, token_mask_delta, generation_log_probs_delta)
        if trusted is None:
            for column in (token_mask_delta, generation_log_probs_delta):
                if not set(map(type, column)) <= {float}:
                    raise ValueError("masks and log probabilities must be exact Python floats")
        else:
            token_mask_delta, generation_log_probs_delta = trusted.token_mask, trusted.log_probs
            if trusted.token_ids is not None:
                token_ids_delta = trusted.token_ids
            context[TRUSTED_COLUMNS_KEY] = trusted
        return cls.model_validate(
            {
                "rollout_id": rollout_id,
                "model_call_id": model_call_id,
                "parent_call_id": parent_call_id,
                "mode": mode,
                "prev_len": prev_len,
                "delta_len": delta_len,
                "cum_len": cum_len,
                "weight_version": weight_version,
                "digest": _PLACEHOLDER_DIGEST,
                "token_ids_delta": token_ids_delta,
                "token_mask_delta": token_mask_delta,
                "generation_log_probs_delta": generation_log_probs_delta,
                "extras": extras,
                "extras_digest": extras_digest,
                "chain_hash": chain_hash,
                "cumulative_hash": cumulative_hash,
            },
            context=context,
        )


_PLACEHOLDER_DIGEST = "0" * 64


class StagedCallSnapshot(StagedCallRecord):
    """The exact staged record returned by a framework-owned source."""


def trusted_record_fields(columns: TrustedColumns, scalars: dict[str, Any]) -> dict[str, Any]:
    """The record fields of *columns* and *scalars*: the lengths derived, the digest a placeholder.

    *scalars* are the other components except the lengths (a given ``delta_len`` or ``cum_len`` is
    replaced). Shared by both builds from trusted columns (:func:`record_from_trusted_columns` and
    :meth:`sink.contract.packed_record.PackedCallRecord.from_trusted_columns`).
    """
    length = columns.packed.length
    prev_len = scalars.get("prev_len")
    return {
        **scalars,
        "delta_len": length,
        "cum_len": prev_len + length if type(prev_len) is int else None,  # None: prev_len fails validation
        "digest": _PLACEHOLDER_DIGEST,
        "token_ids_delta": columns.token_ids,
        "token_mask_delta": columns.token_mask,
        "generation_log_probs_delta": columns.log_probs,
    }


def check_trusted_columns(columns: object, builder: str) -> None:
    """Refuse anything but :class:`~sink.contract._packed.TrustedColumns` that vouch for their ids.

    :raises TypeError: *columns* is no such thing (build through ``from_components`` then).
    """
    if type(columns) is not TrustedColumns or columns.token_ids is None:
        raise TypeError(f"{builder} takes TrustedColumns that vouch for their ids")


def record_from_trusted_columns(columns: TrustedColumns, **scalars: Any) -> StagedCallRecord:
    """:meth:`StagedCallRecord.from_components` for columns that :mod:`sink.contract._packed` built and proved itself.

    The model form of :meth:`sink.contract.packed_record.PackedCallRecord.from_trusted_columns`
    (the worker's build, which keeps the columns packed) and its reference: *scalars* are the other
    components except the lengths, which are derived; every one is validated as usual and the
    digest computed once. The columns' lists become the record's: the caller must not reuse them.

    :raises TypeError: *columns* vouches for no ids (build through ``from_components`` then).
    :raises pydantic.ValidationError: a component fails validation.
    """
    check_trusted_columns(columns, "record_from_trusted_columns")
    return StagedCallRecord.model_validate(
        trusted_record_fields(columns, scalars), context={"build": BUILD_STAGING_DIGEST, TRUSTED_COLUMNS_KEY: columns}
    )
