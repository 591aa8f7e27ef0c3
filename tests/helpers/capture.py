"""Shared pieces of the RolloutTokenCapture tests: the contract's §4.8 check values, a recording sink, admissions.

The three calls of :func:`run_three_calls` are the contract's root ``c1`` and child ``c2`` of ``rollout-1``
(weight 7) and a grandchild ``c3``.
"""

from __future__ import annotations

from typing import Any

from sink.contract.packed_record import StageableRecord
from sink.contract.records import CaptureAdmission, CommitCoords
from sink.store.memory import MemoryStagingStore
from worker import RolloutTokenCapture

__all__ = (
    "CHILD_CHAIN",
    "CHILD_CUMULATIVE",
    "CHILD_DIGEST",
    "CHILD_GEN",
    "CHILD_LPS",
    "CHILD_PROMPT",
    "EMPTY_EXTRAS",
    "GRAND_GEN",
    "GRAND_LPS",
    "GRAND_PROMPT",
    "ROOT_CHAIN",
    "ROOT_CUMULATIVE",
    "ROOT_DIGEST",
    "ROOT_GEN",
    "ROOT_KWARGS",
    "ROOT_LPS",
    "ROOT_PROMPT",
    "RecordingSink",
    "child_admission",
    "expected_failed",
    "make_capture",
    "root_admission",
    "run_three_calls",
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
        self.records: list[StageableRecord] = []

    def stage(self, record: StageableRecord) -> Any:
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
