"""Per-call token capture inside an inference worker (contract §5).

:class:`RolloutTokenCapture` turns one admitted model call into one staged
delta and a token-free :class:`~sink.contract.records.CommitCoords`. The pure steps
(argument checks, prefix checks, the record build, the coords) are written
once, as step generators that yield their single I/O request
(``source.fetch`` or ``sink.stage``); the sync methods and their ``a``-prefixed async twins differ only in the
driver that performs it (:mod:`worker.io_steps`). Operational failures return the failed coordinates of §5.8 and
are logged: a ``StagingError`` of the sink or source, a missing chain key, a record that cannot be built, an
``EnginePayloadError``. Anything else is a bug and propagates to the host's per-request boundary.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol, cast

from sink.contract.digest import is_token_id_list
from sink.contract.digest_encoding import is_u64
from sink.contract.packed import PackedSnapshot
from sink.contract.packed_record import StageableRecord
from sink.contract.protocols import AsyncStagingSink, AsyncStagingSource, StagingSink, StagingSource
from sink.contract.records import (
    CaptureAdmission,
    CommitCoords,
    StagedCallBaseSnapshot,
    StagedCallRecord,
    StageResult,
)
from sink.errors import StagingError
from sink.store.commit import FollowUp
from worker.call import ActiveCall, build_call_record, failed_coords, staged_coords
from worker.errors import CaptureError, EnginePayloadError, PrefixResolutionError, StreamingUnsupportedError
from worker.generation_cut import check_cut_snapshot
from worker.io_steps import IoRequest, Steps, run_async, run_blocking
from worker.prefix import fetch_operation, verify_staging_chain
from worker.sequence_cache import ProvenSequence, RememberedCall, SequenceHashCache

if TYPE_CHECKING:
    from worker.capture_adapter import CaptureAdapter

__all__ = ("RolloutTokenCapture", "StageFollowUp")

logger = logging.getLogger(__name__)

_INT_ONLY = frozenset({int})
_FETCH_ERRORS = (StagingError, KeyError)  # unreachable, refused or corrupt; a missing key (``StagingSource.fetch``)


_ASYNC_SOURCE = "the configured source is asynchronous: use abegin_call"


class _FollowUpSink(Protocol):
    async def stage(self, record: StageableRecord, *, then: FollowUp | None = None) -> StageResult: ...


StageFollowUp = Callable[[CommitCoords], FollowUp | None]
"""Given the coordinates a call has once staged, the write to send behind its stage (or ``None``)."""
_ASYNC_SINK = "the configured sink is asynchronous: use acomplete_call"


@dataclass(frozen=True, slots=True)
class _Completion:
    """What the engine produced for one call (given directly or extracted by the adapter)."""

    prompt_token_ids: Sequence[int]
    generated_token_ids: Sequence[int]
    generated_logprobs: Sequence[float]
    extras: dict[str, Any] | None


def _uncaptured(
    admission: CaptureAdmission, weight_version: int, cut: StagedCallBaseSnapshot | None, reason: str
) -> ActiveCall:
    """A call served without capture because its prefix did not resolve (completing it returns failed coords)."""
    logger.warning("capture disabled for rollout %s call %s: %s", admission.rollout_id, admission.model_call_id, reason)
    return ActiveCall(admission, weight_version, [], cut, capture_failure=reason)


def _snapshot_extras(snapshot: object) -> dict[str, Any] | None:
    """The extras of a fetched parent record (a model snapshot without them: ``None``)."""
    return snapshot.extras if isinstance(snapshot, PackedSnapshot | StagedCallRecord) else None


def _validated_weight_version(value: object) -> int:
    if not is_u64(value):
        raise CaptureError(f"weight version must be an int in [0, 2**64) (the record's u64), got {value!r}")
    return value


def _checked_explicit_prefix(prefix: object) -> list[int]:
    if type(prefix) is not list:
        raise CaptureError("prefix_token_ids must be a list of non-negative ints")
    if is_token_id_list(prefix):
        return prefix
    if not set(map(type, prefix)) <= _INT_ONLY or (prefix and min(prefix) < 0):
        raise CaptureError("prefix_token_ids must be a list of non-negative ints")
    return prefix


class RolloutTokenCapture:
    """The per-call capture lifecycle of an inference worker (contract §5.3–§5.8).

    :param sink: a ``StagingSink`` (sync) or ``AsyncStagingSink``; the sync
        methods need a sync sink, the async twins accept either (a sync sink
        runs in a worker thread).
    :param weight_version_fn: returns the trainer-owned policy version.
    :param source: optional ``StagingSource`` / ``AsyncStagingSource`` used to
        resolve ``staging_chain`` admissions inside ``begin_call``.
    :param adapter: optional :class:`~worker.capture_adapter.CaptureAdapter` for
        ``complete_call_from_response``.
    :param sequence_cache_rollouts: rollouts whose recent full sequences are kept proved and packed, so a
        child whose prefix and prompt repeat its parent's ids proves them in one ``marshal`` pass each and
        packs only its own tokens (about 13 bytes per remembered token; 0 disables).
    :raises TypeError: *sink* has no callable ``stage``, *source* no callable
        ``fetch``, or *weight_version_fn* is not callable.
    """

    def __init__(
        self,
        *,
        sink: StagingSink | AsyncStagingSink,
        weight_version_fn: Callable[[], int],
        source: StagingSource | AsyncStagingSource | None = None,
        adapter: CaptureAdapter | None = None,
        sequence_cache_rollouts: int = 64,
    ) -> None:
        if not callable(getattr(sink, "stage", None)):
            raise TypeError(f"sink must have a callable stage(record), got {type(sink).__name__}")
        if not callable(weight_version_fn):
            raise TypeError("weight_version_fn must be callable")
        if source is not None and not callable(getattr(source, "fetch", None)):
            raise TypeError(f"source must have a callable fetch(keys), got {type(source).__name__}")
        self._sink = sink
        self._sink_is_async = inspect.iscoroutinefunction(sink.stage)
        self._source = source
        self._fetch = None if source is None else fetch_operation(source)
        self._source_is_async = self._fetch is not None and inspect.iscoroutinefunction(self._fetch)
        self._weight_version_fn = weight_version_fn
        self._adapter = adapter
        # Children re-pack only their own tokens for the cumulative hash (0 disables the cache).
        self._sequences = SequenceHashCache(sequence_cache_rollouts) if sequence_cache_rollouts > 0 else None

    def __repr__(self) -> str:
        return f"<RolloutTokenCapture sink={type(self._sink).__name__} source={type(self._source).__name__}>"

    @property
    def adapter(self) -> CaptureAdapter | None:
        """The engine payload adapter, if any."""
        return self._adapter

    def current_weight_version(self) -> int:
        """The provider's current weight version, validated (§5.1).

        :raises CaptureError: the provider returned anything but an int in ``[0, 2**64)``.
        """
        return _validated_weight_version(self._weight_version_fn())

    # --- begin ---------------------------------------------------------------

    def _begin_steps(
        self,
        admission: CaptureAdmission,
        prefix_token_ids: list[int] | None,
        stream: bool,
        weight_version: int | None,
        generation_cut: StagedCallBaseSnapshot | None,
        generation_cut_staging_keys: Sequence[str] | None,
    ) -> Steps[ActiveCall]:
        """§5.3: check the arguments, stamp the weight version, resolve the prefix (a fetch when by reference)."""
        if not isinstance(admission, CaptureAdmission):
            raise TypeError(f"begin_call takes a CaptureAdmission, got {type(admission).__name__}")
        if stream:
            raise StreamingUnsupportedError("streaming capture is not supported (non-streaming, n == 1 only)")
        prefix: list[int] | None
        proof: ProvenSequence | None = None
        if admission.mode == "text":
            if prefix_token_ids is not None and _checked_explicit_prefix(prefix_token_ids):
                raise CaptureError("a text root takes no prefix")
            prefix = []
        elif prefix_token_ids is None:
            prefix = admission.required_prefix_token_ids or None
            if prefix is None and self._source is None:
                raise CaptureError("by-reference admission: the caller must pass the resolved prefix")
        else:
            prefix, proof = self._explicit_prefix(admission, prefix_token_ids)
            if len(prefix) != admission.prev_len:
                raise CaptureError(f"prefix has {len(prefix)} ids, admission prev_len is {admission.prev_len}")
            inline = admission.required_prefix_token_ids
            if inline and inline != prefix:
                raise CaptureError("explicit prefix differs from the admission's inline prefix")
        stamped = _validated_weight_version(self._weight_version_fn() if weight_version is None else weight_version)
        cut: StagedCallBaseSnapshot | None = None
        if admission.generation_cut is not None:
            if generation_cut is None:
                raise CaptureError("a generation-cut admission needs the rebuilt prefix snapshot")
            cut = check_cut_snapshot(admission, generation_cut, generation_cut_staging_keys, stamped)
        elif generation_cut is not None or generation_cut_staging_keys is not None:
            raise CaptureError("a generation-cut snapshot needs an admission with generation_cut set")
        parent_extras: dict[str, Any] | None = None
        verified: tuple[str, ...] | None = () if admission.mode == "text" else None
        if prefix is None:
            fetch = self._fetch
            if fetch is None:  # ruled out above: a by-reference admission without a source raises
                raise CaptureError("by-reference admission: the caller must pass the resolved prefix")
            remembered = self._remembered_parent(admission)
            if remembered is not None:  # a parent this capture built: its own record is enough (§5.9)
                try:
                    parents = yield IoRequest(fetch, admission.staging_chain[-1:], self._source_is_async, _FETCH_ERRORS)
                except _FETCH_ERRORS:  # the whole chain is fetched below, and its failure reported as before
                    parents = None
                if parents is not None and len(parents) == 1 and remembered.is_record(parents[0]):
                    extras = _snapshot_extras(parents[0])
                    chain = tuple(admission.staging_chain)
                    return ActiveCall(
                        admission,
                        stamped,
                        None,
                        cut,
                        parent_extras=extras,
                        verified_chain=chain,
                        _prefix_proof=remembered.proof,
                    )
            try:
                snapshots = yield IoRequest(fetch, list(admission.staging_chain), self._source_is_async, _FETCH_ERRORS)
            except _FETCH_ERRORS as exc:  # the source failed: capture of this call is disabled (§5.2)
                return _uncaptured(admission, stamped, cut, f"staging chain fetch failed: {exc!r}")
            try:
                prefix = verify_staging_chain(admission, snapshots)
            except PrefixResolutionError as exc:
                return _uncaptured(admission, stamped, cut, str(exc))
            parent_extras = _snapshot_extras(snapshots[-1])
            verified = tuple(admission.staging_chain)
        return ActiveCall(
            admission,
            stamped,
            prefix,
            cut,
            parent_extras=parent_extras,
            verified_chain=verified,
            _prefix_proof=proof,
        )

    def _remembered_parent(self, admission: CaptureAdmission) -> RememberedCall | None:
        """The parent of a by-reference *admission*, when this capture built it and remembers its sequence."""
        sequences = self._sequences
        if sequences is None or admission.generation_cut is not None:
            return None
        return sequences.parent_of(admission)

    def _explicit_prefix(
        self, admission: CaptureAdmission, prefix_token_ids: object
    ) -> tuple[list[int], ProvenSequence | None]:
        """A ``token_in`` call's explicit prefix, checked (§5.3), and the proof that checked it, if any.

        A prefix the parent's remembered sequence holds is proved in one pass and copied, so later changes
        to the caller's list cannot reach the call (:meth:`~worker.sequence_cache.SequenceHashCache.proved_copy`);
        otherwise the reference type gate decides.

        :raises CaptureError: the prefix is not a list of non-negative exact ints.
        """
        sequences = self._sequences
        proved = None if sequences is None else sequences.proved_copy(admission, prefix_token_ids)
        return proved if proved is not None else (_checked_explicit_prefix(prefix_token_ids), None)

    def begin_call(
        self,
        admission: CaptureAdmission,
        *,
        prefix_token_ids: list[int] | None = None,
        stream: bool = False,
        weight_version: int | None = None,
        generation_cut: StagedCallBaseSnapshot | None = None,
        generation_cut_staging_keys: Sequence[str] | None = None,
    ) -> ActiveCall:
        """Admit one call: check arguments, stamp the weight version, resolve the prefix (§5.3).

        A by-reference admission without an explicit prefix is resolved from
        the configured source; if that fails, the returned call has
        ``capture_failed`` set (serve it uncaptured; completing it returns
        failed coordinates).

        :raises TypeError: *admission* is not a :class:`CaptureAdmission`.
        :raises StreamingUnsupportedError: ``stream=True``.
        :raises GenerationCutError: the cut snapshot does not match (§9.4).
        :raises CaptureError: any other invalid argument, or an async source.
        """
        steps = self._begin_steps(
            admission, prefix_token_ids, stream, weight_version, generation_cut, generation_cut_staging_keys
        )
        return run_blocking(steps, _ASYNC_SOURCE)

    async def abegin_call(
        self,
        admission: CaptureAdmission,
        *,
        prefix_token_ids: list[int] | None = None,
        stream: bool = False,
        weight_version: int | None = None,
        generation_cut: StagedCallBaseSnapshot | None = None,
        generation_cut_staging_keys: Sequence[str] | None = None,
    ) -> ActiveCall:
        """Async twin of :meth:`begin_call` (a sync source runs in a worker thread).

        :raises TypeError: as :meth:`begin_call`.
        :raises CaptureError: as :meth:`begin_call`.
        """
        steps = self._begin_steps(
            admission, prefix_token_ids, stream, weight_version, generation_cut, generation_cut_staging_keys
        )
        return await run_async(steps)

    # --- completion --------------------------------------------------------

    def _failed(self, call: ActiveCall, reason: str) -> CommitCoords:
        admission = call.admission
        logger.warning(
            "capture failed for rollout %s call %s: %s", admission.rollout_id, admission.model_call_id, reason
        )
        return failed_coords(admission, weight_version=call.weight_version)

    def _completion_steps(
        self, call: ActiveCall, completion: _Completion, then: StageFollowUp | None = None
    ) -> Steps[CommitCoords]:
        """§5.5: claim the call, build its record, stage it, turn the sink's answer into coords."""
        if not isinstance(call, ActiveCall):
            raise TypeError(f"expected an ActiveCall, got {type(call).__name__}")
        call.claim()
        if call.capture_failure is not None:
            return self._failed(call, call.capture_failure)
        try:
            record = build_call_record(
                call,
                prompt_token_ids=completion.prompt_token_ids,
                generated_token_ids=completion.generated_token_ids,
                generated_logprobs=completion.generated_logprobs,
                extras=completion.extras,
                sequence_cache=self._sequences,
            )
        except (TypeError, ValueError, OverflowError) as exc:
            return self._failed(call, f"record build failed: {exc}")
        stage: Callable[[Any], Any] = self._sink.stage
        follow_up = None if then is None else then(staged_coords(record, record.staging_key))
        if follow_up is not None:  # the caller gave *then* for a sink whose stage takes it (the Redis sink)
            stage = partial(cast(_FollowUpSink, self._sink).stage, then=follow_up)
        try:
            result = yield IoRequest(stage, record, self._sink_is_async)
        except StagingError as exc:  # the sink could not stage (unreachable, refused): the call is recorded failed
            return self._failed(call, f"sink raised {exc!r}")
        if not isinstance(result, StageResult):
            return self._failed(call, f"sink returned {type(result).__name__}, not a StageResult")
        if not result.ok or result.staging_key is None:
            return self._failed(call, f"sink rejected the record: {result.error}")
        return staged_coords(record, result.staging_key)

    def _complete_blocking(self, call: ActiveCall, completion: _Completion) -> CommitCoords:
        if self._sink_is_async:  # checked before the call is claimed, so the async twin can still complete it
            raise CaptureError(_ASYNC_SINK)
        return run_blocking(self._completion_steps(call, completion), _ASYNC_SINK)

    def complete_call(
        self,
        call: ActiveCall,
        *,
        prompt_token_ids: Sequence[int],
        generated_token_ids: Sequence[int],
        generated_logprobs: Sequence[float],
        extras: dict[str, Any] | None = None,
    ) -> CommitCoords:
        """Build, stage and acknowledge one call (§5.5); failures return failed coords.

        :raises CaptureError: the call was already completed, or the sink is async.
        """
        completion = _Completion(prompt_token_ids, generated_token_ids, generated_logprobs, extras)
        return self._complete_blocking(call, completion)

    async def acomplete_call(
        self,
        call: ActiveCall,
        *,
        prompt_token_ids: Sequence[int],
        generated_token_ids: Sequence[int],
        generated_logprobs: Sequence[float],
        extras: dict[str, Any] | None = None,
    ) -> CommitCoords:
        """Async twin of :meth:`complete_call` (a sync sink runs in a worker thread).

        :raises CaptureError: the call was already completed.
        """
        completion = _Completion(prompt_token_ids, generated_token_ids, generated_logprobs, extras)
        return await run_async(self._completion_steps(call, completion))

    def _extract(
        self, call: ActiveCall, response_payload: object, adapter: CaptureAdapter | None
    ) -> _Completion | CommitCoords:
        """Run the adapter (§5.6); an :class:`EnginePayloadError` claims the call and fails it."""
        adapter = adapter or self._adapter
        if adapter is None:
            raise CaptureError("complete_call_from_response needs a capture adapter")
        if not isinstance(call, ActiveCall):
            raise TypeError(f"expected an ActiveCall, got {type(call).__name__}")
        try:
            prompt = adapter.extract_prompt_ids(response_payload)
            generated, logprobs = adapter.extract_generation(response_payload)
            extras = adapter.extract_extras(response_payload)
        except EnginePayloadError as exc:  # the payload cannot be read: the call is recorded failed (§5.6)
            call.claim()
            return self._failed(call, f"malformed engine payload: {exc}")
        return _Completion(prompt, generated, logprobs, extras)

    def complete_call_from_response(
        self, call: ActiveCall, response_payload: object, *, adapter: CaptureAdapter | None = None
    ) -> CommitCoords:
        """Extract ids, log-probs and extras with *adapter* (default: the capture's), then :meth:`complete_call`.

        :raises CaptureError: no adapter, a second completion, or an async sink.
        """
        extracted = self._extract(call, response_payload, adapter)
        if isinstance(extracted, CommitCoords):
            return extracted
        return self._complete_blocking(call, extracted)

    async def acomplete_call_from_response(
        self,
        call: ActiveCall,
        response_payload: object,
        *,
        adapter: CaptureAdapter | None = None,
        then: StageFollowUp | None = None,
    ) -> CommitCoords:
        """Async twin of :meth:`complete_call_from_response`.

        *then*: given the coordinates the call has once its record is staged, a write to send behind the stage in
        its round trip (the sink's ``stage(record, then=...)``: an :class:`~sink.store.sink.AsyncRedisStagingSink`),
        or ``None`` to stage alone; the capture proxy sends the call's ledger row this way (contract §6.6).

        :raises CaptureError: no adapter, or a second completion.
        """
        extracted = self._extract(call, response_payload, adapter)
        if isinstance(extracted, CommitCoords):
            return extracted
        return await run_async(self._completion_steps(call, extracted, then))

    def fail_call(self, call: ActiveCall, *, reason: str) -> CommitCoords:
        """Claim the call and acknowledge it as not captured (§5.6); *reason* is only logged.

        :raises CaptureError: the call was already completed.
        """
        if not isinstance(call, ActiveCall):
            raise TypeError(f"expected an ActiveCall, got {type(call).__name__}")
        call.claim()
        return self._failed(call, f"host failed the call: {reason}")

    def fail_admission(self, admission: CaptureAdmission, *, reason: str) -> CommitCoords:
        """Failed coords for an admission whose ``begin_call`` never ran (provider's current version).

        :raises CaptureError: the provider returned an invalid weight version.
        """
        logger.warning(
            "capture failed before begin for rollout %s call %s: %s",
            admission.rollout_id,
            admission.model_call_id,
            reason,
        )
        return failed_coords(admission, weight_version=self.current_weight_version())
