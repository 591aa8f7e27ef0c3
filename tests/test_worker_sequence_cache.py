"""The worker's sequence cache never changes an outcome; it only skips checks it can prove another way.

Proofs match the exact type and value of every id (``marshal`` version 2 bytes), so equal-but-distinct int
objects are proved while ``True``, ``1.0`` or int subclasses always fall back to the reference path. The
property test drives a cached and an uncached capture through the same random rollouts (branches, retries,
evictions, bad input) and requires the same outcome for every call, byte for byte.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, TypedDict

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sink.contract.digest import hash_token_ids
from sink.contract.packed import staging_delta_columns
from sink.contract.packed_record import StageableRecord
from sink.contract.records import CaptureAdmission, CommitCoords, StageResult
from sink.store.memory import MemoryStagingStore
from tests.helpers.capture import make_capture
from worker import CaptureError, RolloutTokenCapture
from worker.sequence_cache import EMPTY_SEQUENCE, ProvenSequence, SequenceHashCache


class _Sub(int):
    """An int subclass: equal to an int, yet not an exact int (the contract rejects it)."""


def _fresh(values: list[int]) -> list[int]:
    """Equal ids as distinct objects (for ids beyond the interpreter's small-int cache)."""
    return [int(str(value)) for value in values]


class AcknowledgingSink:
    def stage(self, record: StageableRecord) -> StageResult:
        return StageResult(ok=True, staging_key=record.staging_key)


# --- ProvenSequence ------------------------------------------------------------------------------------


def test_a_proof_hashes_like_the_reference_and_holds_only_for_exact_equal_ids() -> None:
    first, second = [500, 600, 700], [800, 0, 1]
    proof = EMPTY_SEQUENCE.extended(first).extended(second)
    assert proof.length == 6 and len(proof.packed) == len(proof.keys) == 2
    assert proof.cumulative_hash() == hash_token_ids(first + second)
    assert proof.holds(first + second)
    assert proof.holds(_fresh(first) + second)  # equal values, distinct objects: the same exact ints
    assert not proof.holds(first + second[:2])  # wrong length
    assert not proof.holds([*first, 800, 0, 2])  # another value
    assert not proof.holds([*first, 800, 0, True])  # True == 1, but it is not an exact int
    assert not proof.holds([*first, 800, 0.0, 1])  # type: ignore[list-item]
    assert not proof.holds([*first, 800, _Sub(0), 1])
    assert not proof.holds([*first, 800, -0, -1])
    assert EMPTY_SEQUENCE.holds([]) and EMPTY_SEQUENCE.cumulative_hash() == hash_token_ids([])


@pytest.mark.parametrize("big", [2**31 - 1, 2**31, 2**40, 2**63, 2**64 - 1])
def test_a_proof_holds_large_ids_by_value_only(big: int) -> None:
    proof = EMPTY_SEQUENCE.extended([7, big])
    assert proof.cumulative_hash() == hash_token_ids([7, big])
    assert proof.holds(_fresh([7, big]))
    assert not proof.holds([7, big - 1]) and not proof.holds([big, 7])
    assert not proof.holds([7, float(big)])  # type: ignore[list-item]


def test_a_proof_split_in_pieces_needs_every_piece() -> None:
    proof = EMPTY_SEQUENCE.extended([1, 2**40]).extended([3]).extended([2**35, 4])
    assert proof.holds([1, 2**40, 3, 2**35, 4])
    assert not proof.holds([1, 2**40, 3, 2**35, 5]) and not proof.holds([1, 2**40, 4, 2**35, 4])
    assert not proof.holds([1, 2**40 + 1, 3, 2**35, 4])


def test_a_proof_survives_changes_to_the_callers_list() -> None:
    ids = [5000, 6000]
    originals = list(ids)
    proof = EMPTY_SEQUENCE.extended(ids)
    ids[0] = 7000  # the proof owns a private copy of the objects it proved
    assert proof.holds(list(originals)) and not proof.holds(list(ids))
    assert proof.cumulative_hash() == hash_token_ids([5000, 6000])


@pytest.mark.parametrize("bad", [True, 1.0, -1, _Sub(3), 2**64, "1", None])
def test_a_proof_applies_the_reference_type_gate(bad: Any) -> None:
    with pytest.raises(ValueError):
        EMPTY_SEQUENCE.extended([1, bad])


_SMALL_IDS = st.lists(st.integers(0, 2**31 - 1), max_size=40)


@given(_SMALL_IDS, _SMALL_IDS.filter(bool))
def test_a_proof_of_proved_delta_columns_reuses_their_marshal_pass_and_equals_the_plain_proof(
    carried: list[int], generated: list[int]
) -> None:
    proved = staging_delta_columns(carried, generated, [-0.5] * len(generated))
    assert proved is not None and proved.token_ids is not None and proved.ids_marshal is not None
    base = EMPTY_SEQUENCE.extended([900, 1000])
    reused = base.extended(proved.token_ids, proved=proved)
    plain = base.extended(list(proved.token_ids))
    assert reused.keys[-1].obj is proved.ids_marshal  # no second marshal pass over the delta
    assert reused.length == plain.length == 2 + len(carried) + len(generated)
    assert reused.packed == plain.packed and list(map(bytes, reused.keys)) == list(map(bytes, plain.keys))
    sequence = [900, 1000, *carried, *generated]
    assert reused.holds(_fresh(sequence)) and reused.cumulative_hash() == hash_token_ids(sequence)
    assert not reused.holds([900, 1000, *carried, *generated[:-1], generated[-1] + 1])


def test_a_proof_does_not_take_packed_ids_the_columns_no_longer_hold() -> None:
    proved = staging_delta_columns([700], [800, 900], [-0.5, -0.25])
    assert proved is not None and proved.token_ids is not None
    proved.packed.digest_forms()  # releases the transient digest forms, ids_u64be among them
    proof = EMPTY_SEQUENCE.extended(proved.token_ids, proved=proved)
    assert proof.length == 3 and proof.cumulative_hash() == hash_token_ids([700, 800, 900])
    assert proof.holds(_fresh([700, 800, 900]))


class _RecordHashes(TypedDict):
    chain_hash: str
    cumulative_hash: str


_HASHES: _RecordHashes = {"chain_hash": "c" * 64, "cumulative_hash": "d" * 64}  # not read by these tests


# --- SequenceHashCache ---------------------------------------------------------------------------------


def _proof(*ids: int) -> ProvenSequence:
    return EMPTY_SEQUENCE.extended(list(ids))


def test_the_cache_is_an_lru_over_rollouts_and_over_calls() -> None:
    cache = SequenceHashCache(max_rollouts=2, calls_per_rollout=2)
    a, b, c = _proof(1), _proof(2), _proof(3)
    cache.remember("r1", "c1", a, **_HASHES)
    cache.remember("r1", "c2", b, **_HASHES)
    cache.remember("r1", "c3", c, **_HASHES)  # evicts r1/c1
    assert cache.lookup("r1", "c1") is None and cache.lookup("r1", "c2") is b and cache.lookup("r1", "c3") is c
    cache.remember("r2", "c1", a, **_HASHES)
    cache.remember("r3", "c1", b, **_HASHES)  # evicts r1, the least recently remembered rollout
    assert len(cache) == 2 and cache.lookup("r1", "c3") is None and cache.lookup("r3", "c1") is b
    assert cache.lookup("r2", None) is EMPTY_SEQUENCE  # a root's prefix is the empty sequence
    with pytest.raises(ValueError):
        SequenceHashCache(0)


def test_the_cache_is_thread_safe() -> None:
    cache = SequenceHashCache(max_rollouts=8)
    proofs = [_proof(n) for n in range(16)]
    errors: list[BaseException] = []

    def worker(offset: int) -> None:
        try:
            for n in range(2000):
                cache.remember(f"r{(n + offset) % 12}", f"c{n % 5}", proofs[n % 16], **_HASHES)
                found = cache.lookup(f"r{n % 12}", f"c{n % 5}")
                assert found is None or isinstance(found, ProvenSequence)
        except BaseException as exc:  # noqa: BLE001 -- surfaced by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors and len(cache) <= 8


# --- the capture: cached == uncached ------------------------------------------------------------------


@dataclass
class _Rollout:
    """Drives the same calls through a cached and an uncached capture and checks they agree."""

    rollout_id: str
    caches: tuple[int, ...] = (64, 0)

    def __post_init__(self) -> None:
        self.captures = [
            RolloutTokenCapture(sink=AcknowledgingSink(), weight_version_fn=lambda: 3, sequence_cache_rollouts=n)
            for n in self.caches
        ]
        self.count = 0
        self.full: dict[str, list[int]] = {}  # staged call id -> its full sequence (the engine's objects)

    def call(
        self,
        parent: CommitCoords | None,
        *,
        carry: list[int],
        generated: list[int],
        prefix: Any = "same",
        prompt_head: list[Any] | None = None,
        inline: bool = False,
    ) -> CommitCoords:
        """One call; *prefix* is ``"same"`` (the parent's objects), ``None`` or an explicit list."""
        self.count += 1
        call_id = f"c{self.count}"
        if parent is None:
            admission = CaptureAdmission(rollout_id=self.rollout_id, model_call_id=call_id, mode="text")
            explicit = None
            parent_full: list[int] = []
        else:
            parent_full = self.full[parent.model_call_id]
            admission = CaptureAdmission(
                rollout_id=self.rollout_id,
                model_call_id=call_id,
                parent_call_id=parent.model_call_id,
                prev_len=parent.cum_len,
                mode="token_in",
                required_prefix_token_ids=list(parent_full) if inline else [],
                staging_chain=[] if inline else ["unused"],
                parent_chain_hash=parent.chain_hash,
            )
            explicit = parent_full if prefix == "same" else prefix
        head = parent_full if prompt_head is None else prompt_head
        prompt = head + carry
        logprobs = [-0.5] * len(generated)
        outcomes: list[tuple[str, str | CommitCoords]] = []
        for capture in self.captures:
            try:
                active = capture.begin_call(admission, prefix_token_ids=explicit)
            except CaptureError as exc:
                outcomes.append(("CaptureError", type(exc).__name__))
                continue
            coords = capture.complete_call(
                active, prompt_token_ids=prompt, generated_token_ids=generated, generated_logprobs=logprobs
            )
            outcomes.append(("coords", coords))
        assert all(outcome == outcomes[0] for outcome in outcomes), outcomes
        kind, result = outcomes[0]
        if kind != "coords":
            return CommitCoords(
                rollout_id=self.rollout_id,
                model_call_id=call_id,
                parent_call_id=admission.parent_call_id,
                prev_len=admission.prev_len,
                delta_len=0,
                cum_len=admission.prev_len,
                weight_version=3,
                disposition="capture_failed",
            )
        assert isinstance(result, CommitCoords)
        if result.disposition == "staged":
            self.full[call_id] = prompt + generated
        return result


_IDS = st.lists(st.sampled_from([0, 1, 2, 255, 300, 7_000, 150_000, 2**31 + 5, 2**40]), max_size=6)
_CORRUPT = st.sampled_from(["none"] * 6 + ["fresh", "bool", "float", "negative", "subclass", "value"])


def _corrupted(values: list[int], how: str, position: int) -> list[Any]:
    """*values* with one id replaced as *how* says (equal in value where the bad type allows it)."""
    out: list[Any] = list(values) if how != "fresh" else _fresh(values)
    if not values or how in ("none", "fresh"):
        return out
    at = position % len(values)
    value = values[at]
    out[at] = {
        "bool": bool(value) if value in (0, 1) else True,
        "float": float(value),
        "negative": -1 - value,
        "subclass": _Sub(value),
        "value": value + 1,
    }[how]
    return out


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    caches=st.sampled_from([(64, 0), (1, 0), (2, 0)]),
    steps=st.lists(
        st.tuples(
            st.sampled_from(["r1", "r2", "r3"]),
            st.integers(min_value=0, max_value=50),  # which staged call is the parent (0: a new root)
            _IDS,
            st.lists(st.sampled_from([3, 301, 9_999]), min_size=1, max_size=4),
            st.sampled_from(["same"] * 4 + ["fresh", "bad", "inline", "none"]),  # the explicit prefix
            st.tuples(_CORRUPT, st.integers(min_value=0, max_value=99)),  # the prompt's head
            st.tuples(_CORRUPT, st.integers(min_value=0, max_value=99)),  # a bad explicit prefix
        ),
        min_size=1,
        max_size=14,
    ),
)
def test_cached_and_uncached_captures_agree(caches: tuple[int, int], steps: list[Any]) -> None:
    rollouts: dict[str, _Rollout] = {}
    staged: dict[str, list[CommitCoords]] = {}
    for rollout_id, pick, carry, generated, prefix_kind, (head_how, head_at), (bad_how, bad_at) in steps:
        rollout = rollouts.setdefault(rollout_id, _Rollout(rollout_id, caches))
        known = staged.setdefault(rollout_id, [])
        parent = known[(pick - 1) % len(known)] if known and pick else None  # older calls: retries, siblings
        full = rollout.full[parent.model_call_id] if parent is not None else []
        prefix: Any = "same"
        if prefix_kind == "fresh":
            prefix = _fresh(full)
        elif prefix_kind == "bad":
            prefix = _corrupted(full, bad_how, bad_at)
        elif prefix_kind in ("inline", "none"):
            prefix = None
        head = _corrupted(full, head_how, head_at) if head_how != "none" else None
        coords = rollout.call(
            parent, carry=carry, generated=generated, prefix=prefix, prompt_head=head, inline=prefix_kind == "inline"
        )
        if coords.disposition == "staged":
            known.append(coords)


def test_a_prompt_with_true_for_one_in_its_prefix_fails_as_without_the_cache() -> None:
    """The old value-keyed cache re-used the parent's bytes here; the reference path rejects the bool."""
    rollout = _Rollout("r")
    root = rollout.call(None, carry=[1, 500], generated=[600])
    child = rollout.call(root, carry=[700], generated=[800], prompt_head=[True, 500, 600])
    assert child.disposition == "capture_failed"


def test_a_bool_in_an_explicit_prefix_raises_as_without_the_cache() -> None:
    rollout = _Rollout("r")
    root = rollout.call(None, carry=[1, 500], generated=[600])
    failed = rollout.call(root, carry=[700], generated=[800], prefix=[True, 500, 600])
    assert failed.disposition == "capture_failed"  # both captures raised CaptureError at begin


def test_the_parents_ids_take_the_proved_path_as_any_objects() -> None:
    capture = RolloutTokenCapture(sink=AcknowledgingSink(), weight_version_fn=lambda: 1)
    prompt, generated = [400, 401], [402]
    root = capture.complete_call(
        capture.begin_call(CaptureAdmission(rollout_id="r", model_call_id="c1", mode="text")),
        prompt_token_ids=prompt,
        generated_token_ids=generated,
        generated_logprobs=[-0.5],
    )
    sequence = prompt + generated
    admission = CaptureAdmission(
        rollout_id="r",
        model_call_id="c2",
        parent_call_id="c1",
        prev_len=3,
        mode="token_in",
        staging_chain=["unused"],
        parent_chain_hash=root.chain_hash,
    )
    proved = capture.begin_call(admission, prefix_token_ids=sequence)
    assert proved._prefix_proof is not None and proved.prefix_token_ids is not sequence  # a private snapshot
    sequence.append(403)  # later changes to the caller's list cannot reach the call
    assert proved.prefix_token_ids == [400, 401, 402]
    fresh = _fresh([400, 401, 402])
    distinct = capture.begin_call(admission, prefix_token_ids=fresh)
    assert distinct._prefix_proof is proved._prefix_proof and distinct.prefix_token_ids is not fresh
    other = capture.begin_call(admission, prefix_token_ids=[400, 401, 403])
    assert other._prefix_proof is None  # another value: checked the reference way
    with pytest.raises(CaptureError):
        capture.begin_call(admission, prefix_token_ids=[400, 401, _Sub(402)])


def test_an_engine_echoing_fresh_prompt_objects_keeps_the_proof_and_the_hashes() -> None:
    """A prompt head of equal-but-new objects is proved in one marshal pass and re-uses the parent's packed ids."""
    rollout = _Rollout("r")
    root = rollout.call(None, carry=[400, 401], generated=[402])
    parent_full = rollout.full[root.model_call_id]
    child = rollout.call(root, carry=[403], generated=[404], prompt_head=_fresh(parent_full))
    assert child.disposition == "staged"
    cached = rollout.captures[0]._sequences
    assert cached is not None
    proof = cached.lookup("r", child.model_call_id)
    assert proof is not None and proof.holds(list(rollout.full[child.model_call_id]))  # the next call hits
    bad = rollout.call(root, carry=[403], generated=[404], prompt_head=[400, 401, _Sub(402)])
    assert bad.disposition == "capture_failed"


# --- by reference: a parent this capture built needs only its own record ------------------------------


class _CountingSource:
    """The memory store as a source, recording the keys of every fetch (the store answers)."""

    def __init__(self, store: MemoryStagingStore) -> None:
        self.store = store
        self.fetches: list[list[str]] = []

    def fetch(self, keys: list[str]) -> list[Any]:
        self.fetches.append(list(keys))
        return self.store.fetch(keys)


def _by_reference_rollout(capture: RolloutTokenCapture, turns: int) -> list[CommitCoords]:
    """*turns* calls, each continuing the previous one by reference (its staging chain so far)."""
    coords: list[CommitCoords] = []
    sequence: list[int] = []
    for turn in range(turns):
        carry, generated = [1000 + 10 * turn, 1001 + 10 * turn], [1002 + 10 * turn]
        if not coords:
            admission = CaptureAdmission(rollout_id="r", model_call_id="c0", mode="text")
        else:
            parent = coords[-1]
            admission = CaptureAdmission(
                rollout_id="r",
                model_call_id=f"c{turn}",
                parent_call_id=parent.model_call_id,
                prev_len=parent.cum_len,
                mode="token_in",
                staging_chain=[c.staging_key for c in coords if c.staging_key is not None],
                parent_chain_hash=parent.chain_hash,
            )
        active = capture.begin_call(admission)
        assert active.prefix_token_ids == sequence
        prompt = _fresh(sequence) + carry  # the engine echoes the prompt as new objects
        coords.append(
            capture.complete_call(
                active, prompt_token_ids=prompt, generated_token_ids=generated, generated_logprobs=[-0.5]
            )
        )
        sequence = prompt + generated
    return coords


def test_a_by_reference_child_of_a_parent_the_capture_built_fetches_only_that_parent() -> None:
    store = MemoryStagingStore()
    source = _CountingSource(store)
    cached = _by_reference_rollout(make_capture(store, source, sequence_cache_rollouts=64), 5)
    reference_store = MemoryStagingStore()
    reference = _by_reference_rollout(make_capture(reference_store, reference_store, sequence_cache_rollouts=0), 5)
    assert [c.disposition for c in cached] == ["staged"] * 5
    assert cached == reference  # byte for byte the coordinates of the reference path
    assert source.fetches == [["r/c0"], ["r/c1"], ["r/c2"], ["r/c3"]]  # not the whole chain


def test_a_parent_record_that_is_not_the_one_the_capture_built_checks_the_whole_chain() -> None:
    """The source holds another c0 than the one the capture built (and the admission names): the short path
    refuses it, the whole chain is fetched and checked, and the call fails exactly as without the cache."""
    theirs = MemoryStagingStore()
    _by_reference_rollout(make_capture(theirs, sequence_cache_rollouts=0), 1)
    outcomes = []
    for cached_rollouts in (64, 0):
        source = _CountingSource(theirs)
        capture = make_capture(MemoryStagingStore(), source, sequence_cache_rollouts=cached_rollouts)
        root = capture.complete_call(
            capture.begin_call(CaptureAdmission(rollout_id="r", model_call_id="c0", mode="text")),
            prompt_token_ids=[7, 8],
            generated_token_ids=[9],
            generated_logprobs=[-0.5],
        )
        admission = CaptureAdmission(
            rollout_id="r",
            model_call_id="c1",
            parent_call_id="c0",
            prev_len=root.cum_len,
            mode="token_in",
            staging_chain=["r/c0"],
            parent_chain_hash=root.chain_hash,
        )
        call = capture.begin_call(admission)
        outcomes.append((call.capture_failure, call.prefix_token_ids))
        expected = [["r/c0"], ["r/c0"]] if cached_rollouts else [["r/c0"]]  # the parent alone, then the chain
        assert source.fetches == expected
    assert outcomes[0] == outcomes[1] and outcomes[0][0] is not None and "parent_chain_hash" in outcomes[0][0]


def test_a_missing_parent_record_fails_the_call_as_without_the_cache() -> None:
    outcomes = []
    for cached_rollouts in (64, 0):
        store = MemoryStagingStore()
        source = _CountingSource(store)
        capture = make_capture(store, source, sequence_cache_rollouts=cached_rollouts)
        coords = _by_reference_rollout(capture, 2)
        assert store.clear(["r/c1"]) == 1
        admission = CaptureAdmission(
            rollout_id="r",
            model_call_id="c2",
            parent_call_id="c1",
            prev_len=coords[1].cum_len,
            mode="token_in",
            staging_chain=["r/c0", "r/c1"],
            parent_chain_hash=coords[1].chain_hash,
        )
        call = capture.begin_call(admission)
        outcomes.append(call.capture_failure)
        expected = [["r/c1"], ["r/c0", "r/c1"]] if cached_rollouts else [["r/c0", "r/c1"]]
        assert source.fetches[-len(expected) :] == expected  # the parent, then the whole chain as before
    assert outcomes[0] == outcomes[1] and outcomes[0] is not None and "staging chain fetch failed" in outcomes[0]


@pytest.mark.parametrize(
    "chain",
    [
        ["r/c2"],  # the ancestors left out
        ["r/c1", "r/c0", "r/c2"],  # out of order
        ["r/c0", "r/c0", "r/c2"],  # an ancestor twice, another missing
        ["r/absent", "r/c1", "r/c2"],  # a key with no record
    ],
)
def test_a_staging_chain_the_whole_chain_check_refuses_fails_as_without_the_cache(chain: list[str]) -> None:
    """The last key is the parent's own record, yet the keys before it are not the chain its prefix was checked
    with: the short path must not accept what the whole-chain check refuses (§5.2, §5.9)."""
    outcomes = []
    for cached_rollouts in (64, 0):
        store = MemoryStagingStore()
        capture = make_capture(store, _CountingSource(store), sequence_cache_rollouts=cached_rollouts)
        coords = _by_reference_rollout(capture, 3)
        admission = CaptureAdmission(
            rollout_id="r",
            model_call_id="c3",
            parent_call_id="c2",
            prev_len=coords[2].cum_len,
            mode="token_in",
            staging_chain=chain,
            parent_chain_hash=coords[2].chain_hash,
        )
        outcomes.append(capture.begin_call(admission).capture_failure)
    assert outcomes[1] is not None  # the reference path refuses the chain
    assert outcomes[0] == outcomes[1]
