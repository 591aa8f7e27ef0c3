"""Verified pulled rollouts built in memory (no server): chains verified by ``verify_and_linearize``."""

from __future__ import annotations

from collections.abc import Sequence

from sink.contract.records import RolloutReceipt, StagedCallRecord
from sink.rollout.done_event import GroupTag
from sink.trainer.pulled import PulledRollout
from sink.trainer.verify import verify_and_linearize
from tests.helpers.e2e import call_record_of
from tests.helpers.staging import make_record

__all__ = ("skipped_pulled", "verified_pulled")


def _chain(rollout_id: str, lengths: Sequence[int], weight_versions: Sequence[int]) -> list[StagedCallRecord]:
    chain: list[StagedCallRecord] = []
    sequence: list[int] = []
    for index, (length, version) in enumerate(zip(lengths, weight_versions, strict=True)):
        record = make_record(
            rollout_id,
            f"c{index}",
            n_tokens=length,
            carry=min(2 if index else 3, length - 1),
            parent=chain[-1] if chain else None,
            parent_prefix=list(sequence),
            weight_version=version,
        )
        sequence += record.token_ids_delta
        chain.append(record)
    return chain


def verified_pulled(
    rollout_id: str,
    *,
    lengths: Sequence[int] = (8, 8),
    weight_versions: Sequence[int] | None = None,
    reward: float | None = 1.0,
    group: GroupTag | None = None,
) -> PulledRollout:
    """A trainable pulled rollout: a linear chain of calls with *lengths* tokens each (every length >= 2)."""
    versions = list(weight_versions) if weight_versions is not None else [0] * len(lengths)
    chain = _chain(rollout_id, lengths, versions)
    receipt = RolloutReceipt(
        rollout_id=rollout_id,
        reward=reward,
        terminal_model_call_id=chain[-1].model_call_id,
        manifest=[call_record_of(record, admitted_at=1000.0 + i) for i, record in enumerate(chain)],
        terminal_selection="declared",
    )
    return PulledRollout(receipt=receipt, row=verify_and_linearize(receipt, chain), group=group)


def skipped_pulled(rollout_id: str, code: str = "rollout_failed") -> PulledRollout:
    """A skipped pulled rollout (a failed rollout's receipt)."""
    receipt = RolloutReceipt(rollout_id=rollout_id, capture_poisoned=True, failure_reason="boom")
    return PulledRollout(receipt=receipt, skip_code=code, skip_reason="boom")
