"""RolloutTokenCapture failure paths: every operational failure returns the exact §5.8 failed coordinates.

A sink that rejects, raises or answers oddly; a record that cannot be built; a ``staging_chain`` that
cannot be fetched or does not verify; the host failing a call or an admission.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import pytest

from sink.contract.packed import PackedSnapshot
from sink.contract.records import StagedCallSnapshot, StageResult
from sink.errors import StagingConnectionError
from sink.store.memory import MemoryStagingStore
from tests.helpers.capture import (
    GRAND_GEN,
    GRAND_LPS,
    GRAND_PROMPT,
    ROOT_CHAIN,
    ROOT_GEN,
    ROOT_LPS,
    ROOT_PROMPT,
    RecordingSink,
    child_admission,
    expected_failed,
    make_capture,
    root_admission,
    run_three_calls,
)
from worker import CaptureError, PrefixResolutionError, resolve_prefix

# --- failure paths: exact §5.8 shape ---------------------------------------------


@pytest.mark.parametrize(
    ("make_sink", "logged"),
    [  # factories: a sink records what it is given, so every run of the test needs a fresh one
        (lambda: RecordingSink(StageResult(ok=False, error="disk full")), "disk full"),
        (lambda: RecordingSink(error=StagingConnectionError("connection reset")), "connection reset"),
        (lambda: RecordingSink({"ok": True, "staging_key": "k"}), "not a StageResult"),
        (lambda: RecordingSink(StageResult.model_construct(ok=True, staging_key=None)), "rejected"),
    ],
    ids=["rejected", "raising", "dict-result", "keyless-ok"],
)
def test_sink_failures_give_failed_coords(
    make_sink: Callable[[], RecordingSink], logged: str, caplog: pytest.LogCaptureFixture
) -> None:
    sink = make_sink()
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


@pytest.mark.anyio
async def test_a_bug_in_the_sink_or_source_propagates() -> None:
    """Only the store's typed errors become failed coordinates: any other exception is a bug, raised to the host's
    boundary (the call is claimed, so the host can only record it failed, never stage it twice)."""
    sink = RecordingSink(error=RuntimeError("a bug in stage"))
    capture = make_capture(sink)
    call = capture.begin_call(root_admission())
    with pytest.raises(RuntimeError, match="a bug in stage"):
        capture.complete_call(
            call, prompt_token_ids=ROOT_PROMPT, generated_token_ids=ROOT_GEN, generated_logprobs=ROOT_LPS
        )
    assert call.completed
    call = await capture.abegin_call(root_admission("c2"))
    with pytest.raises(RuntimeError, match="a bug in stage"):
        await capture.acomplete_call(
            call, prompt_token_ids=ROOT_PROMPT, generated_token_ids=ROOT_GEN, generated_logprobs=ROOT_LPS
        )
    store = MemoryStagingStore()
    _, child, _ = run_three_calls(make_capture(store))
    buggy = ListSource({}, error=AttributeError("a bug in fetch"))
    admission = child_admission(child, [], "c9", ["rollout-1/c1", "rollout-1/c2"])
    with pytest.raises(AttributeError, match="a bug in fetch"):
        make_capture(RecordingSink(), source=buggy).begin_call(admission)
    with pytest.raises(AttributeError, match="a bug in fetch"):
        await make_capture(RecordingSink(), source=buggy).abegin_call(admission)


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
        "source-error": source(good, error=StagingConnectionError("source down")),
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
