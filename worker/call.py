"""One admitted call: its state, its staged record and its coordinates, staged or failed (§5.5, §5.8, §9.4).

Everything here is pure (no I/O), shared by the synchronous and async paths
of :class:`worker.capture.RolloutTokenCapture` and by the generation-cut
helpers, which build records from a live call without completing it.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from sink.contract.digest import (
    build_staging_delta,
    chain_hash_of_packed,
    compute_chain_hash,
    compute_extras_digest,
    hash_token_ids,
)
from sink.contract.packed import TrustedColumns, staging_delta_columns
from sink.contract.packed_record import PackedCallRecord, StageableRecord
from sink.contract.records import CaptureAdmission, CommitCoords, StagedCallBaseSnapshot, StagedCallRecord
from worker.errors import CaptureError
from worker.sequence_cache import EMPTY_SEQUENCE, ProvenSequence, SequenceHashCache

__all__ = ("ActiveCall", "build_call_record", "failed_coords", "staged_coords")


@dataclass(eq=False)
class ActiveCall:
    """One admitted call between ``begin_call`` and its single completion.

    ``capture_failure`` is set when the call cannot be captured (its
    ``staging_chain`` did not resolve); the host still serves the completion
    without a prefix, and completing the call returns failed coordinates
    without staging. A per-call lock guards only ``completed``.

    ``_prefix_proof``, when set by ``begin_call``, is a proof that holds
    ``prefix_token_ids`` (then the capture's own snapshot of the caller's
    list, or, for a by-reference child of a parent the capture built, the
    remembered sequence itself, unpacked only if read): see
    :mod:`worker.sequence_cache`. It is fixed at construction and read
    through :attr:`prefix_proof`.
    """

    admission: CaptureAdmission
    weight_version: int
    _prefix: list[int] | None
    """The prefix ids; ``None`` only with ``_prefix_proof`` set (then built from the proof when first read)."""
    generation_cut: StagedCallBaseSnapshot | None = None
    completed: bool = False
    capture_failure: str | None = None
    parent_extras: dict[str, Any] | None = None
    """The extras of the parent's staged record when ``begin_call`` fetched the staging chain (digest-checked by the
    source), else ``None``: exact-prefix mode reads the parent's rendered context from them."""
    verified_chain: tuple[str, ...] | None = None
    """The staging chain ``begin_call`` resolved and checked the prefix from (``()`` for a text root), else ``None``
    (an inline or caller-given prefix): a by-reference child's chain must extend it by one key (§5.9)."""
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _prefix_proof: ProvenSequence | None = field(default=None, repr=False)

    @property
    def capture_failed(self) -> bool:
        """Whether ``begin_call`` already knew this call cannot be captured."""
        return self.capture_failure is not None

    def __post_init__(self) -> None:
        if self._prefix is None and self._prefix_proof is None:
            raise ValueError("an ActiveCall needs its prefix ids or a proof of them")

    @property
    def prefix_token_ids(self) -> list[int]:
        """The authorized prefix: the ids the engine prompt must begin with (the parent's whole sequence)."""
        prefix = self._prefix
        if prefix is None:  # known by its proof (see the class docstring): the same ids, built on first read
            assert self._prefix_proof is not None  # __post_init__
            prefix = self._prefix = self._prefix_proof.ids()
        return prefix

    @property
    def prefix_proof(self) -> ProvenSequence | None:
        """The proof ``begin_call`` proved ``prefix_token_ids`` with (it holds exactly them), or ``None``."""
        return self._prefix_proof

    def claim(self) -> None:
        """Mark the call completed, once: the claim every completion path of the capture takes first.

        :class:`~worker.capture.RolloutTokenCapture` claims a call when it completes or fails it; a host
        does that through the capture and never claims a call itself.

        :raises CaptureError: the call was already completed (a second completion is refused).
        """
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


def staged_coords(record: StageableRecord, staging_key: str) -> CommitCoords:
    """The coordinates of a call the sink staged as *record* (either form) under *staging_key* (§5.5 step 4)."""
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
        staging_key=staging_key,
        chain_hash=record.chain_hash,
        cumulative_hash=record.cumulative_hash,
    )


def _as_list(values: Sequence[Any]) -> list[Any]:
    return values if type(values) is list else list(values)


def _drift(head: list[int], prefix: list[int]) -> str:
    """Where the engine's prompt *head* leaves the authorized *prefix*: the first token index that differs."""
    index = next((i for i, (got, want) in enumerate(zip(head, prefix, strict=False)) if got != want), len(head))
    received = f"id {head[index]}" if index < len(head) else f"nothing (the prompt has {len(head)} ids)"
    return (
        f"prompt drifts from the gate-authorized prefix at token index {index}: expected id {prefix[index]}, "
        f"received {received}"
    )


def build_call_record(
    call: ActiveCall,
    *,
    prompt_token_ids: Sequence[int],
    generated_token_ids: Sequence[int],
    generated_logprobs: Sequence[float],
    extras: dict[str, Any] | None = None,
    sequence_cache: SequenceHashCache | None = None,
) -> PackedCallRecord:
    """Build the staged record of *call* (contract §5.5 step 2, §9.4 final record), in its packed form.

    The usual delta is built and proved in one pass and the record built from it without the pydantic
    model (:meth:`~sink.contract.packed_record.PackedCallRecord.from_trusted_columns`); anything else
    (a generation-cut call, ids this pass does not prove) is built the reference way through
    ``StagedCallRecord.from_components`` and packed. Either way the record stages as the same blob.
    Does not claim the completion. For a generation-cut call the engine prompt
    must be the resolved prefix followed by the cut delta; the record keeps
    the cut's masks and log-probabilities and takes the older weight version.

    With *sequence_cache*, a prompt whose first ``prev_len`` ids a remembered
    proof holds is proved in one ``marshal`` pass instead of being compared
    and packed (see :mod:`worker.sequence_cache`); any other prompt takes the
    reference path. The record is byte-identical either way.

    :raises ValueError: the prompt does not begin with the authorized prefix,
        the columns are inconsistent, or record validation fails.
    :raises TypeError: an extras value is unsupported.
    """
    admission = call.admission
    prev_len = admission.prev_len
    prompt = _as_list(prompt_token_ids)
    generated = _as_list(generated_token_ids)
    head = prompt[:prev_len]  # a private slice: a proof reads it, or it is compared with the prefix
    parent = None if sequence_cache is None else _proof_of_head(call, head, sequence_cache)
    # A head held by the proof that begin_call proved the prefix with equals the prefix, item by item.
    if (parent is None or parent is not call.prefix_proof) and head != call.prefix_token_ids:
        raise ValueError(_drift(head, call.prefix_token_ids))
    cut = call.generation_cut
    proved: TrustedColumns | None = None
    if cut is None:
        # The delta built and proved in one pass (masks by construction); else the reference build.
        proved = staging_delta_columns(prompt[prev_len:], generated, _as_list(generated_logprobs))
        if proved is not None and proved.token_ids is not None:
            ids, mask, logprobs = proved.token_ids, proved.token_mask, proved.log_probs
        else:
            proved = None
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
    if sequence_cache is None:
        chain_hash = _chain_hash(admission, ids, proved)
        cumulative_hash = hash_token_ids(prompt + generated)
    else:
        chain_hash, cumulative_hash = _cached_hashes(call, sequence_cache, parent, ids, rest, prompt, generated, proved)
    scalars: dict[str, Any] = {
        "rollout_id": admission.rollout_id,
        "model_call_id": admission.model_call_id,
        "parent_call_id": admission.parent_call_id,
        "mode": admission.mode,
        "prev_len": prev_len,
        "weight_version": weight_version,
        "extras": extras,
        "extras_digest": compute_extras_digest(extras),
        "chain_hash": chain_hash,
        "cumulative_hash": cumulative_hash,
    }
    if proved is not None:
        return PackedCallRecord.from_trusted_columns(proved, **scalars)
    reference = StagedCallRecord.from_components(
        **scalars,
        delta_len=len(ids),
        cum_len=prev_len + len(ids),
        token_ids_delta=ids,
        token_mask_delta=mask,
        generation_log_probs_delta=logprobs,
    )
    return PackedCallRecord.of(reference)


def _proof_of_head(call: ActiveCall, head: list[int], cache: SequenceHashCache) -> ProvenSequence | None:
    """A proof that holds *head* (a private slice), or ``None``.

    Tries the proof ``begin_call`` proved the prefix with, else the parent's remembered sequence.
    """
    admission = call.admission
    proof = call.prefix_proof
    if proof is None:
        proof = cache.lookup(admission.rollout_id, admission.parent_call_id)
    return proof if proof is not None and proof.holds(head) else None


def _cached_hashes(
    call: ActiveCall,
    cache: SequenceHashCache,
    parent: ProvenSequence | None,
    ids: list[int],
    rest: list[int],
    prompt: list[int],
    generated: list[int],
    proved: TrustedColumns | None = None,
) -> tuple[str, str]:
    """``(chain_hash, cumulative_hash)`` of the record, packing only *rest* when *parent* proves the head.

    *rest* is ``prompt[prev_len:] + generated`` (a list private to the caller). Without a proved head the
    whole sequence is packed, which applies the reference type gate to every prompt id. The full sequence's
    proof is remembered for the call's children.

    :raises ValueError: an id is not an exact int in ``[0, 2**64)``.
    """
    admission = call.admission
    proof = EMPTY_SEQUENCE.extended(prompt + generated) if parent is None else parent.extended(rest, proved=proved)
    if parent is not None and rest is ids:
        chain_hash = chain_hash_of_packed(admission.parent_chain_hash, proof.packed[-1])
    else:
        chain_hash = _chain_hash(admission, ids, proved)
    cumulative_hash = proof.cumulative_hash()
    cache.remember(
        admission.rollout_id,
        admission.model_call_id,
        proof,
        chain_hash=chain_hash,
        cumulative_hash=cumulative_hash,
        staging_chain=call.verified_chain,
    )
    return chain_hash, cumulative_hash


def _chain_hash(admission: CaptureAdmission, ids: list[int], proved: TrustedColumns | None) -> str:
    """``compute_chain_hash(parent_chain_hash, ids)``, over the packed ids when *proved* holds exactly *ids*."""
    packed = None if proved is None or proved.token_ids is not ids else proved.packed.ids_u64be
    if packed is None:
        return compute_chain_hash(admission.parent_chain_hash, ids)
    return chain_hash_of_packed(admission.parent_chain_hash, b"".join(packed))
