"""One admitted call: its state, its staged record and its failed shape (contract §5.5, §5.8, §9.4).

Everything here is pure (no I/O), shared by the synchronous and async paths
of :class:`worker.capture.RolloutTokenCapture` and by the generation-cut
helpers, which build records from a live call without completing it.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from sink.digest import build_staging_delta, compute_chain_hash, compute_extras_digest, hash_token_ids
from sink.records import CaptureAdmission, CommitCoords, StagedCallBaseSnapshot, StagedCallRecord

from .errors import CaptureError
from .sequence_cache import SequenceHashCache

__all__ = ("ActiveCall", "build_call_record", "failed_coords")


@dataclass(eq=False)
class ActiveCall:
    """One admitted call between ``begin_call`` and its single completion.

    ``capture_failure`` is set when the call cannot be captured (its
    ``staging_chain`` did not resolve); the host still serves the completion
    without a prefix, and completing the call returns failed coordinates
    without staging. A per-call lock guards only ``completed``.
    """

    admission: CaptureAdmission
    weight_version: int
    prefix_token_ids: list[int]
    generation_cut: StagedCallBaseSnapshot | None = None
    completed: bool = False
    capture_failure: str | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def capture_failed(self) -> bool:
        """Whether ``begin_call`` already knew this call cannot be captured."""
        return self.capture_failure is not None

    def _claim(self) -> None:
        with self._lock:
            if self.completed:
                raise CaptureError(f"call {self.admission.model_call_id!r} already completed")
            self.completed = True


def failed_coords(admission: CaptureAdmission, *, weight_version: int) -> CommitCoords:
    """The exact failed-coordinates shape of contract §5.8."""
    return CommitCoords(
        rollout_id=admission.rollout_id,
        model_call_id=admission.model_call_id,
        parent_call_id=admission.parent_call_id,
        prev_len=admission.prev_len,
        delta_len=0,
        cum_len=admission.prev_len,
        weight_version=weight_version,
        disposition="capture_failed",
    )


def _as_list(values: Sequence[Any]) -> list[Any]:
    return values if type(values) is list else list(values)


def build_call_record(
    call: ActiveCall,
    *,
    prompt_token_ids: Sequence[int],
    generated_token_ids: Sequence[int],
    generated_logprobs: Sequence[float],
    extras: dict[str, Any] | None = None,
    sequence_cache: SequenceHashCache | None = None,
) -> StagedCallRecord:
    """Build the staged record of *call* (contract §5.5 step 2, §9.4 final record).

    Does not claim the completion. For a generation-cut call the engine prompt
    must be the resolved prefix followed by the cut delta; the record keeps
    the cut's masks and log-probabilities and takes the older weight version.

    :raises ValueError: the prompt does not begin with the authorized prefix,
        the columns are inconsistent, or record validation fails.
    :raises TypeError: an extras value is unsupported.
    """
    admission = call.admission
    prev_len = admission.prev_len
    prompt = _as_list(prompt_token_ids)
    generated = _as_list(generated_token_ids)
    prefix = prompt[:prev_len]
    if prefix != call.prefix_token_ids:
        raise ValueError("prompt does not begin with the gate-authorized prefix")
    cut = call.generation_cut
    if cut is None:
        ids, mask, logprobs = build_staging_delta(prompt, generated, generated_logprobs, prev_len)
        rest = ids  # prompt[prev_len:] + generated, the prompt's own ids
        weight_version = call.weight_version
    else:
        rest = prompt[prev_len:]
        if rest != cut.token_ids_delta:
            raise ValueError("engine prompt is not the prefix followed by the generation-cut delta")
        if len(generated) != len(generated_logprobs):
            raise ValueError("generated ids and log-probabilities differ in length")
        rest += generated  # hashed as the prompt's own ids, exactly as without the cache
        ids = cut.token_ids_delta + generated
        mask = cut.token_mask_delta + [1.0] * len(generated)
        logprobs = cut.generation_log_probs_delta + _as_list(generated_logprobs)
        weight_version = min(cut.weight_version, call.weight_version)
    return StagedCallRecord.from_components(
        rollout_id=admission.rollout_id,
        model_call_id=admission.model_call_id,
        parent_call_id=admission.parent_call_id,
        mode=admission.mode,
        prev_len=prev_len,
        delta_len=len(ids),
        cum_len=prev_len + len(ids),
        weight_version=weight_version,
        token_ids_delta=ids,
        token_mask_delta=mask,
        generation_log_probs_delta=logprobs,
        extras=extras,
        extras_digest=compute_extras_digest(extras),
        chain_hash=compute_chain_hash(admission.parent_chain_hash, ids),
        cumulative_hash=(
            hash_token_ids(prompt + generated)
            if sequence_cache is None
            else sequence_cache.cumulative_hash(
                admission.rollout_id, admission.model_call_id, admission.parent_call_id, prefix, rest
            )
        ),
    )
