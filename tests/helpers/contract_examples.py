"""Valid wire shapes of every contract record, shared by the tests.

The staged calls are the §8.3 worked example (rollout ``r1``: ``root`` and its
child ``main``). Each builder returns a fresh JSON-ready dict; keyword
overrides replace fields. Staged-call builders recompute ``digest`` after the
overrides (unless ``digest`` itself is overridden) so a test can break exactly
one rule; when the overridden fields fail a digest pre-check, a placeholder
digest is used instead.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from sink.contract import records
from sink.contract.digest import EMPTY_EXTRAS_DIGEST, compute_staging_digest
from sink.contract.fingerprint import FINGERPRINT_VERSION

__all__ = (
    "GOLDEN_VECTOR",
    "ROOT_CHAIN_HASH",
    "ROOT_CUMULATIVE_HASH",
    "ROOT_DIGEST",
    "call_record_wire",
    "commit_coords_wire",
    "main_staged_wire",
    "manifest_row",
    "receipt_wire",
    "root_staged_wire",
    "valid_wire_by_model",
)

GOLDEN_VECTOR: dict[str, Any] = json.loads((Path(__file__).parents[1] / "golden_vector_v2.json").read_text())

ROOT_CHAIN_HASH = "14c5e45c969e9b8b821f302201ad9d9b6b4f7427ac18dab2cb150af8e3acdd65"
ROOT_CUMULATIVE_HASH = "21c8e66807865ae05ca6f5bca40bd4a1399a66c23fb9848216a23c2ab9d9858f"
ROOT_DIGEST = "654f4806694c45a7637bb96cbfe0beb51f82d481f20202f7f7997aca27f0f7bb"
MAIN_CHAIN_HASH = "2d5351859ece5a943589e66aeb89296664dae4b8484f106e6ff9060d7635e62a"
MAIN_CUMULATIVE_HASH = "d44975e73aacb27985764338375207755e90423680439a3b6e4046c7d9dded07"
PLACEHOLDER_DIGEST = "0" * 64
_VERSIONS = {"schema_version": 2, "digest_version": 2, "extras_digest_version": 1}


def _with_digest(wire: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    wire.update(overrides)
    if "digest" not in overrides:
        fields = {k: v for k, v in wire.items() if k not in ("digest", "extras")}
        try:
            wire["digest"] = compute_staging_digest(**fields)
        except (TypeError, ValueError):
            wire["digest"] = PLACEHOLDER_DIGEST
    return wire


def root_staged_wire(**overrides: Any) -> dict[str, Any]:
    """Wire dict of the §8.3 ``root`` call (no ``extras`` key)."""
    wire: dict[str, Any] = {
        **_VERSIONS,
        "rollout_id": "r1",
        "model_call_id": "root",
        "parent_call_id": None,
        "mode": "text",
        "prev_len": 0,
        "delta_len": 3,
        "cum_len": 3,
        "weight_version": 3,
        "digest": ROOT_DIGEST,
        "token_ids_delta": [10, 11, 12],
        "token_mask_delta": [0.0, 0.0, 1.0],
        "generation_log_probs_delta": [0.0, 0.0, -0.1],
        "extras_digest": EMPTY_EXTRAS_DIGEST,
        "chain_hash": ROOT_CHAIN_HASH,
        "cumulative_hash": ROOT_CUMULATIVE_HASH,
    }
    return _with_digest(wire, overrides)


def main_staged_wire(**overrides: Any) -> dict[str, Any]:
    """Wire dict of the §8.3 ``main`` call (child of ``root``, no ``extras`` key)."""
    wire = root_staged_wire(
        model_call_id="main",
        parent_call_id="root",
        mode="token_in",
        prev_len=3,
        delta_len=2,
        cum_len=5,
        weight_version=4,
        token_ids_delta=[20, 21],
        token_mask_delta=[0.0, 1.0],
        generation_log_probs_delta=[0.0, -0.2],
        chain_hash=MAIN_CHAIN_HASH,
        cumulative_hash=MAIN_CUMULATIVE_HASH,
    )
    return _with_digest(wire, overrides)


def call_record_wire(**overrides: Any) -> dict[str, Any]:
    """Manifest row (§3.8) of the §8.3 ``root`` call."""
    wire: dict[str, Any] = {
        **_VERSIONS,
        "model_call_id": "root",
        "parent_call_id": None,
        "prev_len": 0,
        "delta_len": 3,
        "cum_len": 3,
        "weight_version": 3,
        "digest": ROOT_DIGEST,
        "extras_digest": EMPTY_EXTRAS_DIGEST,
        "staging_key": "r1/root",
        "mode": "text",
        "chain_hash": ROOT_CHAIN_HASH,
        "cumulative_hash": ROOT_CUMULATIVE_HASH,
        "response_id": "resp-root",
    }
    wire.update(overrides)
    return wire


def commit_coords_wire(**overrides: Any) -> dict[str, Any]:
    """Staged coordinates (§3.7) of the §8.3 ``root`` call."""
    wire: dict[str, Any] = {
        **_VERSIONS,
        "rollout_id": "r1",
        "model_call_id": "root",
        "parent_call_id": None,
        "prev_len": 0,
        "delta_len": 3,
        "cum_len": 3,
        "weight_version": 3,
        "disposition": "staged",
        "digest": ROOT_DIGEST,
        "extras_digest": EMPTY_EXTRAS_DIGEST,
        "staging_key": "r1/root",
        "chain_hash": ROOT_CHAIN_HASH,
        "cumulative_hash": ROOT_CUMULATIVE_HASH,
    }
    wire.update(overrides)
    return wire


def receipt_wire(**overrides: Any) -> dict[str, Any]:
    """Trainable receipt (state 1 of §3.11) over the ``root`` manifest row."""
    wire: dict[str, Any] = {
        **_VERSIONS,
        "rollout_id": "r1",
        "reward": 1.0,
        "terminal_model_call_id": "root",
        "manifest": [call_record_wire()],
        "capture_poisoned": False,
        "failure_reason": None,
        "terminal_selection": "declared",
        "terminal_attribution_reason": None,
    }
    wire.update(overrides)
    return wire


def valid_wire_by_model() -> dict[type[BaseModel], dict[str, Any]]:
    """One valid wire dict for every record class of ``sink.contract.records``."""
    cut = {
        "source_capture_key": "r1",
        "source_model_call_id": "root",
        "staging_keys": ["r1/root"],
        "prefix_token_count": 1,
        "prefix_digest": ROOT_DIGEST,
        "effective_output_limit": 16,
    }
    return {
        records.GenerationCutContinuation: cut,
        records.CaptureAdmission: {"rollout_id": "r1", "model_call_id": "root", "mode": "text"},
        records.StagedCallBaseSnapshot: root_staged_wire(),
        records.StagedCallRecord: {**root_staged_wire(), "extras": None},
        records.StagedCallSnapshot: root_staged_wire(),
        records.StageResult: {"ok": True, "staging_key": "r1/root"},
        records.CommitCoords: commit_coords_wire(),
        records.CallRecord: call_record_wire(),
        records.CaptureLedgerCommit: {
            "rollout_id": "r1",
            "record": call_record_wire(),
            "staging_chain": ["r1/root"],
            "request_items": [{"role": "user", "content": "hi"}],
            "response_items": [{"type": "message", "content": "hello"}],
        },
        records.ManifestFailure: {"model_call_id": "c9", "reason": records.WORKER_CAPTURE_FAILED_REASON},
        records.RolloutManifest: {"rollout_id": "r1", "records": [call_record_wire()], "failures": []},
        records.RolloutRemoval: {"removed": ["r1"], "absent": []},
        records.RolloutReceipt: receipt_wire(),
    }


def _hex(seed: str) -> str:
    return hashlib.sha256(seed.encode()).hexdigest()


def manifest_row(
    call_id: str,
    parent: str | None = None,
    *,
    rollout: str = "r",
    capture_key: str | None = None,
    admitted_at: float | None = None,
    response_id: str | None = None,
    same_as: str | None = None,
    output_fp: str | None = None,
    continuation_fp: str | None = None,
    fingerprint_version: int = FINGERPRINT_VERSION,
) -> records.CallRecord:
    """A valid manifest row with made-up digests; rows built with the same ``same_as`` are identical retries."""
    identity = same_as or call_id
    prev_len = 0 if parent is None else 10
    return records.CallRecord(
        model_call_id=call_id,
        parent_call_id=parent,
        prev_len=prev_len,
        delta_len=5,
        cum_len=prev_len + 5,
        weight_version=0,
        digest=_hex("digest" + call_id),
        extras_digest=EMPTY_EXTRAS_DIGEST,
        staging_key=f"{rollout}/{call_id}",
        mode="text" if parent is None else "token_in",
        chain_hash=_hex("chain" + identity),
        cumulative_hash=_hex("cumulative" + identity),
        response_id=response_id or f"resp-{call_id}",
        capture_key=capture_key,
        admitted_at=admitted_at,
        output_fingerprint=output_fp,
        continuation_fingerprint=continuation_fp,
        fingerprint_version=fingerprint_version,
    )
