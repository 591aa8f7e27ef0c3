"""RolloutTokenCapture (contract §5): staged coordinates, begin_call checks, completion discipline, async twins.

Uses the in-memory store as sink and source; the contract's §4.8 check values
pin the staged coordinates byte for byte. The failure paths (§5.8) are in
``test_worker_capture_failures``.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import anyio
import pytest

from sink.contract.digest import compute_chain_hash, compute_extras_digest, hash_token_ids
from sink.contract.packed import PackedSnapshot
from sink.contract.packed_record import StageableRecord
from sink.contract.records import CaptureAdmission, CommitCoords, StagedCallSnapshot, StageResult
from sink.errors import StagingConnectionError, StagingError
from sink.store.memory import MemoryStagingStore
from tests.helpers.capture import (
    CHILD_CHAIN,
    CHILD_CUMULATIVE,
    CHILD_DIGEST,
    CHILD_GEN,
    CHILD_LPS,
    CHILD_PROMPT,
    EMPTY_EXTRAS,
    GRAND_GEN,
    GRAND_LPS,
    GRAND_PROMPT,
    ROOT_CHAIN,
    ROOT_CUMULATIVE,
    ROOT_DIGEST,
    ROOT_GEN,
    ROOT_KWARGS,
    ROOT_LPS,
    ROOT_PROMPT,
    child_admission,
    expected_failed,
    make_capture,
    root_admission,
    run_three_calls,
)
from worker import (
    ActiveCall,
    CaptureError,
    PrefixResolutionError,
    RolloutTokenCapture,
    StreamingUnsupportedError,
    aresolve_prefix,
    resolve_prefix,
)

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
        RolloutTokenCapture(sink=object(), weight_version_fn=lambda: 1)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        RolloutTokenCapture(sink=MemoryStagingStore(), weight_version_fn=7)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        RolloutTokenCapture(sink=MemoryStagingStore(), weight_version_fn=lambda: 1, source=object())  # type: ignore[arg-type]


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

    def stage(self, record: StageableRecord) -> StageResult:
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

    async def stage(self, record: StageableRecord) -> StageResult:
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
    store.fail_with = StagingConnectionError("gone")
    call = await capture.abegin_call(root_admission())
    assert (await capture.acomplete_call(call, **kwargs)).model_dump() == expected_failed(root_admission(), 7)
    with pytest.raises(CaptureError, match="already completed"):
        await capture.acomplete_call(call, **kwargs)
    failed = await capture.abegin_call(root_admission("c2"))
    assert (capture.fail_call(failed, reason="x")).disposition == "capture_failed"
    with pytest.raises(CaptureError):
        capture.fail_call(failed, reason="x")
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
