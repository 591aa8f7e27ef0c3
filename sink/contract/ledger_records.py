"""The token-free ledger records: manifest rows, ledger commits and reads, and the rollout receipt (contract §3.8-§3.11)."""

from __future__ import annotations

from typing import Any, Literal, Self

from pydantic import Field, StrictFloat, model_validator

from sink.contract.record_base import CaptureMode, DigestHex, DigestWireModel, Identifier, NonNegativeInt, WireModel
from sink.contract.record_schema import lineage_problem

__all__ = (
    "CallRecord",
    "CaptureLedgerCommit",
    "ManifestFailure",
    "RolloutManifest",
    "RolloutReceipt",
    "RolloutRemoval",
)


class CallRecord(DigestWireModel):
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
        if problem := lineage_problem(self.parent_call_id, self.prev_len, self.mode):
            raise ValueError(problem)
        return self


class CaptureLedgerCommit(WireModel):
    """One successfully staged call, as handed to ``CaptureLedger.record``.

    ``record`` is the manifest row. The remaining fields feed parent
    resolution and are not part of the manifest.
    """

    rollout_id: Identifier
    record: CallRecord
    staging_chain: tuple[Identifier, ...] = ()
    request_items: list[dict[str, Any]]
    response_items: list[dict[str, Any]]


class ManifestFailure(WireModel):
    """A call whose token capture did not complete."""

    model_call_id: Identifier
    reason: Identifier


class RolloutManifest(WireModel):
    """The token-free ledger read returned by the manifest control route."""

    rollout_id: Identifier
    records: list[CallRecord] = Field(default_factory=list)
    failures: list[ManifestFailure] = Field(default_factory=list)


class RolloutRemoval(WireModel):
    """The result of retiring or deleting rollouts in a capture store or ledger."""

    removed: list[Identifier] = Field(default_factory=list)
    absent: list[Identifier] = Field(default_factory=list)


class RolloutReceipt(DigestWireModel):
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
