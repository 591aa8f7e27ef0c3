"""Ledger test data: one rollout's root and child commits with distinct, deterministic digests."""

from __future__ import annotations

import hashlib
from typing import Any

from sink.contract.fingerprint import FINGERPRINT_VERSION
from sink.contract.records import EMPTY_EXTRAS_DIGEST, CallRecord, CaptureLedgerCommit

__all__ = (
    "ANSWER1",
    "ANSWER2",
    "CHILD_REQUEST",
    "ROOT_REQUEST",
    "SYSTEM",
    "USER1",
    "USER2",
    "R",
    "as_manifest_row",
    "child_commit",
    "hexdigest",
    "make_record",
    "root_commit",
)

R = "r-1"
SYSTEM = {"role": "system", "content": "be brief"}
USER1 = {"role": "user", "content": "hi"}
ANSWER1 = {"role": "assistant", "content": "hello"}
USER2 = {"role": "user", "content": "more please"}
ANSWER2 = {"role": "assistant", "content": "sure"}
ROOT_REQUEST = [SYSTEM, USER1]
CHILD_REQUEST = [SYSTEM, USER1, ANSWER1, USER2]


def hexdigest(label: str) -> str:
    return hashlib.sha256(label.encode()).hexdigest()


def make_record(call_id: str, *, parent: str | None = None, prev_len: int = 0, **overrides: Any) -> CallRecord:
    fields: dict[str, Any] = {
        "model_call_id": call_id,
        "parent_call_id": parent,
        "prev_len": prev_len,
        "delta_len": 4,
        "cum_len": prev_len + 4,
        "weight_version": 1,
        "digest": hexdigest(f"digest:{call_id}"),
        "extras_digest": EMPTY_EXTRAS_DIGEST,
        "staging_key": f"{R}/{call_id}",
        "mode": "text" if parent is None else "token_in",
        "chain_hash": hexdigest(f"chain:{call_id}"),
        "cumulative_hash": hexdigest(f"cum:{call_id}"),
        "response_id": f"resp-{call_id}",
        "admitted_at": 1700000000.25,
        "fingerprint_version": FINGERPRINT_VERSION,
    }
    fields.update(overrides)
    return CallRecord.model_validate(fields)


def root_commit(call_id: str = "c-root", *, rollout_id: str = R, **overrides: Any) -> CaptureLedgerCommit:
    record = make_record(call_id, **{"staging_key": f"{rollout_id}/{call_id}", **overrides})
    return CaptureLedgerCommit(
        rollout_id=rollout_id,
        record=record,
        staging_chain=(record.staging_key,),
        request_items=list(ROOT_REQUEST),
        response_items=[ANSWER1],
    )


def child_commit(call_id: str = "c-child", *, parent: str = "c-root", **overrides: Any) -> CaptureLedgerCommit:
    record = make_record(call_id, parent=parent, prev_len=4, **overrides)
    return CaptureLedgerCommit(
        rollout_id=R,
        record=record,
        staging_chain=(f"{R}/{parent}", record.staging_key),
        request_items=list(CHILD_REQUEST),
        response_items=[ANSWER2],
    )


def as_manifest_row(commit: CaptureLedgerCommit) -> CallRecord:
    return commit.record.model_copy(update={"capture_key": commit.record.capture_key or commit.rollout_id})
