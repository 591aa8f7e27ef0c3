"""Generation-cut continuation (contract §9.2, §9.4, §10.12).

Attempt 1 stages a cut of an in-flight call (a prefix record and a chunk);
attempt 2 re-issues the call, rebuilds and verifies the prefix, generates
only the rest, and stages a record that equals an uninterrupted generation.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import FrozenInstanceError, dataclass
from typing import Any

import pytest

from sink.contract.records import (
    CaptureAdmission,
    CommitCoords,
    GenerationCutContinuation,
    StagedCallRecord,
    StagedCallSnapshot,
    StageResult,
)
from sink.store.memory import MemoryStagingStore
from sink_tools.simulated.engine import BYTE_OFFSET, ByteTokenizer, Generation, SimulatedEngine
from worker import CaptureError, GenerationCutError, RolloutTokenCapture, resolve_prefix
from worker.call import ActiveCall
from worker.generation_cut import (
    CUT_DECODE_WINDOW,
    afetch_cut_prefix,
    build_cut_continuation,
    build_generation_chunk_record,
    build_prefix_record,
    cut_refusal_reason,
    drop_generation_cut,
    fetch_cut_prefix,
    plan_cut_continuation,
    rebuild_cut_prefix,
)

CUT_AT, CHUNK_END, TOTAL = 16, 24, 40
WEIGHTS = 7


class CutStore(MemoryStagingStore):
    """The memory store plus ``stage_generation_prefix`` under opaque cut keys."""

    def __init__(self) -> None:
        super().__init__()
        self.cut_rows: dict[str, StagedCallSnapshot] = {}

    def stage_generation_prefix(
        self, record: StagedCallRecord, *, checkpoint_id: str, chunk_sequence: int
    ) -> StageResult:
        key = f"{record.staging_key}#cut/{checkpoint_id}/{chunk_sequence}"
        self.cut_rows[key] = StagedCallSnapshot.model_validate(record.model_dump())
        return StageResult(ok=True, staging_key=key)

    def fetch(self, staging_keys: Sequence[str]) -> list[StagedCallSnapshot]:
        fetch_staged = super().fetch  # zero-argument super() does not work inside a comprehension
        return [self.cut_rows[key] if key in self.cut_rows else fetch_staged([key])[0] for key in staging_keys]


@dataclass
class Checkpointed:
    store: CutStore
    root: CommitCoords
    root_full: list[int]
    prompt: list[int]
    generation: Generation
    records: list[StagedCallRecord]
    continuation: GenerationCutContinuation


def checkpoint(*, chunk_weight: int = WEIGHTS, limit: int = TOTAL) -> Checkpointed:
    """Attempt ``r1``: a root, then a child cut after 16 + 8 generated tokens."""
    store = CutStore()
    engine = SimulatedEngine(5)
    capture = RolloutTokenCapture(sink=store, weight_version_fn=lambda: WEIGHTS)
    tokens = engine.tokenizer
    root_prompt = tokens.render_chat([{"role": "user", "content": "find the file"}])
    root_gen = engine.generate(root_prompt, 12)
    root = capture.complete_call(
        capture.begin_call(CaptureAdmission(rollout_id="r1", model_call_id="c1", mode="text")),
        prompt_token_ids=root_prompt,
        generated_token_ids=root_gen.token_ids,
        generated_logprobs=root_gen.logprobs,
    )
    root_full = root_prompt + root_gen.token_ids
    prompt = root_full + tokens.render_chat([{"role": "tool", "content": "found: a.txt"}])
    generation = engine.generate(prompt, TOTAL, min_tokens=TOTAL)
    call = capture.begin_call(child_admission("r1", "c2", root, root_full))
    ids, lps = generation.token_ids, generation.logprobs
    prefix_record = build_prefix_record(
        call, prompt_token_ids=prompt, generated_token_ids=ids[:CUT_AT], generated_logprobs=lps[:CUT_AT]
    )
    chunk = build_generation_chunk_record(
        call, chunk_token_ids=ids[CUT_AT:CHUNK_END], chunk_logprobs=lps[CUT_AT:CHUNK_END], weight_version=chunk_weight
    )
    keys = []
    for sequence, record in enumerate((prefix_record, chunk)):
        result = store.stage_generation_prefix(record, checkpoint_id="ck1", chunk_sequence=sequence)
        assert result.staging_key is not None
        keys.append(result.staging_key)
    continuation = build_cut_continuation(call, [prefix_record, chunk], keys, effective_output_limit=limit)
    assert not call.completed  # cut rows never claim the live call
    return Checkpointed(store, root, root_full, prompt, generation, [prefix_record, chunk], continuation)


def child_admission(
    rollout_id: str,
    call_id: str,
    root: CommitCoords,
    root_full: list[int],
    cut: GenerationCutContinuation | None = None,
    *,
    by_reference: bool = False,
) -> CaptureAdmission:
    return CaptureAdmission(
        rollout_id=rollout_id,
        model_call_id=call_id,
        parent_call_id=root.model_call_id,
        prev_len=root.cum_len,
        mode="token_in",
        required_prefix_token_ids=[] if by_reference else root_full,
        staging_chain=[root.staging_key or ""] if by_reference else [],
        parent_chain_hash=root.chain_hash,
        generation_cut=cut,
    )


def uninterrupted(ck: Checkpointed, weights: int, generated: int = TOTAL) -> CommitCoords:
    """Reference: the re-issued call generating everything itself."""
    capture = RolloutTokenCapture(sink=MemoryStagingStore(), weight_version_fn=lambda: weights)
    call = capture.begin_call(child_admission("r1-a1", "c2b", ck.root, ck.root_full))
    return capture.complete_call(
        call,
        prompt_token_ids=ck.prompt,
        generated_token_ids=ck.generation.token_ids[:generated],
        generated_logprobs=ck.generation.logprobs[:generated],
    )


def test_checkpoint_acknowledgement() -> None:
    ck = checkpoint()
    cont = ck.continuation
    assert (cont.source_capture_key, cont.source_model_call_id) == ("r1", "c2")
    assert cont.prefix_token_count == CHUNK_END and cont.effective_output_limit == TOTAL
    prefix_record, chunk = ck.records
    assert prefix_record.token_mask_delta.count(0.0) == len(ck.prompt) - ck.root.cum_len
    assert chunk.token_mask_delta == [1.0] * (CHUNK_END - CUT_AT) and chunk.extras is None
    assert chunk.cum_len == chunk.prev_len + chunk.delta_len == ck.root.cum_len + CHUNK_END - CUT_AT


@pytest.mark.parametrize("current", [WEIGHTS, WEIGHTS + 2])
def test_cut_continuation_equals_an_uninterrupted_generation(current: int) -> None:
    ck = checkpoint()
    admission = child_admission("r1-a1", "c2b", ck.root, ck.root_full, ck.continuation)
    snapshot = fetch_cut_prefix(admission, ck.store, current_weight_version=current)
    capture = RolloutTokenCapture(sink=ck.store, weight_version_fn=lambda: current)
    call = capture.begin_call(
        admission, generation_cut=snapshot, generation_cut_staging_keys=ck.continuation.staging_keys
    )
    plan = plan_cut_continuation(call)
    ids, lps = ck.generation.token_ids, ck.generation.logprobs
    assert plan.prompt_token_ids == ck.prompt + ids[:CHUNK_END]
    assert (plan.max_tokens, plan.finished, plan.finish_reason) == (TOTAL - CHUNK_END, False, None)
    coords = capture.complete_call(
        call,
        prompt_token_ids=plan.prompt_token_ids,
        generated_token_ids=ids[CHUNK_END:],
        generated_logprobs=lps[CHUNK_END:],
    )
    reference = uninterrupted(ck, WEIGHTS)
    assert coords.disposition == "staged" and coords.staging_key == "r1-a1/c2b"
    assert coords.weight_version == WEIGHTS  # min(cut, current)
    assert coords.model_dump() == reference.model_dump()
    (staged,) = ck.store.fetch(["r1-a1/c2b"])
    assert staged.token_mask_delta.count(1.0) == TOTAL


def test_a_cut_continuation_whose_parent_the_sequence_cache_holds_equals_an_uninterrupted_generation() -> None:
    """The re-issued attempt's capture staged the same root itself, so its sequence cache proves the prompt's head:
    the continuation's record, hashes included, is still the uninterrupted generation's."""
    ck = checkpoint()
    capture = RolloutTokenCapture(sink=ck.store, weight_version_fn=lambda: WEIGHTS)
    (root_record,) = ck.store.fetch([ck.root.staging_key or ""])
    generated = 12  # the root's generation in checkpoint()
    root = capture.complete_call(
        capture.begin_call(CaptureAdmission(rollout_id="r1-a1", model_call_id="c1", mode="text")),
        prompt_token_ids=ck.root_full[:-generated],
        generated_token_ids=ck.root_full[-generated:],
        generated_logprobs=root_record.generation_log_probs_delta[-generated:],
    )
    assert root.chain_hash == ck.root.chain_hash
    admission = child_admission("r1-a1", "c2b", root, ck.root_full, ck.continuation)
    snapshot = fetch_cut_prefix(admission, ck.store, current_weight_version=WEIGHTS)
    call = capture.begin_call(
        admission, generation_cut=snapshot, generation_cut_staging_keys=ck.continuation.staging_keys
    )
    ids, lps = ck.generation.token_ids, ck.generation.logprobs
    coords = capture.complete_call(
        call,
        prompt_token_ids=plan_cut_continuation(call).prompt_token_ids,
        generated_token_ids=ids[CHUNK_END:],
        generated_logprobs=lps[CHUNK_END:],
    )
    assert coords.model_dump() == uninterrupted(ck, WEIGHTS).model_dump()


def test_by_reference_admission_rebuilds_with_the_resolved_prefix() -> None:
    ck = checkpoint()
    admission = child_admission("r1-a1", "c2b", ck.root, ck.root_full, ck.continuation, by_reference=True)
    with pytest.raises(GenerationCutError, match="resolved prefix"):
        fetch_cut_prefix(admission, ck.store, current_weight_version=WEIGHTS)
    prefix = resolve_prefix(admission, ck.store)
    snapshot = fetch_cut_prefix(admission, ck.store, current_weight_version=WEIGHTS, prefix_token_ids=prefix)
    assert snapshot.digest == ck.continuation.prefix_digest


def test_cut_from_newer_weights_is_rejected() -> None:
    ck = checkpoint(chunk_weight=WEIGHTS + 1)
    admission = child_admission("r1-a1", "c2b", ck.root, ck.root_full, ck.continuation)
    with pytest.raises(GenerationCutError, match="newer weights"):
        fetch_cut_prefix(admission, ck.store, current_weight_version=WEIGHTS)
    snapshot = fetch_cut_prefix(admission, ck.store, current_weight_version=WEIGHTS + 1)
    assert snapshot.weight_version == WEIGHTS  # the oldest chunk's version
    older = RolloutTokenCapture(sink=ck.store, weight_version_fn=lambda: WEIGHTS - 1)
    with pytest.raises(GenerationCutError, match="newer weights"):
        older.begin_call(admission, generation_cut=snapshot, generation_cut_staging_keys=ck.continuation.staging_keys)


def test_decreasing_chunk_weights_are_rejected() -> None:
    ck = checkpoint()
    with pytest.raises(GenerationCutError, match="decrease"):
        build_cut_continuation(
            _live_call(ck),
            [ck.records[0], ck.records[1].model_copy(update={"weight_version": WEIGHTS - 1})],
            ck.continuation.staging_keys,
            effective_output_limit=TOTAL,
        )
    stale = _rebuilt_chunk(ck, weight_version=WEIGHTS - 1)
    ck.store.cut_rows[ck.continuation.staging_keys[1]] = stale
    admission = child_admission("r1-a1", "c2b", ck.root, ck.root_full, ck.continuation)
    with pytest.raises(GenerationCutError, match="decrease"):
        fetch_cut_prefix(admission, ck.store, current_weight_version=WEIGHTS)


def _live_call(ck: Checkpointed) -> Any:
    capture = RolloutTokenCapture(sink=ck.store, weight_version_fn=lambda: WEIGHTS)
    return capture.begin_call(child_admission("r1", "c2", ck.root, ck.root_full))


def _rebuilt_chunk(
    ck: Checkpointed, *, weight_version: int = WEIGHTS, logprob_shift: float = 0.0
) -> StagedCallSnapshot:
    ids, lps = ck.generation.token_ids, ck.generation.logprobs
    record = build_generation_chunk_record(
        _live_call(ck),
        chunk_token_ids=ids[CUT_AT:CHUNK_END],
        chunk_logprobs=[lp + logprob_shift for lp in lps[CUT_AT:CHUNK_END]],
        weight_version=weight_version,
    )
    return StagedCallSnapshot.model_validate(record.model_dump())


def test_tampered_rows_are_rejected() -> None:
    ck = checkpoint()
    keys = ck.continuation.staging_keys
    admission = child_admission("r1-a1", "c2b", ck.root, ck.root_full, ck.continuation)
    # A valid chunk with different log-probs: its own digest is fine, the prefix digest is not.
    ck.store.cut_rows[keys[1]] = _rebuilt_chunk(ck, logprob_shift=-0.5)
    with pytest.raises(GenerationCutError, match="prefix digest"):
        fetch_cut_prefix(admission, ck.store, current_weight_version=WEIGHTS)
    # A second row holding prompt-carry tokens.
    ck.store.cut_rows[keys[1]] = ck.store.cut_rows[keys[0]]
    with pytest.raises(GenerationCutError, match="only the first"):
        fetch_cut_prefix(admission, ck.store, current_weight_version=WEIGHTS)
    # A missing row.
    del ck.store.cut_rows[keys[1]]
    with pytest.raises(GenerationCutError, match="missing"):
        fetch_cut_prefix(admission, ck.store, current_weight_version=WEIGHTS)


def test_count_and_token_count_mismatches_are_rejected() -> None:
    ck = checkpoint()
    snapshots = ck.store.fetch(list(ck.continuation.staging_keys))
    admission = child_admission("r1-a1", "c2b", ck.root, ck.root_full, ck.continuation)
    with pytest.raises(GenerationCutError, match="fetched 1"):
        rebuild_cut_prefix(admission, snapshots[:1], current_weight_version=WEIGHTS)
    lying = admission.model_copy(
        update={"generation_cut": ck.continuation.model_copy(update={"prefix_token_count": 23})}
    )
    with pytest.raises(GenerationCutError, match="generated count"):
        rebuild_cut_prefix(lying, snapshots, current_weight_version=WEIGHTS)
    with pytest.raises(GenerationCutError, match="no generation cut"):
        rebuild_cut_prefix(drop_generation_cut(admission), snapshots, current_weight_version=WEIGHTS)
    with pytest.raises(GenerationCutError, match="cut rows"):
        build_cut_continuation(_live_call(ck), ck.records, ck.continuation.staging_keys[:1], effective_output_limit=9)


def test_begin_call_checks_the_snapshot_against_the_admission() -> None:
    ck = checkpoint()
    cont = ck.continuation
    admission = child_admission("r1-a1", "c2b", ck.root, ck.root_full, cont)
    snapshot = fetch_cut_prefix(admission, ck.store, current_weight_version=WEIGHTS)
    capture = RolloutTokenCapture(sink=ck.store, weight_version_fn=lambda: WEIGHTS)
    with pytest.raises(GenerationCutError, match="staging keys"):
        capture.begin_call(admission, generation_cut=snapshot, generation_cut_staging_keys=cont.staging_keys[::-1])
    with pytest.raises(GenerationCutError, match="staging keys"):
        capture.begin_call(admission, generation_cut=snapshot)
    other = admission.model_copy(update={"generation_cut": cont.model_copy(update={"source_model_call_id": "c9"})})
    with pytest.raises(GenerationCutError, match="another capture key"):
        capture.begin_call(other, generation_cut=snapshot, generation_cut_staging_keys=cont.staging_keys)
    with pytest.raises(GenerationCutError, match="StagedCallBaseSnapshot"):
        not_a_snapshot: Any = snapshot.model_dump()
        capture.begin_call(admission, generation_cut=not_a_snapshot, generation_cut_staging_keys=cont.staging_keys)
    with pytest.raises(CaptureError, match="needs the rebuilt prefix"):
        capture.begin_call(admission)
    with pytest.raises(CaptureError, match="needs an admission"):
        capture.begin_call(drop_generation_cut(admission), generation_cut=snapshot)
    # The host's fallback: drop the cut and regenerate.
    call = capture.begin_call(drop_generation_cut(admission))
    assert call.generation_cut is None and call.prefix_token_ids == ck.root_full
    with pytest.raises(CaptureError, match="generation cut"):
        plan_cut_continuation(call)


def test_terminal_finish_shortcut_stages_the_cut_as_the_result() -> None:
    ck = checkpoint()
    cont = ck.continuation.model_copy(update={"terminal_finish_reason": "stop", "terminal_stop_reason": 2})
    admission = child_admission("r1-a1", "c2b", ck.root, ck.root_full, cont)
    snapshot = fetch_cut_prefix(admission, ck.store, current_weight_version=WEIGHTS)
    capture = RolloutTokenCapture(sink=ck.store, weight_version_fn=lambda: WEIGHTS)
    call = capture.begin_call(admission, generation_cut=snapshot, generation_cut_staging_keys=cont.staging_keys)
    plan = plan_cut_continuation(call)
    assert (plan.finished, plan.finish_reason, plan.stop_reason, plan.max_tokens) == (True, "stop", 2, 0)
    coords = capture.complete_call(
        call, prompt_token_ids=plan.prompt_token_ids, generated_token_ids=[], generated_logprobs=[]
    )
    assert coords.model_dump() == uninterrupted(ck, WEIGHTS, generated=CHUNK_END).model_dump()


@pytest.mark.parametrize("limit", [CHUNK_END, CHUNK_END - 4])
def test_exhausted_budget_finishes_with_length(limit: int) -> None:
    ck = checkpoint(limit=limit)
    admission = child_admission("r1-a1", "c2b", ck.root, ck.root_full, ck.continuation)
    snapshot = fetch_cut_prefix(admission, ck.store, current_weight_version=WEIGHTS)
    capture = RolloutTokenCapture(sink=ck.store, weight_version_fn=lambda: WEIGHTS)
    call = capture.begin_call(
        admission, generation_cut=snapshot, generation_cut_staging_keys=ck.continuation.staging_keys
    )
    plan = plan_cut_continuation(call, min_tokens=5)
    assert (plan.finished, plan.finish_reason, plan.max_tokens, plan.min_tokens) == (True, "length", 0, 0)


def test_minimum_budget_is_reduced_with_a_floor_of_zero() -> None:
    ck = checkpoint()
    admission = child_admission("r1-a1", "c2b", ck.root, ck.root_full, ck.continuation)
    snapshot = fetch_cut_prefix(admission, ck.store, current_weight_version=WEIGHTS)
    capture = RolloutTokenCapture(sink=ck.store, weight_version_fn=lambda: WEIGHTS)
    call = capture.begin_call(
        admission, generation_cut=snapshot, generation_cut_staging_keys=ck.continuation.staging_keys
    )
    assert plan_cut_continuation(call, min_tokens=30).min_tokens == 30 - CHUNK_END
    assert plan_cut_continuation(call, min_tokens=10).min_tokens == 0


def test_engine_prompt_must_be_prefix_plus_cut_delta() -> None:
    ck = checkpoint()
    admission = child_admission("r1-a1", "c2b", ck.root, ck.root_full, ck.continuation)
    snapshot = fetch_cut_prefix(admission, ck.store, current_weight_version=WEIGHTS)
    capture = RolloutTokenCapture(sink=ck.store, weight_version_fn=lambda: WEIGHTS)
    call = capture.begin_call(
        admission, generation_cut=snapshot, generation_cut_staging_keys=ck.continuation.staging_keys
    )
    coords = capture.complete_call(
        call, prompt_token_ids=ck.prompt, generated_token_ids=[17], generated_logprobs=[-1.0]
    )
    assert coords.disposition == "capture_failed" and coords.delta_len == 0


def test_chunk_builder_rejects_empty_and_mismatched_chunks() -> None:
    ck = checkpoint()
    call = _live_call(ck)
    with pytest.raises(ValueError, match="at least one"):
        build_generation_chunk_record(call, chunk_token_ids=[], chunk_logprobs=[])
    with pytest.raises(ValueError, match="differ"):
        build_generation_chunk_record(call, chunk_token_ids=[20, 21], chunk_logprobs=[-1.0])


def test_cut_refusal_reasons() -> None:
    decode = ByteTokenizer().decode
    euro = [BYTE_OFFSET + byte for byte in "a€".encode()]
    assert cut_refusal_reason(generated_token_ids=euro, decode=decode, effective_output_limit=9) is None
    reason = cut_refusal_reason(generated_token_ids=euro[:-1], decode=decode, effective_output_limit=9)
    assert reason is not None and "multi-byte" in reason
    assert (
        cut_refusal_reason(generated_token_ids=[], decode=decode, effective_output_limit=9) == "no token was generated"
    )
    assert "output limit" in str(
        cut_refusal_reason(generated_token_ids=euro, decode=decode, effective_output_limit=None)
    )
    assert "inconsistent" in str(
        cut_refusal_reason(
            generated_token_ids=euro, decode=decode, effective_output_limit=9, inconsistent_delta_seen=True
        )
    )


@pytest.mark.anyio
async def test_async_fetch_of_a_cut_prefix() -> None:
    ck = checkpoint()

    class AsyncSource:
        async def fetch(self, staging_keys: Sequence[str]) -> list[StagedCallSnapshot]:
            return ck.store.fetch(staging_keys)

    admission = child_admission("r1-a1", "c2b", ck.root, ck.root_full, ck.continuation)
    snapshot = await afetch_cut_prefix(admission, AsyncSource(), current_weight_version=WEIGHTS)
    assert snapshot.digest == ck.continuation.prefix_digest
    del ck.store.cut_rows[ck.continuation.staging_keys[0]]
    with pytest.raises(GenerationCutError, match="missing"):
        await afetch_cut_prefix(admission, AsyncSource(), current_weight_version=WEIGHTS)


# --- generation cuts ----------------------------------------------------------------------------------


def test_the_cut_refusal_decodes_exactly_the_last_eight_tokens() -> None:
    """Kills ``CUT_DECODE_WINDOW = 8 -> 9`` (contract §9.2: decoding the last <= 8 tokens)."""
    seen: list[list[int]] = []

    def decode(ids: list[int]) -> str:
        seen.append(ids)
        return "ok"

    generated = list(range(100, 120))
    assert cut_refusal_reason(generated_token_ids=generated, decode=decode, effective_output_limit=64) is None
    assert CUT_DECODE_WINDOW == 8 and seen == [generated[-8:]]


def _cut_call(ck: Checkpointed, *, current: int = WEIGHTS) -> ActiveCall:
    admission = child_admission("r1-a1", "c2b", ck.root, ck.root_full, ck.continuation)
    snapshot = fetch_cut_prefix(admission, ck.store, current_weight_version=current)
    capture = RolloutTokenCapture(sink=ck.store, weight_version_fn=lambda: current)
    return capture.begin_call(
        admission, generation_cut=snapshot, generation_cut_staging_keys=ck.continuation.staging_keys
    )


def test_a_plan_needs_both_the_cut_admission_and_its_snapshot() -> None:
    """Kills ``cut is None or snapshot is None`` -> ``and``."""
    call = _cut_call(checkpoint())
    without_snapshot = ActiveCall(call.admission, call.weight_version, call.prefix_token_ids, None)
    with pytest.raises(CaptureError, match="generation cut"):
        plan_cut_continuation(without_snapshot)


def test_terminal_and_boundary_budgets() -> None:
    """Kills the ``0`` constants of the terminal plan and ``remaining <= 0`` -> ``<= 1``; the plan is frozen."""
    ck = checkpoint()
    terminal = ck.continuation.model_copy(update={"terminal_finish_reason": "length"})
    admission = child_admission("r1-a1", "c2b", ck.root, ck.root_full, terminal)
    snapshot = fetch_cut_prefix(admission, ck.store, current_weight_version=WEIGHTS)
    capture = RolloutTokenCapture(sink=ck.store, weight_version_fn=lambda: WEIGHTS)
    call = capture.begin_call(admission, generation_cut=snapshot, generation_cut_staging_keys=terminal.staging_keys)
    plan = plan_cut_continuation(call, min_tokens=50)
    assert (plan.max_tokens, plan.min_tokens, plan.finished) == (0, 0, True)
    with pytest.raises(FrozenInstanceError):
        plan.max_tokens = 3  # type: ignore[misc]
    one_left = plan_cut_continuation(_cut_call(checkpoint(limit=CHUNK_END + 1)), min_tokens=CHUNK_END + 1)
    assert (one_left.finished, one_left.max_tokens, one_left.min_tokens) == (False, 1, 1)


def test_a_cut_from_newer_weights_names_the_newest_chunk_version() -> None:
    """Kills ``versions[-1] -> versions[-2]`` in the message."""
    ck = checkpoint(chunk_weight=WEIGHTS + 3)
    admission = child_admission("r1-a1", "c2b", ck.root, ck.root_full, ck.continuation)
    with pytest.raises(GenerationCutError, match=rf"newer weights \({WEIGHTS + 3} > current {WEIGHTS}\)"):
        fetch_cut_prefix(admission, ck.store, current_weight_version=WEIGHTS)


def test_generated_tokens_inside_the_first_chunk_must_not_return_to_prompt_carry() -> None:
    """Kills ``1.0 in masks`` -> ``not in`` (masks ``0... 1 0 1...`` accepted)."""
    ck = checkpoint()
    first = ck.records[0]
    masks, logprobs = list(first.token_mask_delta), list(first.generation_log_probs_delta)
    flipped = masks.index(1.0) + 1
    masks[flipped], logprobs[flipped] = 0.0, 0.0
    forged = StagedCallRecord.from_components(
        rollout_id=first.rollout_id,
        model_call_id=first.model_call_id,
        parent_call_id=first.parent_call_id,
        mode=first.mode,
        prev_len=first.prev_len,
        delta_len=first.delta_len,
        cum_len=first.cum_len,
        weight_version=first.weight_version,
        token_ids_delta=list(first.token_ids_delta),
        token_mask_delta=masks,
        generation_log_probs_delta=logprobs,
        extras=None,
        extras_digest=first.extras_digest,
        chain_hash=first.chain_hash,
        cumulative_hash=first.cumulative_hash,
    )
    snapshots = [StagedCallSnapshot.model_validate(r.model_dump()) for r in (forged, ck.records[1])]
    admission = child_admission("r1-a1", "c2b", ck.root, ck.root_full, ck.continuation)
    with pytest.raises(GenerationCutError, match="zeros followed by ones"):
        rebuild_cut_prefix(admission, snapshots, current_weight_version=WEIGHTS)


def test_a_cut_of_three_chunks_with_rising_weights_continues_exactly() -> None:
    """A prefix and two chunks, the last from newer weights: the rebuilt prefix keeps the oldest version,
    a current version below the newest chunk is refused, and the continuation equals an uninterrupted run."""
    base = checkpoint()
    store = base.store
    capture = RolloutTokenCapture(sink=store, weight_version_fn=lambda: WEIGHTS)
    call = capture.begin_call(child_admission("r1", "c2", base.root, base.root_full))
    ids, lps = base.generation.token_ids, base.generation.logprobs
    middle = (CUT_AT + CHUNK_END) // 2
    rows = [
        build_prefix_record(
            call, prompt_token_ids=base.prompt, generated_token_ids=ids[:CUT_AT], generated_logprobs=lps[:CUT_AT]
        ),
        build_generation_chunk_record(call, chunk_token_ids=ids[CUT_AT:middle], chunk_logprobs=lps[CUT_AT:middle]),
    ]
    rows.append(
        build_generation_chunk_record(
            call,
            chunk_token_ids=ids[middle:CHUNK_END],
            chunk_logprobs=lps[middle:CHUNK_END],
            weight_version=WEIGHTS + 1,
        )
    )
    keys = []
    for sequence, row in enumerate(rows):
        result = store.stage_generation_prefix(row, checkpoint_id="ck3", chunk_sequence=sequence)
        assert result.ok and result.staging_key is not None
        keys.append(result.staging_key)
    continuation = build_cut_continuation(call, rows, keys, effective_output_limit=TOTAL)
    assert continuation.prefix_token_count == CHUNK_END and len(continuation.staging_keys) == 3
    admission = child_admission("r1-a1", "c2b", base.root, base.root_full, continuation)
    with pytest.raises(GenerationCutError, match="newer weights"):
        fetch_cut_prefix(admission, store, current_weight_version=WEIGHTS)
    snapshot = fetch_cut_prefix(admission, store, current_weight_version=WEIGHTS + 1)
    assert (
        snapshot.weight_version == WEIGHTS and snapshot.delta_len == len(rows[0].token_ids_delta) + CHUNK_END - CUT_AT
    )
    resumed = RolloutTokenCapture(sink=store, weight_version_fn=lambda: WEIGHTS + 1)
    live = resumed.begin_call(admission, generation_cut=snapshot, generation_cut_staging_keys=continuation.staging_keys)
    plan = plan_cut_continuation(live)
    assert plan.prompt_token_ids == base.prompt + ids[:CHUNK_END] and plan.max_tokens == TOTAL - CHUNK_END
    coords = resumed.complete_call(
        live,
        prompt_token_ids=plan.prompt_token_ids,
        generated_token_ids=ids[CHUNK_END:],
        generated_logprobs=lps[CHUNK_END:],
    )
    assert coords.model_dump() == uninterrupted(base, WEIGHTS).model_dump()
    # Swapping the last two chunks makes the versions decrease.
    with pytest.raises(GenerationCutError, match="decrease"):
        build_cut_continuation(call, [rows[0], rows[2], rows[1]], keys, effective_output_limit=TOTAL)
