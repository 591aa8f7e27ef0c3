"""The gate's admission and commit (contract §6.6) over the capture ledger and a real capture."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from sink.contract.records import (
    INVALID_COMMIT_COORDS_REASON,
    UNRESOLVED_PARENT_REASON,
    WORKER_CAPTURE_FAILED_REASON,
    WORKER_MISSING_COMMIT_COORDS_REASON,
    CallRecord,
    CaptureAdmission,
    CommitCoords,
)
from sink.ledger.gate import CaptureGate
from sink.ledger.memory import MemoryCaptureLedger
from sink.ledger.redis import RedisCaptureLedger
from sink.server import DurableServer
from sink.store.memory import MemoryStagingStore
from worker import RolloutTokenCapture

pytestmark = pytest.mark.anyio

SYSTEM = {"role": "system", "content": "be brief"}
USER = {"role": "user", "content": "add 2 and 3"}


def _assistant(text: str) -> dict[str, Any]:
    return {"role": "assistant", "content": text}


@pytest.fixture(scope="module")
def gate_server() -> Iterator[DurableServer]:
    with DurableServer() as server:
        yield server


@pytest.fixture(params=["memory", "redis"])
async def ledger(request: pytest.FixtureRequest) -> Any:
    if request.param == "memory":
        yield MemoryCaptureLedger()
        return
    server = request.getfixturevalue("gate_server")
    with server.client() as client:
        client.flushall()
    async with RedisCaptureLedger.from_url(server.url) as redis_ledger:
        yield redis_ledger


async def _serve(
    gate: CaptureGate, capture: RolloutTokenCapture, rollout: str, items: list[dict[str, Any]], text: str
) -> tuple[CaptureAdmission, CommitCoords, CallRecord | None]:
    """One captured model call: admit, begin, 'generate', stage, commit."""
    admission = await gate.admit(rollout, items)
    assert admission is not None
    call = await capture.abegin_call(admission, prefix_token_ids=None if admission.mode == "text" else _prefix)
    prompt = (_prefix if admission.mode == "token_in" else []) + [1, 2, 3]
    generated = [ord(ch) for ch in text]
    coords = await capture.acomplete_call(
        call, prompt_token_ids=prompt, generated_token_ids=generated, generated_logprobs=[-0.5] * len(generated)
    )
    row = await gate.commit(
        admission,
        coords,
        response_id=f"resp-{admission.model_call_id}",
        request_items=items,
        response_items=[_assistant(text)],
        admitted_at=1.0,
    )
    _prefix[:] = prompt + generated
    return admission, coords, row


_prefix: list[int] = []


async def test_root_then_child_resolves_by_reference(ledger: Any) -> None:
    _prefix.clear()
    store = MemoryStagingStore()
    gate = CaptureGate(ledger)
    capture = RolloutTokenCapture(sink=store, weight_version_fn=lambda: 3, source=store)
    root_admission, root_coords, root_row = await _serve(gate, capture, "g1", [SYSTEM, USER], "five")
    assert root_admission.mode == "text" and root_row is not None
    child_items = [SYSTEM, USER, _assistant("five"), {"role": "user", "content": "and times 2?"}]
    child_admission, _child_coords, child_row = await _serve(gate, capture, "g1", child_items, "ten")
    assert child_admission.mode == "token_in"
    assert child_admission.parent_call_id == root_admission.model_call_id
    assert child_admission.staging_chain == [root_coords.staging_key]
    assert child_admission.parent_chain_hash == root_coords.chain_hash
    assert child_admission.prev_len == root_coords.cum_len
    assert child_row is not None and child_row.parent_call_id == root_admission.model_call_id
    manifest = await ledger.manifest("g1")
    assert [r.model_call_id for r in manifest.records] == [root_admission.model_call_id, child_admission.model_call_id]
    assert manifest.failures == []
    assert child_row.continuation_fingerprint is not None and child_row.fingerprint_version == 3


async def test_unresolved_continuation_poisons_instead_of_becoming_a_root(ledger: Any) -> None:
    _prefix.clear()
    store = MemoryStagingStore()
    gate = CaptureGate(ledger)
    capture = RolloutTokenCapture(sink=store, weight_version_fn=lambda: 0)
    await _serve(gate, capture, "g2", [SYSTEM, USER], "five")
    foreign = [SYSTEM, USER, _assistant("something never served")]
    assert await gate.admit("g2", foreign) is None
    manifest = await ledger.manifest("g2")
    assert [f.reason for f in manifest.failures] == [UNRESOLVED_PARENT_REASON]
    # Seeded history on a fresh rollout is a new root, not a failure.
    fresh = await gate.admit("g3", foreign)
    assert fresh is not None and fresh.mode == "text"


async def test_commit_failures_are_recorded_with_their_reasons(ledger: Any) -> None:
    gate = CaptureGate(ledger)
    admission = await gate.admit("g4", [SYSTEM, USER])
    assert admission is not None
    failed = CommitCoords(
        rollout_id="g4",
        model_call_id=admission.model_call_id,
        prev_len=0,
        delta_len=0,
        cum_len=0,
        weight_version=0,
        disposition="capture_failed",
    )
    common: dict[str, Any] = {"response_id": "r", "request_items": [USER], "response_items": []}
    assert await gate.commit(admission, None, **common) is None
    assert await gate.commit(admission, failed, **common) is None
    assert await gate.commit(admission, {"rollout_id": "g4"}, **common) is None
    other = failed.model_copy(update={"model_call_id": "someone-else"})
    assert await gate.commit(admission, other, **common) is None
    manifest = await ledger.manifest("g4")
    assert [f.reason for f in manifest.failures] == [
        WORKER_MISSING_COMMIT_COORDS_REASON,
        WORKER_CAPTURE_FAILED_REASON,
        INVALID_COMMIT_COORDS_REASON,
    ]
    assert manifest.records == []


async def test_the_planned_commit_is_the_row_commit_records_and_writes_nothing(ledger: Any) -> None:
    """:meth:`CaptureGate.planned_commit` (the row a proxy sends behind its stage) is what :meth:`commit` records;
    coordinates that :meth:`commit` would record as a failure plan nothing; planning writes nothing."""
    gate = CaptureGate(ledger)
    capture = RolloutTokenCapture(sink=MemoryStagingStore(), weight_version_fn=lambda: 0)
    admission = await gate.admit("g9", [SYSTEM, USER])
    assert admission is not None
    call = await capture.abegin_call(admission)
    coords = await capture.acomplete_call(
        call, prompt_token_ids=[1, 2, 3], generated_token_ids=[7, 8], generated_logprobs=[-0.5, -0.25]
    )
    common: dict[str, Any] = {
        "response_id": "resp-g9",
        "request_items": [SYSTEM, USER],
        "response_items": [_assistant("ok")],
        "admitted_at": 1.0,
    }
    planned = gate.planned_commit(admission, coords, **common)
    assert planned is not None and planned.staging_chain == (coords.staging_key,)
    assert (await ledger.manifest("g9")).records == []
    assert await gate.commit(admission, coords, **common) == planned.record
    assert (await ledger.manifest("g9")).records[0].digest == planned.record.digest
    failed = coords.model_copy(update={"disposition": "capture_failed", "staging_key": None})
    assert gate.planned_commit(admission, failed, **common) is None
    elsewhere = coords.model_copy(update={"model_call_id": "someone-else"})
    assert gate.planned_commit(admission, elsewhere, **common) is None
    assert gate.planned_commit(admission, coords, **{**common, "response_id": ""}) is None
    assert (await ledger.manifest("g9")).failures == []


async def test_retired_rollouts_are_not_admitted(ledger: Any) -> None:
    await ledger.retire(["g5"])
    gate = CaptureGate(ledger)
    assert await gate.admit("g5", [SYSTEM, USER]) is None  # a root request too (§6.6 step 1)
    assert await gate.admit("g5", [SYSTEM, USER, _assistant("x")]) is None


async def test_unfingerprintable_items_poison_the_rollout_instead_of_failing_the_call(ledger: Any) -> None:
    _prefix.clear()
    store = MemoryStagingStore()
    gate = CaptureGate(ledger)
    capture = RolloutTokenCapture(sink=store, weight_version_fn=lambda: 0)
    admission = await gate.admit("g6", [SYSTEM, USER])
    assert admission is not None
    call = await capture.abegin_call(admission)
    coords = await capture.acomplete_call(
        call, prompt_token_ids=[1, 2], generated_token_ids=[3], generated_logprobs=[-0.5]
    )
    row = await gate.commit(
        admission,
        coords,
        response_id="resp-x",
        request_items=[SYSTEM, USER],
        response_items=[{"role": "assistant", "content": 5}],  # not a valid content shape
    )
    assert row is None
    manifest = await ledger.manifest("g6")
    assert manifest.records == []
    assert [f.reason for f in manifest.failures] == [INVALID_COMMIT_COORDS_REASON]
