"""Generation-cut continuation: stage a partial generation at a checkpoint, continue it after restore (contract §9).

At a checkpoint the worker stages, per in-flight call, a cumulative prefix
record (:func:`build_prefix_record`) and later generated-only chunk records
(:func:`build_generation_chunk_record`), and acknowledges them with a
:class:`~sink.contract.records.GenerationCutContinuation` (:func:`build_cut_continuation`).
After restore, the replacement attempt's admission carries that continuation:
the host fetches and rebuilds the prefix (:func:`fetch_cut_prefix` /
:func:`rebuild_cut_prefix`), passes it to ``begin_call`` (which runs
:func:`check_cut_snapshot`), asks :func:`plan_cut_continuation` for the engine
prompt and the remaining budget, and completes the call as usual. On any
:class:`~worker.errors.GenerationCutError` the host drops the cut
(:func:`drop_generation_cut`) and regenerates.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

from sink.contract.digest import EMPTY_EXTRAS_DIGEST, compute_chain_hash, hash_token_ids
from sink.contract.records import (
    CaptureAdmission,
    GenerationCutContinuation,
    StagedCallBaseSnapshot,
    StagedCallRecord,
)
from worker.call import ActiveCall, build_call_record
from worker.errors import CaptureError, GenerationCutError
from worker.prefix import inline_prefix

__all__ = (
    "CUT_DECODE_WINDOW",
    "CutContinuationPlan",
    "afetch_cut_prefix",
    "build_cut_continuation",
    "build_generation_chunk_record",
    "build_prefix_record",
    "check_cut_snapshot",
    "cut_refusal_reason",
    "drop_generation_cut",
    "fetch_cut_prefix",
    "plan_cut_continuation",
    "rebuild_cut_prefix",
)

CUT_DECODE_WINDOW = 8
"""How many trailing tokens are decoded to detect a cut inside a multi-byte character (§9.2)."""


# --- at the checkpoint (§9.2) ------------------------------------------------


def build_prefix_record(
    call: ActiveCall,
    *,
    prompt_token_ids: Sequence[int],
    generated_token_ids: Sequence[int],
    generated_logprobs: Sequence[float],
) -> StagedCallRecord:
    """The first cut row of *call*: carry plus everything generated so far, no extras.

    Built from the live call without claiming its completion, as the seed's model (the host stages it and
    passes it to :func:`build_cut_continuation`).

    :raises ValueError: as :func:`worker.call.build_call_record`.
    """
    return build_call_record(
        call,
        prompt_token_ids=prompt_token_ids,
        generated_token_ids=generated_token_ids,
        generated_logprobs=generated_logprobs,
    ).to_record()


def build_generation_chunk_record(
    call: ActiveCall,
    *,
    chunk_token_ids: Sequence[int],
    chunk_logprobs: Sequence[float],
    weight_version: int | None = None,
) -> StagedCallRecord:
    """A later cut row of *call*: generated tokens only (masks all ``1.0``, no extras).

    :param weight_version: the version that generated the chunk; defaults to
        the call's stamped version.
    :raises ValueError: empty chunk, length mismatch, or record validation fails.
    """
    ids = list(chunk_token_ids)
    logprobs = list(chunk_logprobs)
    if not ids:
        raise ValueError("a generation chunk must contain at least one token")
    if len(ids) != len(logprobs):
        raise ValueError("chunk ids and log-probabilities differ in length")
    admission = call.admission
    return StagedCallRecord.from_components(
        rollout_id=admission.rollout_id,
        model_call_id=admission.model_call_id,
        parent_call_id=admission.parent_call_id,
        mode=admission.mode,
        prev_len=admission.prev_len,
        delta_len=len(ids),
        cum_len=admission.prev_len + len(ids),
        weight_version=call.weight_version if weight_version is None else weight_version,
        token_ids_delta=ids,
        token_mask_delta=[1.0] * len(ids),
        generation_log_probs_delta=logprobs,
        extras=None,
        extras_digest=EMPTY_EXTRAS_DIGEST,
        chain_hash=compute_chain_hash(admission.parent_chain_hash, ids),
        cumulative_hash=hash_token_ids(call.prefix_token_ids + ids),
    )


def cut_refusal_reason(
    *,
    generated_token_ids: Sequence[int],
    decode: Callable[[list[int]], str],
    effective_output_limit: int | None,
    inconsistent_delta_seen: bool = False,
) -> str | None:
    """Why the worker must refuse to cut this call now (§9.2), or ``None`` to cut.

    :param decode: the engine's detokenizer (invalid UTF-8 rendered as U+FFFD).
    """
    if inconsistent_delta_seen:
        return "a dropped or inconsistent delta was observed"
    if not generated_token_ids:
        return "no token was generated"
    if effective_output_limit is None:
        return "the engine resolved no output limit"
    if decode(list(generated_token_ids[-CUT_DECODE_WINDOW:])).endswith("\ufffd"):
        return "the generated text ends inside a multi-byte character"
    return None


def _rebuild(
    admission: CaptureAdmission,
    *,
    source_capture_key: str,
    source_model_call_id: str,
    prefix_token_ids: list[int],
    chunks: Sequence[StagedCallBaseSnapshot],
    current_weight_version: int | None,
) -> StagedCallRecord:
    """Steps 2–5 of §9.4 over already fetched chunks."""
    if not chunks:
        raise GenerationCutError("a generation cut needs at least one staged chunk")
    if not all(isinstance(chunk, StagedCallBaseSnapshot) for chunk in chunks):
        raise GenerationCutError("generation-cut chunks must be staged snapshots")
    versions = [chunk.weight_version for chunk in chunks]
    if versions != sorted(versions):
        raise GenerationCutError(f"generation-cut chunk weight versions decrease: {versions}")
    if current_weight_version is not None and versions[-1] > current_weight_version:
        raise GenerationCutError(
            f"generation-cut prefix from newer weights ({versions[-1]} > current {current_weight_version})"
        )
    if any(0.0 in chunk.token_mask_delta for chunk in chunks[1:]):
        raise GenerationCutError("only the first generation-cut chunk may hold prompt-carry tokens")
    ids = list(itertools.chain.from_iterable(chunk.token_ids_delta for chunk in chunks))
    masks = list(itertools.chain.from_iterable(chunk.token_mask_delta for chunk in chunks))
    logprobs = list(itertools.chain.from_iterable(chunk.generation_log_probs_delta for chunk in chunks))
    first_generated = masks.index(1.0) if 1.0 in masks else len(masks)
    if 0.0 in masks[first_generated:]:
        raise GenerationCutError("generation-cut masks are not prompt-carry zeros followed by ones")
    try:
        return StagedCallRecord.from_components(
            rollout_id=source_capture_key,
            model_call_id=source_model_call_id,
            parent_call_id=admission.parent_call_id,
            mode=admission.mode,
            prev_len=admission.prev_len,
            delta_len=len(ids),
            cum_len=admission.prev_len + len(ids),
            weight_version=versions[0],
            token_ids_delta=ids,
            token_mask_delta=masks,
            generation_log_probs_delta=logprobs,
            extras=None,
            extras_digest=EMPTY_EXTRAS_DIGEST,
            chain_hash=compute_chain_hash(admission.parent_chain_hash, ids),
            cumulative_hash=hash_token_ids(prefix_token_ids + ids),
        )
    except ValueError as exc:
        raise GenerationCutError(f"generation-cut prefix does not rebuild: {exc}") from exc


def build_cut_continuation(
    call: ActiveCall,
    records: Sequence[StagedCallBaseSnapshot],
    staging_keys: Sequence[str],
    *,
    effective_output_limit: int,
    terminal_finish_reason: Literal["stop", "length"] | None = None,
    terminal_stop_reason: str | int | None = None,
) -> GenerationCutContinuation:
    """The durable-prefix acknowledgement of *call* after its cut rows were staged under *staging_keys*.

    ``prefix_digest`` is computed exactly as the replacement attempt will
    rebuild it (§9.4 step 5).

    :raises GenerationCutError: the rows do not rebuild, or keys and rows differ in count.
    :raises pydantic.ValidationError: an invalid limit or terminal reason.
    """
    if len(records) != len(staging_keys):
        raise GenerationCutError(f"{len(records)} cut rows for {len(staging_keys)} staging keys")
    admission = call.admission
    rebuilt = _rebuild(
        admission,
        source_capture_key=admission.rollout_id,
        source_model_call_id=admission.model_call_id,
        prefix_token_ids=call.prefix_token_ids,
        chunks=records,
        current_weight_version=None,
    )
    return GenerationCutContinuation(
        source_capture_key=admission.rollout_id,
        source_model_call_id=admission.model_call_id,
        staging_keys=tuple(staging_keys),
        prefix_token_count=rebuilt.token_mask_delta.count(1.0),
        prefix_digest=rebuilt.digest,
        effective_output_limit=effective_output_limit,
        terminal_finish_reason=terminal_finish_reason,
        terminal_stop_reason=terminal_stop_reason,
    )


# --- on the replacement attempt (§9.4) ---------------------------------------


def _required_cut(admission: CaptureAdmission) -> GenerationCutContinuation:
    cut = admission.generation_cut
    if cut is None:
        raise GenerationCutError("the admission carries no generation cut")
    return cut


def _cut_prefix_ids(admission: CaptureAdmission, prefix_token_ids: Sequence[int] | None) -> list[int]:
    if prefix_token_ids is not None:
        return list(prefix_token_ids)
    prefix = inline_prefix(admission)
    if prefix is None:
        raise GenerationCutError("by-reference admission: pass the resolved prefix_token_ids")
    return prefix


def rebuild_cut_prefix(
    admission: CaptureAdmission,
    snapshots: Sequence[StagedCallBaseSnapshot],
    *,
    current_weight_version: int,
    prefix_token_ids: Sequence[int] | None = None,
) -> StagedCallBaseSnapshot:
    """Rebuild and verify the cut prefix named by ``admission.generation_cut`` (§9.4 steps 1–6).

    :param snapshots: the rows fetched for ``generation_cut.staging_keys``, in order.
    :param prefix_token_ids: the resolved prefix; defaults to the inline prefix
        (required for a by-reference admission).
    :raises GenerationCutError: no cut on the admission, a wrong row count,
        decreasing or newer weight versions, carry tokens outside the first
        chunk, or a generated count or digest other than the continuation's.
    """
    cut = _required_cut(admission)
    if len(snapshots) != len(cut.staging_keys):
        raise GenerationCutError(f"fetched {len(snapshots)} cut rows for {len(cut.staging_keys)} staging keys")
    rebuilt = _rebuild(
        admission,
        source_capture_key=cut.source_capture_key,
        source_model_call_id=cut.source_model_call_id,
        prefix_token_ids=_cut_prefix_ids(admission, prefix_token_ids),
        chunks=snapshots,
        current_weight_version=current_weight_version,
    )
    if rebuilt.token_mask_delta.count(1.0) != cut.prefix_token_count:
        raise GenerationCutError("rebuilt generated count != prefix_token_count")
    if rebuilt.digest != cut.prefix_digest:
        raise GenerationCutError("rebuilt prefix digest != prefix_digest")
    return rebuilt


@contextmanager
def _cut_rows_fetched(admission: CaptureAdmission) -> Iterator[list[str]]:
    """Yield the keys of the admission's cut rows; a ``KeyError`` from the fetch becomes a cut error."""
    keys = list(_required_cut(admission).staging_keys)
    try:
        yield keys
    except KeyError as exc:
        raise GenerationCutError(f"generation-cut row missing: {exc}") from exc


def fetch_cut_prefix(
    admission: CaptureAdmission,
    source: Any,
    *,
    current_weight_version: int,
    prefix_token_ids: Sequence[int] | None = None,
) -> StagedCallBaseSnapshot:
    """Fetch ``generation_cut.staging_keys`` from a ``StagingSource`` and :func:`rebuild_cut_prefix`.

    :raises GenerationCutError: a key is missing, or the rebuild fails.
    """
    with _cut_rows_fetched(admission) as keys:
        snapshots = source.fetch(keys)
    return rebuild_cut_prefix(
        admission, snapshots, current_weight_version=current_weight_version, prefix_token_ids=prefix_token_ids
    )


async def afetch_cut_prefix(
    admission: CaptureAdmission,
    source: Any,
    *,
    current_weight_version: int,
    prefix_token_ids: Sequence[int] | None = None,
) -> StagedCallBaseSnapshot:
    """Async twin of :func:`fetch_cut_prefix` over an ``AsyncStagingSource``.

    :raises GenerationCutError: a key is missing, or the rebuild fails.
    """
    with _cut_rows_fetched(admission) as keys:
        snapshots = await source.fetch(keys)
    return rebuild_cut_prefix(
        admission, snapshots, current_weight_version=current_weight_version, prefix_token_ids=prefix_token_ids
    )


def drop_generation_cut(admission: CaptureAdmission) -> CaptureAdmission:
    """The admission without its cut: what the host begins when the cut fails."""
    return admission.model_copy(update={"generation_cut": None})


def check_cut_snapshot(
    admission: CaptureAdmission,
    snapshot: object,
    staging_keys: Sequence[str] | None,
    current_weight_version: int,
) -> StagedCallBaseSnapshot:
    """``begin_call``'s checks of a rebuilt cut snapshot against a cut admission (§9.4).

    :raises GenerationCutError: keys, identity, digest, lineage, generated
        count or weight version do not match.
    """
    cut = _required_cut(admission)
    if not isinstance(snapshot, StagedCallBaseSnapshot):
        raise GenerationCutError(f"generation cut must be a StagedCallBaseSnapshot, got {type(snapshot).__name__}")
    if staging_keys is None or tuple(staging_keys) != cut.staging_keys:
        raise GenerationCutError("supplied generation-cut staging keys differ from the admission's")
    if (snapshot.rollout_id, snapshot.model_call_id) != (cut.source_capture_key, cut.source_model_call_id):
        raise GenerationCutError("generation-cut snapshot belongs to another capture key or call")
    if snapshot.digest != cut.prefix_digest:
        raise GenerationCutError("generation-cut snapshot digest != prefix_digest")
    lineage = (admission.parent_call_id, admission.prev_len, admission.mode)
    if (snapshot.parent_call_id, snapshot.prev_len, snapshot.mode) != lineage:
        raise GenerationCutError("generation-cut snapshot parent, prev_len or mode differ from the admission's")
    if snapshot.token_mask_delta.count(1.0) != cut.prefix_token_count:
        raise GenerationCutError("generation-cut snapshot generated count != prefix_token_count")
    if snapshot.weight_version > current_weight_version:
        raise GenerationCutError(
            f"generation-cut prefix from newer weights ({snapshot.weight_version} > current {current_weight_version})"
        )
    return snapshot


@dataclass(frozen=True)
class CutContinuationPlan:
    """What the engine does for a cut call: the exact prompt and the remaining budget.

    ``finished`` means: do not generate; return the cut prefix as the result
    with ``finish_reason`` / ``stop_reason`` (and complete the call with no
    new tokens).
    """

    prompt_token_ids: list[int]
    max_tokens: int
    min_tokens: int
    finished: bool
    finish_reason: Literal["stop", "length"] | None
    stop_reason: str | int | None


def plan_cut_continuation(call: ActiveCall, *, min_tokens: int = 0) -> CutContinuationPlan:
    """Engine prompt (prefix + cut delta), remaining budget and terminal shortcut (§9.4, §10.12).

    :raises CaptureError: *call* is not a generation-cut call.
    """
    cut = call.admission.generation_cut
    snapshot = call.generation_cut
    if cut is None or snapshot is None:
        raise CaptureError("plan_cut_continuation needs a call begun with a generation cut")
    prompt = call.prefix_token_ids + snapshot.token_ids_delta
    if cut.terminal_finish_reason is not None:
        return CutContinuationPlan(prompt, 0, 0, True, cut.terminal_finish_reason, cut.terminal_stop_reason)
    remaining = cut.effective_output_limit - cut.prefix_token_count
    if remaining <= 0:
        return CutContinuationPlan(prompt, 0, 0, True, "length", None)
    return CutContinuationPlan(prompt, remaining, max(0, min_tokens - cut.prefix_token_count), False, None, None)
