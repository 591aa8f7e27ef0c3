"""RolloutTokenCapture (contract §5): begin, complete, fail, prefix resolution, concurrency.

Uses the in-memory store as sink and source; the contract's §4.8 check values
pin the staged coordinates byte for byte.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

import anyio
import pytest

from sink.digest import compute_chain_hash, compute_extras_digest, hash_token_ids
from sink.errors import StagingError
from sink.packed import PackedSnapshot
from sink.records import CaptureAdmission, CommitCoords, StagedCallRecord, StagedCallSnapshot, StageResult
from sink.store.memory import MemoryStagingStore
from worker import (
    ActiveCall,
    CaptureError,
    PrefixResolutionError,
    RolloutTokenCapture,
    StreamingUnsupportedError,
    aresolve_prefix,
    resolve_prefix,
)

# §4.8 check values: root c1 and child c2 of rollout-1, weight 7.
ROOT_CHAIN = "14c5e45c969e9b8b821f302201ad9d9b6b4f7427ac18dab2cb150af8e3acdd65"
ROOT_CUMULATIVE = "21c8e66807865ae05ca6f5bca40bd4a1399a66c23fb9848216a23c2ab9d9858f"
ROOT_DIGEST = "8af9f9ca6164804ce4624f3ac42478714694b25bcd861d96611c71f5cb15ca93"
CHILD_CHAIN = "5ca11828ba5b13cb84473842daeec0b7b88f2d1b31435509de0d3c2fc7607f70"
CHILD_CUMULATIVE = "3918f976cd9824c692b3fe34ef047dd276d49af97ec8f86154ef43b345beb4d8"
CHILD_DIGEST = "34c30a3b94fa73ed21ade56db0c8ecebe2b92b842b6d02e0b8c4146e9f0b1847"
EMPTY_EXTRAS = "a1edc33c107616cf344faf0103daa025cfb125f8e1c784ae5f6a49faf2b768b6"

ROOT_PROMPT, ROOT_GEN, ROOT_LPS = [10, 11], [12], [-0.25]
CHILD_PROMPT, CHILD_GEN, CHILD_LPS = [10, 11, 12, 20, 21], [22, 23], [-0.3, -0.4]
GRAND_PROMPT = [10, 11, 12, 20, 21, 22, 23, 30]
GRAND_GEN, GRAND_LPS = [31, 32, 33], [-0.5, -1.0, -0.125]
ROOT_KWARGS: dict[str, Any] = {
    "prompt_token_ids": ROOT_PROMPT,
    "generated_token_ids": ROOT_GEN,
    "generated_logprobs": ROOT_LPS,
}


class RecordingSink:
    """A sink that records every call and answers with a configurable behaviour."""

    def __init__(self, answer: Any = None, *, error: Exception | None = None) -> None:
        self.store = MemoryStagingStore()
        self.answer = answer
        self.error = error
        self.records: list[StagedCallRecord] = []

    def stage(self, record: StagedCallRecord) -> Any:
        self.records.append(record)
        if self.error is not None:
            raise self.error
        if self.answer is not None:
            return self.answer
        return self.store.stage(record)


def make_capture(sink: Any = None, source: Any = None, version: Any = 7, **kwargs: Any) -> RolloutTokenCapture:
    return RolloutTokenCapture(
        sink=sink if sink is not None else MemoryStagingStore(),
        weight_version_fn=lambda: version,
        source=source,
        **kwargs,
    )


def root_admission(call_id: str = "c1") -> CaptureAdmission:
    return CaptureAdmission(rollout_id="rollout-1", model_call_id=call_id, mode="text")


def child_admission(
    parent: CommitCoords, prefix: list[int], call_id: str, chain: list[str] | None = None
) -> CaptureAdmission:
    """A token_in admission: inline *prefix*, or by reference when *chain* is given."""
    return CaptureAdmission(
        rollout_id="rollout-1",
        model_call_id=call_id,
        parent_call_id=parent.model_call_id,
        prev_len=parent.cum_len,
        mode="token_in",
        required_prefix_token_ids=[] if chain else prefix,
        staging_chain=chain or [],
        parent_chain_hash=parent.chain_hash,
    )


def expected_failed(admission: CaptureAdmission, weight_version: int) -> dict[str, Any]:
    """The exact §5.8 shape."""
    return {
        "schema_version": 2,
        "digest_version": 2,
        "extras_digest_version": 1,
        "rollout_id": admission.rollout_id,
        "model_call_id": admission.model_call_id,
        "parent_call_id": admission.parent_call_id,
        "prev_len": admission.prev_len,
        "delta_len": 0,
        "cum_len": admission.prev_len,
        "weight_version": weight_version,
        "disposition": "capture_failed",
        "digest": None,
        "extras_digest": None,
        "staging_key": None,
        "chain_hash": None,
        "cumulative_hash": None,
    }


def run_three_calls(capture: RolloutTokenCapture, *, by_reference: bool = False) -> list[CommitCoords]:
    """Root, child and grandchild; by reference the admissions carry staging_chain."""
    root = capture.complete_call(
        capture.begin_call(root_admission()),
        prompt_token_ids=ROOT_PROMPT,
        generated_token_ids=ROOT_GEN,
        generated_logprobs=ROOT_LPS,
    )
    assert root.staging_key is not None
    child_adm = child_admission(root, ROOT_PROMPT + ROOT_GEN, "c2", [root.staging_key] if by_reference else None)
    child = capture.complete_call(
        capture.begin_call(child_adm),
        prompt_token_ids=CHILD_PROMPT,
        generated_token_ids=CHILD_GEN,
        generated_logprobs=CHILD_LPS,
    )
    assert child.staging_key is not None
    chain = [root.staging_key, child.staging_key] if by_reference else None
    grand_adm = child_admission(child, CHILD_PROMPT + CHILD_GEN, "c3", chain)
    grand = capture.complete_call(
        capture.begin_call(grand_adm),
        prompt_token_ids=GRAND_PROMPT,
        generated_token_ids=GRAND_GEN,
        generated_logprobs=GRAND_LPS,
    )
    return [root, child, grand]


# --- staged coordinates -------------------------------------------------------


def test_root_and_child_match_the_contract_check_values() -> None:
    store = MemoryStagingStore()
    root, child, grand = run_three_calls(make_capture(store))
    assert (root.digest, root.chain_hash, root.cumulative_hash) == (ROOT_DIGEST, ROOT_CHAIN, ROOT_CUMULATIVE)
    assert (root.prev_len, root.delta_len, root.cum_len, root.weight_version) == (0, 3, 3, 7)
    assert (child.digest, child.chain_hash, child.cumulative_hash) == (CHILD_DIGEST, CHILD_CHAIN, CHILD_CUMULATIVE)
    assert (child.parent_call_id, child.prev_len, child.delta_len, child.cum_len) == ("c1", 3, 4, 7)
    assert child.extras_digest == EMPTY_EXTRAS and child.staging_key == "rollout-1/c2"
    assert grand.chain_hash == compute_chain_hash(CHILD_CHAIN, [30, 31, 32, 33])
    assert grand.cumulative_hash == hash_token_ids(GRAND_PROMPT + GRAND_GEN)
    (snapshot,) = store.fetch(["rollout-1/c2"])
    assert snapshot.token_mask_delta == [0.0, 0.0, 1.0, 1.0]
    assert snapshot.generation_log_probs_delta == [0.0, 0.0, -0.3, -0.4]


class PackedMemoryStore(MemoryStagingStore):
    """A memory store whose source side also serves packed snapshots."""

    def fetch_packed(self, staging_keys: Sequence[str]) -> list[PackedSnapshot]:
        return [PackedSnapshot.of(snapshot) for snapshot in self.fetch(staging_keys)]


@pytest.mark.parametrize("store_class", [MemoryStagingStore, PackedMemoryStore], ids=["snapshots", "packed"])
def test_inline_and_staging_chain_admissions_give_byte_identical_coords(store_class: type[MemoryStagingStore]) -> None:
    inline = run_three_calls(make_capture())
    chain_store = store_class()
    by_reference = run_three_calls(make_capture(chain_store, source=chain_store), by_reference=True)
    assert [c.model_dump_json() for c in inline] == [c.model_dump_json() for c in by_reference]
    assert all(c.disposition == "staged" for c in by_reference)


def test_host_resolved_prefix_gives_identical_coords() -> None:
    store = MemoryStagingStore()
    capture = make_capture(store)
    root, child, _ = run_three_calls(capture)
    admission = child_admission(child, [], "c9", ["rollout-1/c1", "rollout-1/c2"])
    prefix = resolve_prefix(admission, store)
    assert prefix == CHILD_PROMPT + CHILD_GEN
    coords = capture.complete_call(
        capture.begin_call(admission, prefix_token_ids=prefix),
        prompt_token_ids=GRAND_PROMPT,
        generated_token_ids=GRAND_GEN,
        generated_logprobs=GRAND_LPS,
    )
    assert coords.chain_hash == compute_chain_hash(CHILD_CHAIN, [30, 31, 32, 33])
    assert resolve_prefix(root_admission(), store) == []
    assert resolve_prefix(child_admission(root, [10, 11, 12], "x"), store) == [10, 11, 12]


def test_extras_are_staged_and_digested() -> None:
    store = MemoryStagingStore()
    capture = make_capture(store)
    extras = {"routed_experts": [[[1, 2]], [[3, 4]], [[5, 6]]]}
    coords = capture.complete_call(
        capture.begin_call(root_admission()),
        prompt_token_ids=ROOT_PROMPT,
        generated_token_ids=ROOT_GEN,
        generated_logprobs=ROOT_LPS,
        extras=extras,
    )
    assert coords.extras_digest == compute_extras_digest(extras)
    assert store.fetch(["rollout-1/c1"])[0].extras == extras


# --- begin_call argument checks -------------------------------------------------


def test_begin_call_rejects_caller_bugs() -> None:
    capture = make_capture()
    root_coords = run_three_calls(make_capture())[0]
    child = child_admission(root_coords, [10, 11, 12], "c2")
    with pytest.raises(TypeError):
        capture.begin_call(root_admission().model_dump())  # type: ignore[arg-type]
    with pytest.raises(StreamingUnsupportedError) as streaming:
        capture.begin_call(root_admission(), stream=True)
    assert isinstance(streaming.value, CaptureError) and isinstance(streaming.value, StagingError)
    with pytest.raises(CaptureError, match="text root"):
        capture.begin_call(root_admission(), prefix_token_ids=[1])
    assert capture.begin_call(root_admission(), prefix_token_ids=[]).prefix_token_ids == []
    with pytest.raises(CaptureError, match="prev_len"):
        capture.begin_call(child, prefix_token_ids=[10, 11])
    with pytest.raises(CaptureError, match="differs"):
        capture.begin_call(child, prefix_token_ids=[10, 11, 13])
    for bad in ([10, 11, True], [10, 11, -1], (10, 11, 12), [10, 11, 12.0]):
        with pytest.raises(CaptureError, match="non-negative ints"):
            capture.begin_call(child, prefix_token_ids=bad)  # type: ignore[arg-type]
    by_reference = child.model_copy(update={"required_prefix_token_ids": [], "staging_chain": ["rollout-1/c1"]})
    with pytest.raises(CaptureError, match="resolved prefix"):
        capture.begin_call(by_reference)
    assert capture.begin_call(by_reference, prefix_token_ids=[10, 11, 12]).prefix_token_ids == [10, 11, 12]


@pytest.mark.parametrize("version", [True, -1, "3", 1.0, None])
def test_invalid_weight_versions_raise(version: Any) -> None:
    with pytest.raises(CaptureError, match="weight version"):
        make_capture(version=version).begin_call(root_admission())
    with pytest.raises(CaptureError, match="weight version"):
        make_capture().begin_call(root_admission(), weight_version=version if version is not None else -5)


def test_explicit_weight_version_is_stamped_once() -> None:
    versions = iter([3, 99])
    capture = RolloutTokenCapture(sink=MemoryStagingStore(), weight_version_fn=lambda: next(versions))
    call = capture.begin_call(root_admission())
    assert call.weight_version == 3
    coords = capture.complete_call(
        call, prompt_token_ids=ROOT_PROMPT, generated_token_ids=ROOT_GEN, generated_logprobs=ROOT_LPS
    )
    assert coords.weight_version == 3
    assert make_capture().begin_call(root_admission(), weight_version=0).weight_version == 0


def test_constructor_type_checks() -> None:
    with pytest.raises(TypeError):
        RolloutTokenCapture(sink=object(), weight_version_fn=lambda: 1)
    with pytest.raises(TypeError):
        RolloutTokenCapture(sink=MemoryStagingStore(), weight_version_fn=7)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        RolloutTokenCapture(sink=MemoryStagingStore(), weight_version_fn=lambda: 1, source=object())


# --- failure paths: exact §5.8 shape ---------------------------------------------


@pytest.mark.parametrize(
    ("sink", "logged"),
    [
        (RecordingSink(StageResult(ok=False, error="disk full")), "disk full"),
        (RecordingSink(error=RuntimeError("connection reset")), "connection reset"),
        (RecordingSink({"ok": True, "staging_key": "k"}), "not a StageResult"),
        (RecordingSink(StageResult.model_construct(ok=True, staging_key=None)), "rejected"),
    ],
    ids=["rejected", "raising", "dict-result", "keyless-ok"],
)
def test_sink_failures_give_failed_coords(sink: RecordingSink, logged: str, caplog: pytest.LogCaptureFixture) -> None:
    capture = make_capture(sink)
    call = capture.begin_call(root_admission())
    with caplog.at_level(logging.WARNING, logger="worker"):
        coords = capture.complete_call(
            call, prompt_token_ids=ROOT_PROMPT, generated_token_ids=ROOT_GEN, generated_logprobs=ROOT_LPS
        )
    assert coords.model_dump() == expected_failed(root_admission(), 7)
    assert len(sink.records) == 1
    assert logged in caplog.text
    with pytest.raises(CaptureError, match="already completed"):
        capture.fail_call(call, reason="again")


BUILD_FAILURES: dict[str, dict[str, Any]] = {
    "prefix-mismatch": {"prompt_token_ids": [10, 99, 12, 20], "generated_token_ids": [1], "generated_logprobs": [-1.0]},
    "short-prompt": {"prompt_token_ids": [10, 11], "generated_token_ids": [1], "generated_logprobs": [-1.0]},
    "length-mismatch": {"prompt_token_ids": [10, 11, 12], "generated_token_ids": [1, 2], "generated_logprobs": [-1.0]},
    "int-logprob": {"prompt_token_ids": [10, 11, 12], "generated_token_ids": [1], "generated_logprobs": [-1]},
    "nan-logprob": {
        "prompt_token_ids": [10, 11, 12],
        "generated_token_ids": [1],
        "generated_logprobs": [float("nan")],
    },
    "negative-id": {"prompt_token_ids": [10, 11, 12], "generated_token_ids": [-1], "generated_logprobs": [-1.0]},
    "bool-id": {"prompt_token_ids": [10, 11, 12], "generated_token_ids": [True], "generated_logprobs": [-1.0]},
    "huge-id": {"prompt_token_ids": [10, 11, 12], "generated_token_ids": [2**64], "generated_logprobs": [-1.0]},
    "empty-delta": {"prompt_token_ids": [10, 11, 12], "generated_token_ids": [], "generated_logprobs": []},
    "tuple-extras": {
        "prompt_token_ids": [10, 11, 12],
        "generated_token_ids": [1],
        "generated_logprobs": [-1.0],
        "extras": {"routed_experts": (1, 2)},
    },
}


@pytest.mark.parametrize("case", sorted(BUILD_FAILURES))
def test_build_failures_never_call_the_sink(case: str) -> None:
    sink = RecordingSink()
    capture = make_capture(sink)
    root = capture.complete_call(
        capture.begin_call(root_admission()),
        prompt_token_ids=ROOT_PROMPT,
        generated_token_ids=ROOT_GEN,
        generated_logprobs=ROOT_LPS,
    )
    admission = child_admission(root, [10, 11, 12], "c2")
    call = capture.begin_call(admission)
    coords = capture.complete_call(call, **BUILD_FAILURES[case])
    assert coords.model_dump() == expected_failed(admission, 7)
    assert [r.model_call_id for r in sink.records] == ["c1"]
    assert call.completed


class ListSource:
    """A source over a fixed key -> snapshot dict (used to serve tampered chains)."""

    def __init__(self, snapshots: dict[str, StagedCallSnapshot], error: Exception | None = None) -> None:
        self.snapshots = snapshots
        self.error = error
        self.fetched: list[list[str]] = []

    def fetch(self, staging_keys: Sequence[str]) -> list[StagedCallSnapshot]:
        self.fetched.append(list(staging_keys))
        if self.error is not None:
            raise self.error
        return [self.snapshots[key] for key in staging_keys]


class PackedListSource(ListSource):
    """The same, also serving :class:`PackedSnapshot` through ``fetch_packed`` (which the capture prefers)."""

    def fetch_packed(self, staging_keys: Sequence[str]) -> list[PackedSnapshot]:
        return [PackedSnapshot.of(snapshot) for snapshot in self.fetch(staging_keys)]


def _tampered_sources(store: MemoryStagingStore, packed: bool = False) -> dict[str, Any]:
    source = PackedListSource if packed else ListSource
    good = {key: store.fetch([key])[0] for key in ("rollout-1/c1", "rollout-1/c2")}
    root = good["rollout-1/c1"]
    # A valid record whose cumulative hash is not the hash of its ids.
    wrong_cumulative = StagedCallSnapshot.from_components(
        **{**_components(good["rollout-1/c2"]), "cumulative_hash": "2" * 64}
    )
    # A valid record whose chain hash does not link to the root.
    wrong_chain = StagedCallSnapshot.from_components(**{**_components(good["rollout-1/c2"]), "chain_hash": "1" * 64})
    return {
        "missing-key": source({"rollout-1/c1": root}),
        "source-error": source(good, error=RuntimeError("source down")),
        "swapped-order": source({"rollout-1/c1": good["rollout-1/c2"], "rollout-1/c2": root}),
        "wrong-chain": source({"rollout-1/c1": root, "rollout-1/c2": wrong_chain}),
        "wrong-cumulative": source({"rollout-1/c1": root, "rollout-1/c2": wrong_cumulative}),
    }


def _components(snapshot: StagedCallSnapshot) -> dict[str, Any]:
    data = snapshot.model_dump()
    for name in ("schema_version", "digest_version", "extras_digest_version", "digest"):
        data.pop(name)
    return data


@pytest.mark.parametrize("packed", [False, True], ids=["snapshots", "packed"])
@pytest.mark.parametrize("case", ["missing-key", "source-error", "swapped-order", "wrong-chain", "wrong-cumulative"])
def test_unresolvable_chains_fail_the_capture_not_the_call(
    case: str, packed: bool, caplog: pytest.LogCaptureFixture
) -> None:
    store = MemoryStagingStore()
    _, child, _ = run_three_calls(make_capture(store))
    source = _tampered_sources(store, packed)[case]
    sink = RecordingSink()
    capture = make_capture(sink, source=source)
    admission = child_admission(child, [], "c9", ["rollout-1/c1", "rollout-1/c2"])
    with caplog.at_level(logging.WARNING, logger="worker"):
        call = capture.begin_call(admission)
    assert call.capture_failed and call.prefix_token_ids == [] and call.capture_failure is not None
    assert "capture disabled" in caplog.text
    coords = capture.complete_call(
        call, prompt_token_ids=GRAND_PROMPT, generated_token_ids=GRAND_GEN, generated_logprobs=GRAND_LPS
    )
    assert coords.model_dump() == expected_failed(admission, 7)
    assert sink.records == []
    if case != "source-error":
        with pytest.raises(PrefixResolutionError):
            resolve_prefix(admission, source)


@pytest.mark.parametrize("change", ["prev_len", "parent_chain_hash", "chain-too-short"])
def test_admission_that_disagrees_with_the_chain_fails_capture(change: str) -> None:
    store = MemoryStagingStore()
    _, child, _ = run_three_calls(make_capture(store))
    admission = child_admission(child, [], "c9", ["rollout-1/c1", "rollout-1/c2"])
    updates: dict[str, dict[str, Any]] = {
        "prev_len": {"prev_len": 6},
        "parent_chain_hash": {"parent_chain_hash": ROOT_CHAIN},
        "chain-too-short": {"staging_chain": ["rollout-1/c2"]},
    }
    admission = admission.model_copy(update=updates[change])
    sink = RecordingSink()
    capture = make_capture(sink, source=store)
    call = capture.begin_call(admission)
    assert call.capture_failed
    assert capture.complete_call(
        call, prompt_token_ids=GRAND_PROMPT, generated_token_ids=GRAND_GEN, generated_logprobs=GRAND_LPS
    ).model_dump() == expected_failed(admission, 7)
    assert sink.records == []
    with pytest.raises(PrefixResolutionError):
        resolve_prefix(admission, store)


def test_fail_call_and_fail_admission_shapes() -> None:
    capture = make_capture(version=11)
    call = capture.begin_call(root_admission(), weight_version=4)
    assert capture.fail_call(call, reason="engine error").model_dump() == expected_failed(root_admission(), 4)
    assert capture.fail_admission(root_admission("c5"), reason="no begin").model_dump() == expected_failed(
        root_admission("c5"), 11
    )


# --- completion discipline -----------------------------------------------------------


def test_double_completion_raises_for_every_pair() -> None:
    capture = make_capture()
    kwargs = dict(ROOT_KWARGS)
    for index, first in enumerate(("complete", "fail", "failed-build")):
        call = capture.begin_call(root_admission(f"d{index}"))
        if first == "complete":
            assert capture.complete_call(call, **kwargs).disposition == "staged"
        elif first == "fail":
            capture.fail_call(call, reason="x")
        else:
            capture.complete_call(call, prompt_token_ids=[], generated_token_ids=[], generated_logprobs=[])
        with pytest.raises(CaptureError, match="already completed"):
            capture.complete_call(call, **kwargs)
        with pytest.raises(CaptureError, match="already completed"):
            capture.fail_call(call, reason="again")
    with pytest.raises(CaptureError, match="adapter"):
        capture.complete_call_from_response(capture.begin_call(root_admission("d9")), {})
    with pytest.raises(TypeError):
        capture.complete_call(object(), **kwargs)  # type: ignore[arg-type]


def test_concurrent_fail_calls_claim_exactly_once() -> None:
    capture = make_capture()
    call = capture.begin_call(root_admission())
    barrier = threading.Barrier(8)
    outcomes: list[str] = []

    def worker() -> None:
        barrier.wait(timeout=10)
        try:
            capture.fail_call(call, reason="race")
            outcomes.append("coords")
        except CaptureError:
            outcomes.append("error")

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=10)
    assert sorted(outcomes) == ["coords"] + ["error"] * 7


class BlockingSink:
    """Blocks the stage of call ``slow`` until released; other calls stage at once."""

    def __init__(self) -> None:
        self.store = MemoryStagingStore()
        self.entered = threading.Event()
        self.release = threading.Event()

    def stage(self, record: StagedCallRecord) -> StageResult:
        if record.model_call_id == "slow":
            self.entered.set()
            assert self.release.wait(timeout=10)
        return self.store.stage(record)


def test_a_slow_stage_does_not_block_another_call() -> None:
    sink = BlockingSink()
    capture = make_capture(sink)
    kwargs = dict(ROOT_KWARGS)
    slow_call = capture.begin_call(root_admission("slow"))
    fast_call = capture.begin_call(root_admission("fast"))
    results: dict[str, CommitCoords] = {}
    thread = threading.Thread(target=lambda: results.setdefault("slow", capture.complete_call(slow_call, **kwargs)))
    thread.start()
    assert sink.entered.wait(timeout=10)
    fast = capture.complete_call(fast_call, **kwargs)
    assert fast.disposition == "staged" and fast.staging_key == "rollout-1/fast"
    assert "slow" not in results and thread.is_alive()
    sink.release.set()
    thread.join(timeout=10)
    assert results["slow"].disposition == "staged"


# --- async twins -----------------------------------------------------------------------


class AsyncStore:
    """Async sink/source over the in-memory store, with an optional gate on call ``slow``."""

    def __init__(self) -> None:
        self.store = MemoryStagingStore()
        self.entered = anyio.Event()
        self.release = anyio.Event()
        self.fail_with: Exception | None = None

    async def stage(self, record: StagedCallRecord) -> StageResult:
        if self.fail_with is not None:
            raise self.fail_with
        if record.model_call_id == "slow":
            self.entered.set()
            await self.release.wait()
        return self.store.stage(record)

    async def fetch(self, staging_keys: Sequence[str]) -> list[StagedCallSnapshot]:
        return self.store.fetch(staging_keys)


async def _arun_three_calls(capture: RolloutTokenCapture) -> list[CommitCoords]:
    root = await capture.acomplete_call(
        await capture.abegin_call(root_admission()),
        prompt_token_ids=ROOT_PROMPT,
        generated_token_ids=ROOT_GEN,
        generated_logprobs=ROOT_LPS,
    )
    child_adm = child_admission(root, [], "c2", ["rollout-1/c1"])
    child = await capture.acomplete_call(
        await capture.abegin_call(child_adm),
        prompt_token_ids=CHILD_PROMPT,
        generated_token_ids=CHILD_GEN,
        generated_logprobs=CHILD_LPS,
    )
    grand_adm = child_admission(child, [], "c3", ["rollout-1/c1", "rollout-1/c2"])
    grand = await capture.acomplete_call(
        await capture.abegin_call(grand_adm),
        prompt_token_ids=GRAND_PROMPT,
        generated_token_ids=GRAND_GEN,
        generated_logprobs=GRAND_LPS,
    )
    return [root, child, grand]


@pytest.mark.anyio
async def test_async_twins_match_the_sync_path() -> None:
    sync = run_three_calls(make_capture())
    async_store = AsyncStore()
    via_async = await _arun_three_calls(make_capture(async_store, source=async_store))
    memory = MemoryStagingStore()  # sync sink and source, offloaded to worker threads
    via_threads = await _arun_three_calls(make_capture(memory, source=memory))
    dumps = [c.model_dump_json() for c in sync]
    assert [c.model_dump_json() for c in via_async] == dumps == [c.model_dump_json() for c in via_threads]
    admission = child_admission(via_async[1], [], "c9", ["rollout-1/c1", "rollout-1/c2"])
    assert await aresolve_prefix(admission, async_store) == CHILD_PROMPT + CHILD_GEN


@pytest.mark.anyio
async def test_async_failures_and_double_completion() -> None:
    store = AsyncStore()
    capture = make_capture(store, source=store)
    kwargs = dict(ROOT_KWARGS)
    store.fail_with = ConnectionError("gone")
    call = await capture.abegin_call(root_admission())
    assert (await capture.acomplete_call(call, **kwargs)).model_dump() == expected_failed(root_admission(), 7)
    with pytest.raises(CaptureError, match="already completed"):
        await capture.acomplete_call(call, **kwargs)
    failed = await capture.abegin_call(root_admission("c2"))
    assert (await capture.afail_call(failed, reason="x")).disposition == "capture_failed"
    with pytest.raises(CaptureError):
        await capture.afail_call(failed, reason="x")
    missing = CaptureAdmission(
        rollout_id="rollout-1",
        model_call_id="c3",
        parent_call_id="nope",
        prev_len=3,
        mode="token_in",
        staging_chain=["rollout-1/nope"],
        parent_chain_hash=ROOT_CHAIN,
    )
    assert (await capture.abegin_call(missing)).capture_failed
    with pytest.raises(PrefixResolutionError):
        await aresolve_prefix(missing, store)
    # The sync methods refuse an async sink or source instead of dropping a coroutine.
    with pytest.raises(CaptureError, match="acomplete_call"):
        capture.complete_call(capture.begin_call(root_admission("c4")), **kwargs)
    with pytest.raises(CaptureError, match="abegin_call"):
        capture.begin_call(missing)


@pytest.mark.anyio
async def test_async_slow_stage_does_not_block_another_call() -> None:
    store = AsyncStore()
    capture = make_capture(store)
    kwargs = dict(ROOT_KWARGS)
    slow_call = await capture.abegin_call(root_admission("slow"))
    results: dict[str, CommitCoords] = {}

    async def complete_slow() -> None:
        results["slow"] = await capture.acomplete_call(slow_call, **kwargs)

    async with anyio.create_task_group() as group:
        group.start_soon(complete_slow)
        with anyio.fail_after(10):
            await store.entered.wait()
        fast = await capture.acomplete_call(await capture.abegin_call(root_admission("fast")), **kwargs)
        assert fast.disposition == "staged" and "slow" not in results
        store.release.set()
    assert results["slow"].disposition == "staged"


def test_active_call_repr_hides_the_lock() -> None:
    call = make_capture().begin_call(root_admission())
    assert isinstance(call, ActiveCall) and "_lock" not in repr(call) and "c1" in repr(call)
