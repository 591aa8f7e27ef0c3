"""Versioned wire records for framework-owned token staging (contract §2–§3).

Name-for-name the API of ``nemo_gym.token_id_capture.staging.records``
(schema 2), so records travel between our sink and NeMo Gym / NeMo RL peers
unchanged. Every digest-bearing record recomputes its digest on validation;
only :meth:`StagedCallRecord.from_components` computes it instead (once).
"""

from __future__ import annotations

import operator
from typing import Annotated, Any, Final, Literal, Self

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationInfo,
    ValidatorFunctionWrapHandler,
    field_validator,
    model_validator,
)

from ._packed import (
    Buffers,
    ColumnCache,
    PackedColumns,
    TrustedColumns,
    pack_ids,
    pack_validated_columns,
)
from ._packed import trusted_components as _trusted_components
from .digest import (
    EMPTY_EXTRAS_DIGEST,
    EXTRAS_DIGEST_VERSION,
    STAGING_DIGEST_VERSION,
    STAGING_SCHEMA_VERSION,
    _staging_digest_from_packed,
    check_mask_values,
    compute_extras_digest,
    compute_staging_digest,
)

__all__ = (
    "EMPTY_EXTRAS_DIGEST",
    "EXTRAS_DIGEST_VERSION",
    "INVALID_COMMIT_COORDS_REASON",
    "LEDGER_ROW_MISSING_CHAIN_HASH_REASON",
    "LEDGER_ROW_MISSING_RESPONSE_ID_REASON",
    "STAGING_DIGEST_VERSION",
    "STAGING_SCHEMA_VERSION",
    "TERMINAL_AMBIGUOUS",
    "TERMINAL_DUPLICATE_CALL_ID",
    "TERMINAL_NO_RECORDS",
    "TERMINAL_NO_ROOT",
    "TERMINAL_ORPHANED_ROW",
    "TERMINAL_SELECTED",
    "UNCOMMITTED_CALL_REASON",
    "UNRESOLVED_PARENT_REASON",
    "WORKER_CAPTURE_FAILED_REASON",
    "WORKER_MISSING_COMMIT_COORDS_REASON",
    "CallRecord",
    "CaptureAdmission",
    "CaptureDisposition",
    "CaptureLedgerCommit",
    "CaptureMode",
    "CommitCoords",
    "DigestHex",
    "GenerationCutContinuation",
    "Identifier",
    "ManifestFailure",
    "NonNegativeInt",
    "PositiveInt",
    "RolloutManifest",
    "RolloutReceipt",
    "RolloutRemoval",
    "StageResult",
    "StagedCallBaseSnapshot",
    "StagedCallRecord",
    "StagedCallSnapshot",
    "staging_key",
)

# --- constants (contract §3.12) -------------------------------------------

WORKER_MISSING_COMMIT_COORDS_REASON = "worker_response_missing_commit_coordinates"
WORKER_CAPTURE_FAILED_REASON = "worker_capture_failed"
INVALID_COMMIT_COORDS_REASON = "invalid_worker_commit_coordinates"
UNRESOLVED_PARENT_REASON = "unresolved_parent"
UNCOMMITTED_CALL_REASON = "request_finished_without_staged_coordinates"
LEDGER_ROW_MISSING_RESPONSE_ID_REASON = "ledger_row_missing_response_id"
LEDGER_ROW_MISSING_CHAIN_HASH_REASON = "ledger_row_missing_chain_hash"

TERMINAL_SELECTED = "selected"
TERMINAL_NO_RECORDS = "no_records"
TERMINAL_DUPLICATE_CALL_ID = "duplicate_call_id"
TERMINAL_ORPHANED_ROW = "orphaned_row"
TERMINAL_NO_ROOT = "no_root"
TERMINAL_AMBIGUOUS = "ambiguous_terminal"

# In-process marker that switches rule 9 from "compare" to "compute" (§3.4).
# Its identity cannot be carried by wire data.
_BUILD_STAGING_DIGEST = object()
# Validation-context key for a sink._columns.TrustedColumns: column lists this
# package built itself (copies in from_components, lists decoded by sink.codec)
# with their packed bytes. Like the sentinel, it only exists in-process.
_TRUSTED_COLUMNS_KEY = "columns"


# Every non-column input of the call digest, in payload order; sink.codec stores
# them under these names, in this order.
_SCALAR_DIGEST_FIELDS: Final = (
    "schema_version",
    "digest_version",
    "extras_digest_version",
    "rollout_id",
    "model_call_id",
    "parent_call_id",
    "mode",
    "prev_len",
    "delta_len",
    "cum_len",
    "weight_version",
    "extras_digest",
    "chain_hash",
    "cumulative_hash",
)
_COLUMN_FIELDS: Final = ("token_ids_delta", "token_mask_delta", "generation_log_probs_delta")
# A record's scalar digest inputs and its digest, as one tuple (see ColumnCache).
_scalar_digest_inputs: Final = operator.attrgetter(*_SCALAR_DIGEST_FIELDS, "digest")


def _trusted_columns(context: object) -> TrustedColumns | None:
    if not isinstance(context, dict):
        return None
    trusted = context.get(_TRUSTED_COLUMNS_KEY)
    return trusted if type(trusted) is TrustedColumns else None


# --- type aliases (contract §2.2) -------------------------------------------

Identifier = Annotated[StrictStr, Field(min_length=1)]
NonNegativeInt = Annotated[StrictInt, Field(ge=0)]
PositiveInt = Annotated[StrictInt, Field(ge=1)]
DigestHex = Annotated[StrictStr, Field(pattern="^[0-9a-f]{64}$")]
CaptureMode = Literal["token_in", "text"]
CaptureDisposition = Literal["staged", "capture_failed"]


def staging_key(rollout_id: str, model_call_id: str) -> str:
    """Return the default deterministic key used by the NeMo RL backend."""
    if not rollout_id or not model_call_id:
        raise ValueError("staging_key needs a non-empty rollout_id and model_call_id")
    return f"{rollout_id}/{model_call_id}"


def _exact_version(value: object, expected: int, name: str) -> object:
    # Literal[2] alone would accept True/2.0; versions must be exact ints.
    if type(value) is not int or value != expected:
        raise ValueError(f"unsupported {name} {value!r}: only {expected} is accepted")
    return value


# --- base models ------------------------------------------------------------


class _WireModel(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    schema_version: Literal[2] = STAGING_SCHEMA_VERSION

    @field_validator("schema_version", mode="before")
    @classmethod
    def _check_schema_version(cls, value: object) -> object:
        return _exact_version(value, STAGING_SCHEMA_VERSION, "schema_version")


class _DigestWireModel(_WireModel):
    digest_version: Literal[2] = STAGING_DIGEST_VERSION
    extras_digest_version: Literal[1] = EXTRAS_DIGEST_VERSION

    @field_validator("digest_version", mode="before")
    @classmethod
    def _check_digest_version(cls, value: object) -> object:
        return _exact_version(value, STAGING_DIGEST_VERSION, "digest_version")

    @field_validator("extras_digest_version", mode="before")
    @classmethod
    def _check_extras_digest_version(cls, value: object) -> object:
        return _exact_version(value, EXTRAS_DIGEST_VERSION, "extras_digest_version")


def _check_lineage(parent_call_id: str | None, prev_len: int, mode: str) -> None:
    if parent_call_id is None:
        if prev_len != 0:
            raise ValueError("a parentless call must have prev_len == 0")
        if mode != "text":
            raise ValueError("a parentless call must have mode 'text'")
    else:
        if prev_len <= 0:
            raise ValueError("a call with a parent must have prev_len > 0")
        if mode != "token_in":
            raise ValueError("a call with a parent must have mode 'token_in'")


# --- records ----------------------------------------------------------------


class GenerationCutContinuation(_WireModel):
    """A checkpointed prefix of the same call, which the worker continues instead of regenerating."""

    source_capture_key: Identifier
    source_model_call_id: Identifier
    staging_keys: tuple[Identifier, ...] = Field(min_length=1)
    prefix_token_count: NonNegativeInt
    prefix_digest: DigestHex
    effective_output_limit: PositiveInt
    terminal_finish_reason: Literal["stop", "length"] | None = None
    terminal_stop_reason: str | int | None = None

    @model_validator(mode="after")
    def _validate_staging_keys(self) -> Self:
        if len(set(self.staging_keys)) != len(self.staging_keys):
            raise ValueError("generation-cut staging keys must be unique")
        if self.terminal_stop_reason is not None and self.terminal_finish_reason is None:
            raise ValueError("a stop reason requires a terminal finish reason")
        return self


class CaptureAdmission(_WireModel):
    """Gate-to-worker identity and exact-prefix contract for one model call."""

    rollout_id: Identifier
    model_call_id: Identifier
    parent_call_id: Identifier | None = None
    prev_len: NonNegativeInt = 0
    mode: CaptureMode
    required_prefix_token_ids: list[StrictInt] = Field(default_factory=list)
    staging_chain: list[str] = Field(default_factory=list)
    parent_chain_hash: DigestHex | None = None
    generation_cut: GenerationCutContinuation | None = None

    @model_validator(mode="after")
    def _validate_prefix_contract(self) -> Self:
        if any(t < 0 for t in self.required_prefix_token_ids):
            raise ValueError("prefix ids must be non-negative")
        if self.mode == "token_in":
            if self.parent_call_id is None or self.prev_len <= 0:
                raise ValueError("token_in needs a parent and prev_len > 0")
            if self.parent_chain_hash is None:
                raise ValueError("token_in needs the parent's chain hash")
            if not self.staging_chain and len(self.required_prefix_token_ids) != self.prev_len:
                raise ValueError("inline prefix length must equal prev_len")
        elif (
            self.parent_call_id is not None
            or self.prev_len != 0
            or self.required_prefix_token_ids
            or self.staging_chain
            or self.parent_chain_hash is not None
        ):
            raise ValueError("a text admission must be a parentless root with no prefix")
        return self


class StagedCallBaseSnapshot(_DigestWireModel):
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
    extras_digest: DigestHex = EMPTY_EXTRAS_DIGEST
    chain_hash: DigestHex
    cumulative_hash: DigestHex

    @property
    def staging_key(self) -> str:
        """The default key ``rollout_id/model_call_id`` (not necessarily the sink's key)."""
        return staging_key(self.rollout_id, self.model_call_id)

    def recompute_digest(self) -> str:
        """Recompute the call digest from the fields (raises ``ValueError`` on a pre-check failure)."""
        return compute_staging_digest(**{name: getattr(self, name) for name in _SCALAR_DIGEST_FIELDS + _COLUMN_FIELDS})

    # Packed columns proved during validation; sink.codec reuses them. Not part
    # of the record's value (see ColumnCache).
    _columns: ColumnCache | None = PrivateAttr(default=None)

    @field_validator(*_COLUMN_FIELDS, mode="wrap")
    @classmethod
    def _accept_trusted_columns(cls, value: Any, handler: ValidatorFunctionWrapHandler, info: ValidationInfo) -> Any:
        # A list this package built and proved (exact, finite elements) is taken
        # as is; everything else gets the normal strict element validation.
        trusted = _trusted_columns(info.context)
        if trusted is not None and trusted.vouches_for(info.field_name, value):
            return value
        return handler(value)

    def _pack_columns(self, trusted: TrustedColumns | None) -> PackedColumns | None:
        """Packed columns with rules 6-8 proved, or ``None`` (then the reference path decides)."""
        ids, mask, log_probs = self.token_ids_delta, self.token_mask_delta, self.generation_log_probs_delta
        n = len(ids)
        if n != self.delta_len or len(mask) != n or len(log_probs) != n:
            return None
        if trusted is None or mask is not trusted.token_mask or log_probs is not trusted.log_probs:
            return pack_validated_columns(ids, mask, log_probs)
        if ids is trusted.token_ids:
            return trusted.packed
        packed_ids = pack_ids(ids)
        return None if packed_ids is None else trusted.packed.with_ids(*packed_ids)

    def _cached_packed_columns(self) -> PackedColumns | None:
        """The packed columns proved at validation, if they still describe this record's column lists.

        Replaced or resized columns are detected; element assignment after
        validation is not, so only code that owns a freshly validated record
        (the trainer reader, right after decoding) may rely on this.
        """
        cache = self._columns
        if cache is None or not cache.describes(
            self.token_ids_delta, self.token_mask_delta, self.generation_log_probs_delta
        ):
            return None
        return cache.packed

    def _unchanged_since_validation(self) -> bool:
        """Whether the columns (by identity and length) and every scalar digest input are as validated.

        O(1), with the limits of :meth:`_cached_packed_columns` (records are values: do not mutate them).
        """
        cache = self._columns
        return (
            cache is not None
            and cache.digest_inputs == _scalar_digest_inputs(self)
            and self._cached_packed_columns() is not None
        )

    def _packed_digest(self, digest_forms: tuple[Buffers, Buffers, Buffers]) -> str | None:
        """The call digest over ``PackedColumns.digest_forms()`` of proved columns, or ``None`` if a pre-check fails."""
        ids_u64be, mask_f32be, lp_f32be = digest_forms
        try:
            return _staging_digest_from_packed(
                versions=(self.schema_version, self.digest_version, self.extras_digest_version),
                rollout_id=self.rollout_id,
                model_call_id=self.model_call_id,
                parent_call_id=self.parent_call_id,
                mode=self.mode,
                prev_len=self.prev_len,
                delta_len=self.delta_len,
                cum_len=self.cum_len,
                weight_version=self.weight_version,
                ids_u64be=ids_u64be,
                mask_f32be=mask_f32be,
                lp_f32be=lp_f32be,
                extras_digest=self.extras_digest,
                chain_hash=self.chain_hash,
                cumulative_hash=self.cumulative_hash,
            )
        except (ValueError, TypeError):
            return None

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
        _check_lineage(self.parent_call_id, self.prev_len, self.mode)
        if self.delta_len == 0:
            raise ValueError("a staged delta must contain at least one token")
        # Fast path: whole-buffer packing proves rules 6-8 and hashes the packed
        # columns. Anything it cannot prove goes to the reference path, which
        # raises exactly the error the contract names.
        packed = self._pack_columns(_trusted_columns(info.context))
        computed = None if packed is None else self._packed_digest(packed.digest_forms())
        if computed is None:
            packed = None
            computed = self._reference_digest()
        if info.context is not None and info.context.get("build") is _BUILD_STAGING_DIGEST:
            self.digest = computed
        elif computed != self.digest:
            raise ValueError("digest does not match staged call contents")
        self._columns = (
            None
            if packed is None
            else ColumnCache(
                packed,
                self.token_ids_delta,
                self.token_mask_delta,
                self.generation_log_probs_delta,
                _scalar_digest_inputs(self),
            )
        )
        return self


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
        context: dict[str, object] = {"build": _BUILD_STAGING_DIGEST}
        # Copies the columns and proves them in a few C passes; None means "not
        # provable cheaply" and the contract's type gate and validators decide.
        trusted = _trusted_components(token_ids_delta, token_mask_delta, generation_log_probs_delta)
        if trusted is None:
            for column in (token_mask_delta, generation_log_probs_delta):
                if not set(map(type, column)) <= {float}:
                    raise ValueError("masks and log probabilities must be exact Python floats")
        else:
            token_mask_delta, generation_log_probs_delta = trusted.token_mask, trusted.log_probs
            if trusted.token_ids is not None:
                token_ids_delta = trusted.token_ids
            context[_TRUSTED_COLUMNS_KEY] = trusted
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

    @classmethod
    def _from_trusted(cls, columns: TrustedColumns, **scalars: Any) -> Self:
        """:meth:`from_components` for columns that :mod:`sink._packed.columns` built and proved itself.

        For the worker, with :func:`sink._record_columns.staging_delta_columns`. *scalars* are the other
        components except the lengths, which are derived; every one is validated as usual and the
        digest computed once. The columns' lists become the record's: the caller must not reuse them.

        :raises TypeError: *columns* vouches for no ids (build through ``from_components`` then).
        :raises pydantic.ValidationError: a component fails validation.
        """
        if type(columns) is not TrustedColumns or columns.token_ids is None:
            raise TypeError("_from_trusted takes TrustedColumns that vouch for their ids")
        length = columns.packed.length
        prev_len = scalars.get("prev_len")
        fields = {
            **scalars,
            "delta_len": length,
            "cum_len": prev_len + length if type(prev_len) is int else None,  # None: prev_len fails validation
            "digest": _PLACEHOLDER_DIGEST,
            "token_ids_delta": columns.token_ids,
            "token_mask_delta": columns.token_mask,
            "generation_log_probs_delta": columns.log_probs,
        }
        return cls.model_validate(fields, context={"build": _BUILD_STAGING_DIGEST, _TRUSTED_COLUMNS_KEY: columns})


_PLACEHOLDER_DIGEST = "0" * 64


class StagedCallSnapshot(StagedCallRecord):
    """The exact staged record returned by a framework-owned source."""


class StageResult(_WireModel):
    """Durability result returned by ``StagingSink.stage``."""

    ok: bool
    staging_key: Identifier | None = None
    error: str | None = None

    @model_validator(mode="after")
    def _validate_result(self) -> Self:
        if self.ok and self.staging_key is None:
            raise ValueError("a successful stage result needs a key")
        if not self.ok and not self.error:
            raise ValueError("a failed stage result needs an error")
        return self


_STAGED_PAYLOAD_FIELDS = ("digest", "extras_digest", "staging_key", "chain_hash", "cumulative_hash")


class CommitCoords(_DigestWireModel):
    """Metadata returned after an inference worker stages one call."""

    rollout_id: Identifier
    model_call_id: Identifier
    parent_call_id: Identifier | None = None
    prev_len: NonNegativeInt
    delta_len: NonNegativeInt
    cum_len: NonNegativeInt
    weight_version: NonNegativeInt
    disposition: CaptureDisposition = "staged"
    digest: DigestHex | None = None
    extras_digest: DigestHex | None = None
    staging_key: Identifier | None = None
    chain_hash: DigestHex | None = None
    cumulative_hash: DigestHex | None = None

    @model_validator(mode="after")
    def _validate_disposition(self) -> Self:
        if self.parent_call_id is None and self.prev_len != 0:
            raise ValueError("a parentless call must have prev_len == 0")
        if self.parent_call_id is not None and self.prev_len <= 0:
            raise ValueError("a call with a parent must have prev_len > 0")
        if self.cum_len != self.prev_len + self.delta_len:
            raise ValueError("cum_len must equal prev_len + delta_len")
        payload = [getattr(self, name) for name in _STAGED_PAYLOAD_FIELDS]
        if self.disposition == "staged":
            if any(value is None for value in payload):
                raise ValueError(
                    "staged coordinates need digest, extras_digest, staging_key, chain_hash and cumulative_hash"
                )
            if self.delta_len <= 0:
                raise ValueError("staged coordinates need delta_len > 0")
        else:
            if any(value is not None for value in payload):
                raise ValueError("capture_failed coordinates cannot carry staged payload metadata")
            if self.delta_len != 0:
                raise ValueError("capture_failed coordinates need delta_len == 0")
        return self


class CallRecord(_DigestWireModel):
    """One token-free call manifest row in a rollout's capture ledger."""

    model_call_id: Identifier
    parent_call_id: Identifier | None = None
    prev_len: NonNegativeInt
    delta_len: NonNegativeInt
    cum_len: NonNegativeInt
    weight_version: NonNegativeInt
    digest: DigestHex
    extras_digest: DigestHex
    staging_key: Identifier
    mode: CaptureMode = "token_in"
    chain_hash: DigestHex
    cumulative_hash: DigestHex
    response_id: Identifier
    capture_key: Identifier | None = None
    admitted_at: StrictFloat | None = None
    output_fingerprint: DigestHex | None = None
    continuation_fingerprint: DigestHex | None = None
    fingerprint_version: NonNegativeInt = 0

    @model_validator(mode="after")
    def _validate_lengths(self) -> Self:
        if self.delta_len == 0 or self.cum_len != self.prev_len + self.delta_len:
            raise ValueError("manifest lengths must describe a non-empty contiguous delta")
        _check_lineage(self.parent_call_id, self.prev_len, self.mode)
        return self


class CaptureLedgerCommit(_WireModel):
    """One successfully staged call, as handed to ``CaptureLedger.record``.

    ``record`` is the manifest row. The remaining fields feed parent
    resolution and are not part of the manifest.
    """

    rollout_id: Identifier
    record: CallRecord
    staging_chain: tuple[Identifier, ...] = ()
    request_items: list[dict[str, Any]]
    response_items: list[dict[str, Any]]


class ManifestFailure(_WireModel):
    """A call whose token capture did not complete."""

    model_call_id: Identifier
    reason: Identifier


class RolloutManifest(_WireModel):
    """The token-free ledger read returned by the manifest control route."""

    rollout_id: Identifier
    records: list[CallRecord] = Field(default_factory=list)
    failures: list[ManifestFailure] = Field(default_factory=list)


class RolloutRemoval(_WireModel):
    """The result of retiring or deleting rollouts in a capture store or ledger."""

    removed: list[Identifier] = Field(default_factory=list)
    absent: list[Identifier] = Field(default_factory=list)


class RolloutReceipt(_DigestWireModel):
    """Token-free immutable manifest the framework assembles at rollout end."""

    rollout_id: Identifier
    reward: float | None = None
    terminal_model_call_id: Identifier | None = None
    manifest: list[CallRecord] = Field(default_factory=list)
    capture_poisoned: bool = False
    failure_reason: str | None = None
    terminal_selection: Literal["declared", "response_id", "content", "heuristic"] | None = None
    terminal_attribution_reason: str | None = None

    @model_validator(mode="after")
    def _validate_manifest(self) -> Self:
        ids = [row.model_call_id for row in self.manifest]
        if len(set(ids)) != len(ids):
            raise ValueError("duplicate model_call_id in receipt manifest")
        if self.terminal_model_call_id is not None and self.terminal_model_call_id not in ids:
            raise ValueError("terminal_model_call_id is absent from the receipt manifest")
        return self

    @model_validator(mode="after")
    def _validate_attribution_state(self) -> Self:
        """Keep the terminal fields in one of the three documented states."""
        if not self.capture_poisoned:
            if self.failure_reason is not None:
                raise ValueError("an unpoisoned receipt cannot carry a failure_reason")
            if self.terminal_model_call_id is None or self.terminal_selection is None:
                raise ValueError("an unpoisoned receipt must name its terminal and the selection method")
        if self.terminal_selection is None:
            if self.terminal_model_call_id is not None:
                raise ValueError("a terminal requires a selection method")
            if self.failure_reason is None:
                raise ValueError("a receipt with no attribution stage must be poisoned with a failure_reason")
        return self
