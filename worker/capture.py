"""Per-call token capture inside an inference worker (contract §5).

:class:`RolloutTokenCapture` turns one admitted model call into one staged
delta and a token-free :class:`~sink.records.CommitCoords`. The pure steps
(argument checks, prefix checks, the record build, the coords) are shared by
the synchronous methods and their ``a``-prefixed async twins; only the I/O
(``source.fetch``, ``sink.stage``) differs. Operational failures never raise:
they return the failed coordinates of §5.8 and are logged.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio.to_thread

from sink.digest import is_token_id_list
from sink.records import CaptureAdmission, CommitCoords, StagedCallBaseSnapshot, StagedCallRecord, StageResult

from .call import ActiveCall, build_call_record, failed_coords
from .errors import CaptureError, PrefixResolutionError, StreamingUnsupportedError
from .generation_cut import check_cut_snapshot
from .prefix import verify_staging_chain
from .sequence_cache import SequenceHashCache

if TYPE_CHECKING:
    from .adapters import CaptureAdapter

__all__ = ("ActiveCall", "RolloutTokenCapture", "failed_coords")

logger = logging.getLogger(__name__)

_INT_ONLY = frozenset({int})


@dataclass
class _PendingChain:
    """A call whose prefix still has to be fetched from the staging chain."""

    admission: CaptureAdmission
    weight_version: int
    generation_cut: StagedCallBaseSnapshot | None

    def resolve(self, snapshots: Sequence[StagedCallBaseSnapshot]) -> ActiveCall:
        try:
            prefix = verify_staging_chain(self.admission, snapshots)
        except PrefixResolutionError as exc:
            return self.fail(str(exc))
        return ActiveCall(self.admission, self.weight_version, prefix, self.generation_cut)

    def fail(self, reason: str) -> ActiveCall:
        logger.warning(
            "capture disabled for rollout %s call %s: %s",
            self.admission.rollout_id,
            self.admission.model_call_id,
            reason,
        )
        return ActiveCall(self.admission, self.weight_version, [], self.generation_cut, capture_failure=reason)


@dataclass
class _Extracted:
    prompt_token_ids: list[int]
    generated_token_ids: list[int]
    generated_logprobs: list[float]
    extras: dict[str, Any] | None


def _validated_weight_version(value: object) -> int:
    if type(value) is not int or value < 0:
        raise CaptureError(f"weight version must be a non-negative int, got {value!r}")
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
    :param adapter: optional :class:`~worker.adapters.CaptureAdapter` for
        ``complete_call_from_response``.
    :param sequence_cache_rollouts: rollouts whose latest full sequence is kept packed, so a child
        re-packs only its own tokens for its cumulative hash (about 16 bytes per remembered token; 0 disables).
    :raises TypeError: *sink* has no callable ``stage``, *source* no callable
        ``fetch``, or *weight_version_fn* is not callable.
    """

    def __init__(
        self,
        *,
        sink: Any,
        weight_version_fn: Callable[[], int],
        source: Any = None,
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
        self._source_is_async = source is not None and inspect.iscoroutinefunction(source.fetch)
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

        :raises CaptureError: the provider returned anything but a non-negative int.
        """
        return _validated_weight_version(self._weight_version_fn())

    # --- begin -------------------------------------------------------------

    def _prepare(
        self,
        admission: CaptureAdmission,
        prefix_token_ids: list[int] | None,
        stream: bool,
        weight_version: int | None,
        generation_cut: StagedCallBaseSnapshot | None,
        generation_cut_staging_keys: Sequence[str] | None,
    ) -> ActiveCall | _PendingChain:
        """Steps 1–5 of §5.3; a by-reference prefix is left for the caller's fetch."""
        if not isinstance(admission, CaptureAdmission):
            raise TypeError(f"begin_call takes a CaptureAdmission, got {type(admission).__name__}")
        if stream:
            raise StreamingUnsupportedError("streaming capture is not supported (non-streaming, n == 1 only)")
        prefix: list[int] | None
        if admission.mode == "text":
            if prefix_token_ids is not None and _checked_explicit_prefix(prefix_token_ids):
                raise CaptureError("a text root takes no prefix")
            prefix = []
        elif prefix_token_ids is None:
            prefix = admission.required_prefix_token_ids or None
            if prefix is None and self._source is None:
                raise CaptureError("by-reference admission: the caller must pass the resolved prefix")
        else:
            prefix = _checked_explicit_prefix(prefix_token_ids)
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
        if prefix is None:
            return _PendingChain(admission, stamped, cut)
        return ActiveCall(admission, stamped, prefix, cut)

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
        pending = self._prepare(
            admission, prefix_token_ids, stream, weight_version, generation_cut, generation_cut_staging_keys
        )
        if isinstance(pending, ActiveCall):
            return pending
        if self._source_is_async:
            raise CaptureError("the configured source is asynchronous: use abegin_call")
        try:
            snapshots = self._source.fetch(list(admission.staging_chain))
        except Exception as exc:  # noqa: BLE001 -- any source failure disables capture of this call (§5.2)
            return pending.fail(f"staging chain fetch failed: {exc!r}")
        return pending.resolve(snapshots)

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
        pending = self._prepare(
            admission, prefix_token_ids, stream, weight_version, generation_cut, generation_cut_staging_keys
        )
        if isinstance(pending, ActiveCall):
            return pending
        keys = list(admission.staging_chain)
        try:
            if self._source_is_async:
                snapshots = await self._source.fetch(keys)
            else:
                snapshots = await anyio.to_thread.run_sync(self._source.fetch, keys)
        except Exception as exc:  # noqa: BLE001 -- cancellation is a BaseException and propagates
            return pending.fail(f"staging chain fetch failed: {exc!r}")
        return pending.resolve(snapshots)

    # --- completion --------------------------------------------------------

    def _failed(self, call: ActiveCall, reason: str) -> CommitCoords:
        admission = call.admission
        logger.warning(
            "capture failed for rollout %s call %s: %s", admission.rollout_id, admission.model_call_id, reason
        )
        return failed_coords(admission, weight_version=call.weight_version)

    def _start_completion(
        self,
        call: ActiveCall,
        prompt_token_ids: Sequence[int],
        generated_token_ids: Sequence[int],
        generated_logprobs: Sequence[float],
        extras: dict[str, Any] | None,
    ) -> StagedCallRecord | CommitCoords:
        """Claim the call and build its record, or return failed coords (§5.5 steps 1–2)."""
        if not isinstance(call, ActiveCall):
            raise TypeError(f"expected an ActiveCall, got {type(call).__name__}")
        call._claim()
        if call.capture_failure is not None:
            return self._failed(call, call.capture_failure)
        try:
            return build_call_record(
                call,
                prompt_token_ids=prompt_token_ids,
                generated_token_ids=generated_token_ids,
                generated_logprobs=generated_logprobs,
                extras=extras,
                sequence_cache=self._sequences,
            )
        except (TypeError, ValueError, OverflowError) as exc:
            return self._failed(call, f"record build failed: {exc}")

    def _finish_completion(self, call: ActiveCall, record: StagedCallRecord, result: object) -> CommitCoords:
        """Turn the sink's answer into coords (§5.5 steps 3–4)."""
        if not isinstance(result, StageResult):
            return self._failed(call, f"sink returned {type(result).__name__}, not a StageResult")
        if not result.ok or result.staging_key is None:
            return self._failed(call, f"sink rejected the record: {result.error}")
        return CommitCoords(
            rollout_id=record.rollout_id,
            model_call_id=record.model_call_id,
            parent_call_id=record.parent_call_id,
            prev_len=record.prev_len,
            delta_len=record.delta_len,
            cum_len=record.cum_len,
            weight_version=record.weight_version,
            disposition="staged",
            digest=record.digest,
            extras_digest=record.extras_digest,
            staging_key=result.staging_key,
            chain_hash=record.chain_hash,
            cumulative_hash=record.cumulative_hash,
        )

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
        if self._sink_is_async:
            raise CaptureError("the configured sink is asynchronous: use acomplete_call")
        outcome = self._start_completion(call, prompt_token_ids, generated_token_ids, generated_logprobs, extras)
        if isinstance(outcome, CommitCoords):
            return outcome
        try:
            result = self._sink.stage(outcome)
        except Exception as exc:  # noqa: BLE001 -- the worker catches every sink failure (§5.1)
            return self._failed(call, f"sink raised {exc!r}")
        return self._finish_completion(call, outcome, result)

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
        outcome = self._start_completion(call, prompt_token_ids, generated_token_ids, generated_logprobs, extras)
        if isinstance(outcome, CommitCoords):
            return outcome
        try:
            if self._sink_is_async:
                result = await self._sink.stage(outcome)
            else:
                result = await anyio.to_thread.run_sync(self._sink.stage, outcome)
        except Exception as exc:  # noqa: BLE001 -- cancellation is a BaseException and propagates
            return self._failed(call, f"sink raised {exc!r}")
        return self._finish_completion(call, outcome, result)

    def _extract(self, call: ActiveCall, response_payload: object) -> _Extracted | CommitCoords:
        """Run the adapter (§5.6); an extraction failure claims the call and fails it."""
        adapter = self._adapter
        if adapter is None:
            raise CaptureError("complete_call_from_response needs a capture adapter")
        if not isinstance(call, ActiveCall):
            raise TypeError(f"expected an ActiveCall, got {type(call).__name__}")
        try:
            prompt = adapter.extract_prompt_ids(response_payload)
            generated, logprobs = adapter.extract_generation(response_payload)
            extras = adapter.extract_extras(response_payload)
        except Exception as exc:  # noqa: BLE001 -- any adapter failure poisons, never fails the completion
            call._claim()
            return self._failed(call, f"adapter extraction failed: {exc!r}")
        return _Extracted(prompt, generated, logprobs, extras)

    def complete_call_from_response(self, call: ActiveCall, response_payload: object) -> CommitCoords:
        """Extract ids, log-probs and extras with the adapter, then :meth:`complete_call`.

        :raises CaptureError: no adapter, a second completion, or an async sink.
        """
        extracted = self._extract(call, response_payload)
        if isinstance(extracted, CommitCoords):
            return extracted
        return self.complete_call(
            call,
            prompt_token_ids=extracted.prompt_token_ids,
            generated_token_ids=extracted.generated_token_ids,
            generated_logprobs=extracted.generated_logprobs,
            extras=extracted.extras,
        )

    async def acomplete_call_from_response(self, call: ActiveCall, response_payload: object) -> CommitCoords:
        """Async twin of :meth:`complete_call_from_response`.

        :raises CaptureError: no adapter, or a second completion.
        """
        extracted = self._extract(call, response_payload)
        if isinstance(extracted, CommitCoords):
            return extracted
        return await self.acomplete_call(
            call,
            prompt_token_ids=extracted.prompt_token_ids,
            generated_token_ids=extracted.generated_token_ids,
            generated_logprobs=extracted.generated_logprobs,
            extras=extracted.extras,
        )

    def fail_call(self, call: ActiveCall, *, reason: str) -> CommitCoords:
        """Claim the call and acknowledge it as not captured (§5.6); *reason* is only logged.

        :raises CaptureError: the call was already completed.
        """
        if not isinstance(call, ActiveCall):
            raise TypeError(f"expected an ActiveCall, got {type(call).__name__}")
        call._claim()
        return self._failed(call, f"host failed the call: {reason}")

    async def afail_call(self, call: ActiveCall, *, reason: str) -> CommitCoords:
        """Async twin of :meth:`fail_call` (no I/O).

        :raises CaptureError: the call was already completed.
        """
        return self.fail_call(call, reason=reason)

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
