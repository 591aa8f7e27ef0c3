"""The gate side of capture: admission and commit (contract §6.6).

The model server's middleware uses a :class:`CaptureGate` around every
captured model call: :meth:`~CaptureGate.admit` resolves the parent call in
the ledger and returns the admission to attach to the engine request (or
``None``: serve the call uncaptured); :meth:`~CaptureGate.commit` validates
the worker's commit coordinates and records the token-free ledger row, or a
failure row that poisons the rollout. A capture failure never fails the model
call (INV-4); only a failing ledger read does (§6.6 step 2).

With a multi-chain policy (contract §14.1; the gate's default or one rollout's opt-in), a request that
continues no committed call starts a new chain: it is admitted as a ``text`` root instead of being recorded as
``unresolved_parent``, and the policy is recorded in the rollout's ledger for the assembler.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from pydantic import ValidationError

from sink.contract.chains import ChainPolicy
from sink.contract.fingerprint import FINGERPRINT_VERSION, assistant_fingerprint
from sink.contract.records import (
    INVALID_COMMIT_COORDS_REASON,
    UNCOMMITTED_CALL_REASON,
    UNRESOLVED_PARENT_REASON,
    WORKER_CAPTURE_FAILED_REASON,
    WORKER_MISSING_COMMIT_COORDS_REASON,
    CallRecord,
    CaptureAdmission,
    CaptureLedgerCommit,
    CommitCoords,
)
from sink.errors import RolloutRetiredError
from sink.keys import check_call_id
from sink.ledger.lineage import AMBIGUOUS_REASON, NO_MATCH_REASON, LineageResolution, LineageStatus
from sink.ledger.ownership import is_call_staging_key

__all__ = ("CaptureGate", "CaptureLedgerProtocol", "new_model_call_id")

logger = logging.getLogger(__name__)

_POLICIES_REMEMBERED = 65_536


class CaptureLedgerProtocol(Protocol):
    """What the gate needs from a capture ledger (Redis or in-memory)."""

    async def resolve(self, rollout_id: str, request_items: Sequence[dict[str, Any]]) -> LineageResolution: ...

    async def has_rows(self, rollout_id: str) -> bool: ...

    async def chain_policy(self, rollout_id: str) -> ChainPolicy: ...

    async def record(self, commit: CaptureLedgerCommit) -> None: ...

    async def record_failure(
        self, rollout_id: str, model_call_id: str, reason: str, *, parent_call_id: str | None = None, root: bool = False
    ) -> None: ...

    async def record_chain_policy(self, rollout_id: str, policy: ChainPolicy) -> ChainPolicy | None: ...


@dataclass(frozen=True, slots=True)
class _Refused:
    """Coordinates the gate records as a failure row: the reason, and what to log (nothing for the worker's own
    failure reports)."""

    reason: str
    verb: str = ""
    cause: Exception | None = None


def new_model_call_id() -> str:
    """A fresh model call id (uuid4 hex), as the gate mints them."""
    return uuid.uuid4().hex


def _fingerprint_or_none(items: Sequence[dict[str, Any]]) -> str | None:
    return assistant_fingerprint(items) or None


def _unresolved_cause(resolution: LineageResolution) -> str:
    if resolution.reason == AMBIGUOUS_REASON:
        return f"ambiguous: candidates {', '.join(resolution.candidates)}"
    if resolution.reason == NO_MATCH_REASON:
        return "no_match: no committed call's reply and context match the request"
    return resolution.reason or "unknown"


class CaptureGate:
    """Admission and commit for one gate process over a shared capture ledger."""

    def __init__(self, ledger: CaptureLedgerProtocol, *, chain_policy: ChainPolicy = ChainPolicy.SINGLE) -> None:
        self._ledger = ledger
        self._chain_policy = ChainPolicy(chain_policy)
        self._policy_recorded: dict[str, None] = {}  # rollouts whose policy row this gate wrote (bounded)

    @property
    def chain_policy(self) -> ChainPolicy:
        """The policy of rollouts that do not opt in themselves (contract §14.1)."""
        return self._chain_policy

    async def admit(
        self,
        rollout_id: str,
        request_items: Sequence[dict[str, Any]],
        *,
        model_call_id: str | None = None,
        chain_policy: ChainPolicy | None = None,
    ) -> CaptureAdmission | None:
        """Resolve the request's parent and build its admission (contract §6.6 steps 1-6, §14.1).

        :param chain_policy: this rollout's opt-in; default the gate's policy. Either way the rollout's first
            recorded multi-chain policy wins (§14.1): a later call without the opt-in, or with another value, follows
            it (read only when the request extends no earlier call, the one case where the policy matters here).
        :returns: a ``text`` root or a by-reference ``token_in`` admission, or
            ``None`` when the call must be served uncaptured (retired rollout,
            or an unresolved parent under ``single``, recorded as ``unresolved_parent``).
        :raises InvalidCallIdError: *model_call_id* contains ``/cut/`` (it would collide with a cut key).
        :raises StagingError: the ledger could not be read (the request fails).
        """
        call_id = check_call_id(model_call_id or new_model_call_id())
        policy = self._chain_policy if chain_policy is None else ChainPolicy(chain_policy)
        if policy is not ChainPolicy.SINGLE and rollout_id not in self._policy_recorded:
            if await self._ledger.record_chain_policy(rollout_id, policy) is None:
                return None  # retired
            self._policy_recorded[rollout_id] = None
            while len(self._policy_recorded) > _POLICIES_REMEMBERED:
                del self._policy_recorded[next(iter(self._policy_recorded))]
        resolution = await self._ledger.resolve(rollout_id, request_items)
        if resolution.status is LineageStatus.ROOT:
            return CaptureAdmission(rollout_id=rollout_id, model_call_id=call_id, mode="text")
        if resolution.status is LineageStatus.RESOLVED:
            match = resolution.match
            assert match is not None
            return CaptureAdmission(
                rollout_id=rollout_id,
                model_call_id=call_id,
                parent_call_id=match.model_call_id,
                prev_len=match.prev_len,
                mode="token_in",
                staging_chain=list(match.staging_chain),
                parent_chain_hash=match.chain_hash,
            )
        try:
            has_rows = await self._ledger.has_rows(rollout_id)
            if has_rows and policy is ChainPolicy.SINGLE:  # no opt-in with this call: the first recorded one wins
                policy = await self._ledger.chain_policy(rollout_id)
        except RolloutRetiredError:
            return None
        if not has_rows or policy is not ChainPolicy.SINGLE:
            # Seeded history on a fresh rollout (§6.6 step 5), or a call that extends no earlier call in a
            # multi-chain rollout: a new root whose prompt is staged in full (§14.1).
            return CaptureAdmission(rollout_id=rollout_id, model_call_id=call_id, mode="text")
        # Never silently turn an unresolved continuation into a root (§6.6 step 6).
        logger.warning(
            "rollout %s call %s: unresolved parent (%s); recorded %s",
            rollout_id,
            call_id,
            _unresolved_cause(resolution),
            UNRESOLVED_PARENT_REASON,
        )
        await self._ledger.record_failure(rollout_id, call_id, UNRESOLVED_PARENT_REASON)
        return None

    async def admit_new_chain(
        self, rollout_id: str, *, model_call_id: str | None = None, chain_policy: ChainPolicy | None = None
    ) -> CaptureAdmission | None:
        """A ``text`` root for a call that must not continue the parent its items resolve to (exact-prefix mode: the
        conversation before that parent's reply changed), when the rollout's policy starts new chains (contract §14.1).

        :param chain_policy: this rollout's opt-in; default the gate's policy.
        :returns: the root admission, or ``None`` under ``single`` (the caller records the call failed).
        :raises InvalidCallIdError: *model_call_id* contains ``/cut/``.
        """
        policy = self._chain_policy if chain_policy is None else ChainPolicy(chain_policy)
        if policy is ChainPolicy.SINGLE:
            return None
        call_id = check_call_id(model_call_id or new_model_call_id())
        return CaptureAdmission(rollout_id=rollout_id, model_call_id=call_id, mode="text")

    async def commit(
        self,
        admission: CaptureAdmission,
        coords: CommitCoords | Mapping[str, Any] | None,
        *,
        response_id: str,
        request_items: Sequence[dict[str, Any]],
        response_items: Sequence[dict[str, Any]],
        admitted_at: float | None = None,
    ) -> CallRecord | None:
        """Record the worker's coordinates as a ledger row (contract §6.6 commit steps 3-11).

        :returns: the committed row, or ``None`` when a failure row was written instead.
        :raises StagingError: the ledger could not be written.
        """
        rollout_id, call_id = admission.rollout_id, admission.model_call_id
        parent, root = admission.parent_call_id, admission.mode == "text"
        planned = self._planned(admission, coords, response_id, request_items, response_items, admitted_at)
        if isinstance(planned, _Refused):
            if planned.cause is not None:
                logger.warning("%s %s/%s: %s", planned.verb, rollout_id, call_id, planned.cause)
            await self._ledger.record_failure(rollout_id, call_id, planned.reason, parent_call_id=parent, root=root)
            return None
        try:
            await self._ledger.record(planned)
        except ValueError as exc:
            # Step 10 failed without a connection problem: items the ledger cannot
            # fingerprint, or a conflicting row. Poison the rollout; never fail the call (INV-4).
            logger.warning("cannot commit %s/%s: %s", rollout_id, call_id, exc)
            await self._ledger.record_failure(
                rollout_id, call_id, INVALID_COMMIT_COORDS_REASON, parent_call_id=parent, root=root
            )
            return None
        return planned.record

    def planned_commit(
        self,
        admission: CaptureAdmission,
        coords: CommitCoords,
        *,
        response_id: str,
        request_items: Sequence[dict[str, Any]],
        response_items: Sequence[dict[str, Any]],
        admitted_at: float | None = None,
    ) -> CaptureLedgerCommit | None:
        """The ledger commit :meth:`commit` would record for *coords* (the same arguments), or ``None`` when it would
        record a failure row instead; nothing is written or logged. A caller that sends the row itself (behind the
        call's stage, in one round trip: contract §6.6) still calls :meth:`commit` whenever that row was not
        confirmed appended: a row already appended is a no-op there.
        """
        planned = self._planned(admission, coords, response_id, request_items, response_items, admitted_at)
        return None if isinstance(planned, _Refused) else planned

    def _planned(
        self,
        admission: CaptureAdmission,
        coords: CommitCoords | Mapping[str, Any] | None,
        response_id: str,
        request_items: Sequence[dict[str, Any]],
        response_items: Sequence[dict[str, Any]],
        admitted_at: float | None,
    ) -> CaptureLedgerCommit | _Refused:
        """Steps 3-9: the custody commit of *coords*, or the failure to record instead (and what to log)."""
        if coords is None:
            return _Refused(WORKER_MISSING_COMMIT_COORDS_REASON)
        try:
            parsed = coords if isinstance(coords, CommitCoords) else CommitCoords.model_validate(coords)
            if (parsed.rollout_id, parsed.model_call_id) != (admission.rollout_id, admission.model_call_id):
                raise ValueError("coordinates name another call")
            if parsed.staging_key is not None and not is_call_staging_key(
                parsed.staging_key, admission.rollout_id, admission.model_call_id
            ):
                raise ValueError(f"coordinates name staging key {parsed.staging_key!r}, not a key of this call")
        except (ValidationError, ValueError, TypeError) as exc:
            return _Refused(INVALID_COMMIT_COORDS_REASON, "invalid commit coordinates for", exc)
        if parsed.disposition == "capture_failed":
            return _Refused(WORKER_CAPTURE_FAILED_REASON)
        try:
            row = self._call_record(admission, parsed, response_id, request_items, response_items, admitted_at)
        except (ValidationError, ValueError, TypeError) as exc:
            return _Refused(INVALID_COMMIT_COORDS_REASON, "cannot commit", exc)
        assert parsed.staging_key is not None
        return CaptureLedgerCommit(
            rollout_id=admission.rollout_id,
            record=row,
            staging_chain=(*admission.staging_chain, parsed.staging_key),
            request_items=list(request_items),
            response_items=list(response_items),
        )

    async def fail_unadmitted(self, rollout_id: str, cause: str) -> str:
        """Record a call of *rollout_id* that could not even be admitted (a request body the gate cannot read, served
        anyway under fail-open): a fresh call id with the failure ``worker_capture_failed``, so the rollout is
        poisoned. *cause* is only logged. Returns the call id.

        :raises ValueError: an invalid rollout id.
        :raises StagingError: the ledger could not be written.
        """
        call_id = new_model_call_id()
        logger.warning("rollout %s call %s: %s; recorded %s", rollout_id, call_id, cause, WORKER_CAPTURE_FAILED_REASON)
        await self._ledger.record_failure(rollout_id, call_id, WORKER_CAPTURE_FAILED_REASON)
        return call_id

    async def abandon(self, admission: CaptureAdmission) -> None:
        """Record an admitted call that ended without coordinates (contract §6.6 commit step 12).

        :raises StagingError: the ledger could not be written.
        """
        await self._ledger.record_failure(
            admission.rollout_id,
            admission.model_call_id,
            UNCOMMITTED_CALL_REASON,
            parent_call_id=admission.parent_call_id,
            root=admission.mode == "text",
        )

    @staticmethod
    def _call_record(
        admission: CaptureAdmission,
        coords: CommitCoords,
        response_id: str,
        request_items: Sequence[dict[str, Any]],
        response_items: Sequence[dict[str, Any]],
        admitted_at: float | None,
    ) -> CallRecord:
        if (coords.parent_call_id, coords.prev_len) != (admission.parent_call_id, admission.prev_len):
            raise ValueError("coordinates disagree with the admission's parent or prev_len")
        if not response_id:
            raise ValueError("the served response has no id")
        try:
            output_fp = _fingerprint_or_none(response_items)
            continuation_fp = _fingerprint_or_none([*request_items, *response_items])
        except ValueError:
            output_fp = continuation_fp = None
        return CallRecord(
            model_call_id=coords.model_call_id,
            parent_call_id=coords.parent_call_id,
            prev_len=coords.prev_len,
            delta_len=coords.delta_len,
            cum_len=coords.cum_len,
            weight_version=coords.weight_version,
            digest=coords.digest,
            extras_digest=coords.extras_digest,
            staging_key=coords.staging_key,
            mode=admission.mode,
            chain_hash=coords.chain_hash,
            cumulative_hash=coords.cumulative_hash,
            response_id=response_id,
            admitted_at=admitted_at,
            output_fingerprint=output_fp,
            continuation_fingerprint=continuation_fp,
            fingerprint_version=FINGERPRINT_VERSION,
        )
