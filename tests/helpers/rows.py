"""Verified pulled rollouts built in memory (no server): chains verified by ``verify_and_linearize``, single- or
multi-chain."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from sink.contract.chains import ChainPolicy
from sink.contract.records import RolloutManifest, RolloutReceipt, StagedCallRecord
from sink.ledger.rows import ChainLedgerView
from sink.rollout.chains import build_chains
from sink.rollout.done_event import GroupTag
from sink.rollout.receipt import build_receipt
from sink.trainer.pulled import PulledRollout, chain_receipt
from sink.trainer.verify import verify_and_linearize
from tests.helpers.e2e import call_record_of
from tests.helpers.staging import make_record

__all__ = ("multi_chain_pulled", "skipped_pulled", "verified_pulled")


def _chain(
    rollout_id: str,
    lengths: Sequence[int],
    weight_versions: Sequence[int],
    prefix: str = "c",
    extras: Sequence[dict[str, Any] | None] | None = None,
    carries: Sequence[int] | None = None,
) -> list[StagedCallRecord]:
    chain: list[StagedCallRecord] = []
    sequence: list[int] = []
    for index, (length, version) in enumerate(zip(lengths, weight_versions, strict=True)):
        record = make_record(
            rollout_id,
            f"{prefix}{index}",
            n_tokens=length,
            carry=min(2 if index else 3, length - 1) if carries is None else carries[index],
            parent=chain[-1] if chain else None,
            parent_prefix=list(sequence),
            weight_version=version,
            extras=None if extras is None else extras[index],
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
    extras: Sequence[dict[str, Any] | None] | None = None,
    carries: Sequence[int] | None = None,
) -> PulledRollout:
    """A trainable pulled rollout: a linear chain of calls with *lengths* tokens each (every length >= 2), with
    *extras* and *carries* (prompt tokens, each below its length) per call when given."""
    versions = list(weight_versions) if weight_versions is not None else [0] * len(lengths)
    chain = _chain(rollout_id, lengths, versions, extras=extras, carries=carries)
    receipt = RolloutReceipt(
        rollout_id=rollout_id,
        reward=reward,
        terminal_model_call_id=chain[-1].model_call_id,
        manifest=[call_record_of(record, admitted_at=1000.0 + i) for i, record in enumerate(chain)],
        terminal_selection="declared",
    )
    return PulledRollout(receipt=receipt, row=verify_and_linearize(receipt, chain), group=group)


def multi_chain_pulled(rollout_id: str, trees: Sequence[Sequence[int]] = ((8, 6), (8, 6, 5))) -> PulledRollout:
    """A trainable multi-chain rollout (contract §14, policy ``roots``): one linear chain of calls per entry of
    *trees* (its calls' lengths; call ids ``a0, a1, ...``, ``b0, ...``), the last chain's terminal declared. The
    receipt and chain record are built as the assembler builds them, each chain verified as the reader does."""
    records = [
        record
        for prefix, lengths in zip("abcdefgh", trees, strict=False)
        for record in _chain(rollout_id, lengths, [0] * len(lengths), prefix=prefix)
    ]
    manifest = RolloutManifest(
        rollout_id=rollout_id,
        records=[call_record_of(record, admitted_at=1000.0 + i) for i, record in enumerate(records)],
    )
    declared = manifest.records[-1].response_id
    receipt = build_receipt(manifest, rollout_id=rollout_id, reward=1.0, declared_response_id=declared)
    chains = build_chains(receipt, manifest, ChainLedgerView(ChainPolicy.ROOTS))
    assert chains is not None and len(chains.chains) == len(trees)
    by_id = {record.model_call_id: record for record in records}
    rows = tuple(
        replace(
            verify_and_linearize(chain_receipt(receipt, chain), [by_id[call] for call in chain.tree_call_ids]),
            chain_index=chain.index,
        )
        for chain in chains.chains
    )
    return PulledRollout(receipt=receipt, chains=chains, chain_rows=rows)


def skipped_pulled(rollout_id: str, code: str = "rollout_failed") -> PulledRollout:
    """A skipped pulled rollout (a failed rollout's receipt)."""
    receipt = RolloutReceipt(rollout_id=rollout_id, capture_poisoned=True, failure_reason="boom")
    return PulledRollout(receipt=receipt, skip_code=code, skip_reason="boom")
