"""Versioned wire records for framework-owned token staging (contract §2–§3).

Name-for-name the API of ``nemo_gym.token_id_capture.staging.records``
(schema 2), so records travel between our sink and NeMo Gym / NeMo RL peers
unchanged. This module holds the constants and the admission-side records
(admission, generation cut, stage result, commit coordinates) and re-exports
the rest from their homes: :mod:`sink.contract.record_base` (aliases, base models),
:mod:`sink.contract.staged_records` (the staged call) and :mod:`sink.contract.ledger_records`
(manifest rows and the receipt).
"""

from __future__ import annotations

from typing import Literal, Self

from pydantic import Field, StrictInt, model_validator

from sink.contract.digest import (
    EMPTY_EXTRAS_DIGEST,
    EXTRAS_DIGEST_VERSION,
    STAGING_DIGEST_VERSION,
    STAGING_SCHEMA_VERSION,
)
from sink.contract.ledger_records import (
    CallRecord,
    CaptureLedgerCommit,
    ManifestFailure,
    RolloutManifest,
    RolloutReceipt,
    RolloutRemoval,
)
from sink.contract.record_base import (
    CaptureDisposition,
    CaptureMode,
    DigestHex,
    DigestWireModel,
    Identifier,
    NonNegativeInt,
    PositiveInt,
    WireModel,
    staging_key,
)
from sink.contract.record_schema import lineage_problem
from sink.contract.staged_records import (
    BUILD_STAGING_DIGEST,
    StagedCallBaseSnapshot,
    StagedCallRecord,
    StagedCallSnapshot,
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

# The seed API's private names.
_WireModel = WireModel
_DigestWireModel = DigestWireModel
_BUILD_STAGING_DIGEST = BUILD_STAGING_DIGEST


class GenerationCutContinuation(WireModel):
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


class CaptureAdmission(WireModel):
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
        wrong_lineage = lineage_problem(self.parent_call_id, self.prev_len, self.mode) is not None
        if self.mode == "token_in":
            if wrong_lineage:
                raise ValueError("token_in needs a parent and prev_len > 0")
            if self.parent_chain_hash is None:
                raise ValueError("token_in needs the parent's chain hash")
            if not self.staging_chain and len(self.required_prefix_token_ids) != self.prev_len:
                raise ValueError("inline prefix length must equal prev_len")
        elif (
            wrong_lineage or self.required_prefix_token_ids or self.staging_chain or self.parent_chain_hash is not None
        ):
            raise ValueError("a text admission must be a parentless root with no prefix")
        return self


class StageResult(WireModel):
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


class CommitCoords(DigestWireModel):
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
        if problem := lineage_problem(self.parent_call_id, self.prev_len, None):
            raise ValueError(problem)
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
