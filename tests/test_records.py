"""Wire records (contract §2–§3): strict types, versions, rules 3.1–3.11, ``from_components``."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, ValidationError

from sink.contract import digest, record_schema
from sink.contract import records as R
from sink.contract.digest import (
    EMPTY_EXTRAS_DIGEST,
    compute_chain_hash,
    compute_extras_digest,
    compute_staging_digest,
    hash_token_ids,
)
from tests.helpers.contract_examples import (
    GOLDEN_VECTOR,
    ROOT_CHAIN_HASH,
    ROOT_DIGEST,
    call_record_wire,
    commit_coords_wire,
    main_staged_wire,
    receipt_wire,
    root_staged_wire,
    valid_wire_by_model,
)
from tests.helpers.param_ids import stable_repr

ALL_MODELS = list(valid_wire_by_model())
STAGED_MODELS = [R.StagedCallBaseSnapshot, R.StagedCallRecord, R.StagedCallSnapshot]
RECORD_MODELS = [R.StagedCallRecord, R.StagedCallSnapshot]
DIGEST_RULE = "digest does not match staged call contents"
EXTRAS_RULE = "extras_digest does not match extras"
OTHER_HEX = "f" * 64


def _name(model: type[BaseModel]) -> str:
    return model.__name__


def _wire(model: type[BaseModel], **overrides: Any) -> dict[str, Any]:
    return {**valid_wire_by_model()[model], **overrides}


def _dropped(wire: dict[str, Any], *keys: str) -> dict[str, Any]:
    return {k: v for k, v in wire.items() if k not in keys}


def _case_ids(cases: list[Any]) -> list[str]:
    ids = []
    for index, case in enumerate(cases):
        parts = [p.__name__ if isinstance(p, type) else p for p in case if isinstance(p, (type, str)) or p is None]
        ids.append(f"{index}-" + "-".join(str(p) for p in parts)[:80])
    return ids


def _wire_parsers(model: type[BaseModel]) -> list[Callable[[dict[str, Any]], BaseModel]]:
    """The three wire construction paths: ``model_validate``, JSON, keyword constructor."""

    def from_json(wire: dict[str, Any]) -> BaseModel:
        return model.model_validate_json(json.dumps(wire))

    def from_kwargs(wire: dict[str, Any]) -> BaseModel:
        return model(**wire)

    return [model.model_validate, from_json, from_kwargs]


def _field_errors(exc: pytest.ExceptionInfo[ValidationError]) -> set[str]:
    return {str(err["loc"][0]) for err in exc.value.errors() if err["loc"]}


# --- §2.1 base models, versions, extra="forbid" ------------------------------


@pytest.mark.parametrize("model", ALL_MODELS, ids=_name)
def test_valid_shape_round_trips_on_every_wire_path(model: type[BaseModel]) -> None:
    wire = valid_wire_by_model()[model]
    record = model.model_validate(wire)
    dumped = record.model_dump(mode="json")
    assert model.model_validate(dumped) == record
    assert model.model_validate_json(record.model_dump_json()) == record
    assert model(**wire) == record
    assert dumped["schema_version"] == 2
    if issubclass(model, R._DigestWireModel):
        assert (dumped["digest_version"], dumped["extras_digest_version"]) == (2, 1)


@pytest.mark.parametrize("model", ALL_MODELS, ids=_name)
def test_versions_default_and_are_always_serialized(model: type[BaseModel]) -> None:
    wire = _dropped(valid_wire_by_model()[model], "schema_version", "digest_version", "extras_digest_version")
    dumped = model.model_validate(wire).model_dump(mode="json", exclude_defaults=False)
    assert dumped["schema_version"] == 2
    if issubclass(model, R._DigestWireModel):
        assert (dumped["digest_version"], dumped["extras_digest_version"]) == (2, 1)


VERSION_CASES = [
    pytest.param(model, field, bad, id=f"{model.__name__}-{field}-{bad!r}")
    for model in ALL_MODELS
    for field, good in [("schema_version", 2), ("digest_version", 2), ("extras_digest_version", 1)]
    if field == "schema_version" or issubclass(model, R._DigestWireModel)
    for bad in [True, False, float(good), 3, 1, 0, -2, str(good), None]
    if not (type(bad) is int and bad == good)
]


@pytest.mark.parametrize(("model", "field", "bad"), VERSION_CASES)
def test_any_other_version_is_rejected(model: type[BaseModel], field: str, bad: object) -> None:
    with pytest.raises(ValidationError) as exc:
        model.model_validate(_wire(model, **{field: bad}))
    assert field in _field_errors(exc)
    with pytest.raises(ValidationError):
        model.model_validate_json(json.dumps(_wire(model, **{field: bad})))


def test_nested_records_carry_their_own_versions() -> None:
    bad_row = call_record_wire(digest_version=3)
    cases: list[tuple[type[BaseModel], dict[str, Any]]] = [
        (R.RolloutReceipt, receipt_wire(manifest=[bad_row])),
        (R.RolloutManifest, _wire(R.RolloutManifest, records=[bad_row])),
        (R.CaptureLedgerCommit, _wire(R.CaptureLedgerCommit, record=bad_row)),
    ]
    for model, wire in cases:
        with pytest.raises(ValidationError, match="digest_version"):
            model.model_validate(wire)


@pytest.mark.parametrize("model", ALL_MODELS, ids=_name)
def test_unknown_keys_are_forbidden(model: type[BaseModel]) -> None:
    with pytest.raises(ValidationError) as exc:
        model.model_validate(_wire(model, unexpected=1))
    assert [err["type"] for err in exc.value.errors()] == ["extra_forbidden"]


@pytest.mark.parametrize("model", STAGED_MODELS, ids=_name)
def test_staging_key_is_a_property_not_a_wire_field(model: type[R.StagedCallBaseSnapshot]) -> None:
    record = model.model_validate(valid_wire_by_model()[model])
    assert record.staging_key == R.staging_key("r1", "root") == "r1/root"
    assert "staging_key" not in record.model_dump() and "staging_key" not in record.model_dump_json()
    with pytest.raises(ValidationError) as exc:
        model.model_validate({**root_staged_wire(), "staging_key": "r1/root"})
    assert [err["type"] for err in exc.value.errors()] == ["extra_forbidden"]


def test_base_snapshot_rejects_extras_key() -> None:
    extras_values: list[dict[str, Any] | None] = [None, {}, GOLDEN_VECTOR["extras"]]
    for extras in extras_values:
        with pytest.raises(ValidationError, match="extra"):
            R.StagedCallBaseSnapshot.model_validate({**root_staged_wire(), "extras": extras})


@pytest.mark.parametrize(("rollout_id", "call_id"), [("", "c"), ("r", ""), ("", "")])
def test_staging_key_rejects_empty_parts(rollout_id: str, call_id: str) -> None:
    with pytest.raises(ValueError):
        R.staging_key(rollout_id, call_id)


# --- §2.2 strict types --------------------------------------------------------

BAD_INTS = ["1", 1.0, True, False, None, -1]
BAD_IDENTIFIERS = ["", 1, 1.5, None, b"r1", ["r1"]]
BAD_HEX = ["A" * 64, "a" * 63, "a" * 65, "0x" + "a" * 62, "a" * 64 + "\n", " " + "a" * 63, 1, None]

TYPE_CASES = [
    *[(R.StagedCallRecord, f, bad) for f in ("weight_version", "prev_len", "delta_len", "cum_len") for bad in BAD_INTS],
    *[(R.CallRecord, f, bad) for f in ("weight_version", "fingerprint_version", "cum_len") for bad in BAD_INTS],
    *[(R.CommitCoords, "weight_version", bad) for bad in BAD_INTS],
    *[(R.CaptureAdmission, "prev_len", bad) for bad in BAD_INTS],
    *[(R.GenerationCutContinuation, "prefix_token_count", bad) for bad in BAD_INTS],
    *[(R.GenerationCutContinuation, "effective_output_limit", bad) for bad in [0, -1, True, 1.0, "1"]],
    *[(R.StagedCallRecord, f, bad) for f in ("rollout_id", "model_call_id", "parent_call_id") for bad in BAD_IDENTIFIERS],
    *[(R.CallRecord, f, bad) for f in ("staging_key", "response_id", "capture_key") for bad in BAD_IDENTIFIERS],
    *[(R.RolloutReceipt, f, bad) for f in ("rollout_id", "terminal_model_call_id") for bad in BAD_IDENTIFIERS],
    *[(R.StagedCallRecord, f, bad) for f in ("digest", "extras_digest", "chain_hash", "cumulative_hash") for bad in BAD_HEX],
    *[(R.CallRecord, f, bad) for f in ("digest", "output_fingerprint", "continuation_fingerprint") for bad in BAD_HEX],
    *[(R.CommitCoords, "digest", bad) for bad in BAD_HEX if bad is not None],
    *[(R.CaptureAdmission, "parent_chain_hash", bad) for bad in BAD_HEX if bad is not None],
    *[(R.StagedCallRecord, "token_ids_delta", [10, 11, bad]) for bad in [True, 12.0, "12", None]],
    *[(R.CaptureAdmission, "required_prefix_token_ids", [bad]) for bad in [True, 1.0, "1"]],
    *[(R.StagedCallRecord, f, [0.0, 0.0, bad]) for f in ("token_mask_delta", "generation_log_probs_delta")
      for bad in [True, False, "1.0", None]],
    *[(R.CallRecord, "admitted_at", bad) for bad in [True, "1.5", "nan"]],
    *[(R.StagedCallRecord, "mode", bad) for bad in ["chat", "TEXT", None]],
    (R.CommitCoords, "disposition", "failed"),
    (R.RolloutReceipt, "terminal_selection", "walk"),
    (R.GenerationCutContinuation, "terminal_finish_reason", "eos"),
    (R.GenerationCutContinuation, "staging_keys", []),
    (R.GenerationCutContinuation, "staging_keys", [""]),
    (R.CaptureLedgerCommit, "staging_chain", [""]),
    (R.ManifestFailure, "reason", ""),
    (R.RolloutRemoval, "removed", [""]),
    (R.StageResult, "staging_key", ""),
]  # fmt: skip
_OPTIONAL = {
    "parent_call_id",
    "capture_key",
    "terminal_model_call_id",
    "output_fingerprint",
    "continuation_fingerprint",
}
TYPE_CASES = [(model, field, bad) for model, field, bad in TYPE_CASES if not (bad is None and field in _OPTIONAL)]


@pytest.mark.parametrize(
    ("model", "field", "bad"), TYPE_CASES, ids=[f"{m.__name__}-{f}-{b!r}" for m, f, b in TYPE_CASES]
)
def test_strict_field_types_reject_coercion(model: type[BaseModel], field: str, bad: object) -> None:
    with pytest.raises(ValidationError) as exc:
        model.model_validate(_wire(model, **{field: bad}))
    assert field in _field_errors(exc)


NON_FINITE = [math.nan, math.inf, -math.inf]
FLOAT_FIELD_CASES = [
    *[(R.StagedCallRecord, f, [0.0, 0.0, v]) for f in ("token_mask_delta", "generation_log_probs_delta") for v in NON_FINITE],
    *[(R.CallRecord, "admitted_at", v) for v in NON_FINITE],
    *[(R.RolloutReceipt, "reward", v) for v in [*NON_FINITE, "nan", "inf", "-Infinity"]],
]  # fmt: skip


@pytest.mark.parametrize(("model", "field", "bad"), FLOAT_FIELD_CASES, ids=_case_ids(FLOAT_FIELD_CASES))
def test_non_finite_floats_are_rejected_everywhere(model: type[BaseModel], field: str, bad: object) -> None:
    for parse in _wire_parsers(model):
        with pytest.raises(ValidationError) as exc:
            parse(_wire(model, **{field: bad}))
        assert field in _field_errors(exc)


@pytest.mark.parametrize(
    ("model", "wire", "literal"),
    [
        (R.StagedCallRecord, root_staged_wire(generation_log_probs_delta=[0.0, 0.0, 0.5]), "0.5"),
        (R.CallRecord, call_record_wire(admitted_at=0.5), "0.5"),
        (R.RolloutReceipt, receipt_wire(reward=0.5), "0.5"),
    ],
    ids=["log_probs", "admitted_at", "reward"],
)
@pytest.mark.parametrize("overflow", ["1e400", "-1e400", "NaN", "Infinity", "-Infinity"])
def test_json_literals_overflowing_float64_are_rejected(
    model: type[BaseModel], wire: dict[str, Any], literal: str, overflow: str
) -> None:
    text = json.dumps(wire)
    assert text.count(literal) == 1
    with pytest.raises(ValidationError, match="finite"):
        model.model_validate_json(text.replace(literal, overflow))


def test_strict_float_columns_accept_ints_and_convert() -> None:
    wire = root_staged_wire(token_mask_delta=[0, 0, 1], digest=ROOT_DIGEST)
    for record in (R.StagedCallRecord.model_validate(wire), R.StagedCallRecord.model_validate_json(json.dumps(wire))):
        assert record.token_mask_delta == [0.0, 0.0, 1.0]
        assert all(type(v) is float for v in record.token_mask_delta)
    row = R.CallRecord.model_validate(call_record_wire(admitted_at=5))
    assert type(row.admitted_at) is float and row.admitted_at == 5.0
    assert R.RolloutReceipt.model_validate(receipt_wire(reward="1.5")).reward == 1.5
    assert R.RolloutReceipt.model_validate(receipt_wire(reward=2)).reward == 2.0


# --- §3 rules -------------------------------------------------------------------

_CUT = valid_wire_by_model()[R.GenerationCutContinuation]
_TOKEN_IN = {
    "rollout_id": "r1",
    "model_call_id": "main",
    "parent_call_id": "root",
    "prev_len": 3,
    "mode": "token_in",
    "required_prefix_token_ids": [10, 11, 12],
    "parent_chain_hash": ROOT_CHAIN_HASH,
}
_TEXT = valid_wire_by_model()[R.CaptureAdmission]
_FAILED_COORDS = commit_coords_wire(
    disposition="capture_failed",
    delta_len=0,
    cum_len=0,
    digest=None,
    extras_digest=None,
    staging_key=None,
    chain_hash=None,
    cumulative_hash=None,
)
_CHILD_ROW = call_record_wire(
    model_call_id="main", parent_call_id="root", prev_len=3, delta_len=2, cum_len=5, mode="token_in"
)
_TEXT_VIOLATIONS: list[dict[str, Any]] = [
    {"parent_call_id": "root"},
    {"prev_len": 1},
    {"required_prefix_token_ids": [1]},
    {"staging_chain": ["r1/root"]},
    {"parent_chain_hash": ROOT_CHAIN_HASH},
]
_POISON = {"capture_poisoned": True, "failure_reason": R.WORKER_CAPTURE_FAILED_REASON}

# (model, wire, fragment of the failing rule's meaning or None for a valid shape)
RULE_CASES: list[tuple[type[BaseModel], dict[str, Any], str | None]] = [
    # §3.1 GenerationCutContinuation
    (R.GenerationCutContinuation, _CUT, None),
    (R.GenerationCutContinuation, {**_CUT, "terminal_finish_reason": "length"}, None),
    (R.GenerationCutContinuation, {**_CUT, "terminal_finish_reason": "stop", "terminal_stop_reason": 7}, None),
    (R.GenerationCutContinuation, {**_CUT, "terminal_finish_reason": "stop", "terminal_stop_reason": "</s>"}, None),
    (R.GenerationCutContinuation, {**_CUT, "staging_keys": ["a", "b", "a"]}, "generation-cut staging keys must be unique"),
    (R.GenerationCutContinuation, {**_CUT, "terminal_stop_reason": "</s>"}, "a stop reason requires a terminal finish reason"),
    (R.GenerationCutContinuation, {**_CUT, "terminal_stop_reason": 0}, "a stop reason requires a terminal finish reason"),
    # §3.2 CaptureAdmission
    (R.CaptureAdmission, _TEXT, None),
    (R.CaptureAdmission, _TOKEN_IN, None),
    (R.CaptureAdmission, {**_TOKEN_IN, "required_prefix_token_ids": [], "staging_chain": ["r1/root"]}, None),
    (R.CaptureAdmission, {**_TOKEN_IN, "staging_chain": ["r1/root"]}, None),
    (R.CaptureAdmission, {**_TEXT, "generation_cut": _CUT}, None),
    (R.CaptureAdmission, {**_TOKEN_IN, "generation_cut": _CUT}, None),
    (R.CaptureAdmission, {**_TOKEN_IN, "required_prefix_token_ids": [10, -11, 12]}, "prefix ids must be non-negative"),
    (R.CaptureAdmission, {**_TEXT, "required_prefix_token_ids": [-1]}, "prefix ids must be non-negative"),
    (R.CaptureAdmission, {**_TOKEN_IN, "parent_call_id": None}, "token_in needs a parent and prev_len > 0"),
    (R.CaptureAdmission, {**_TOKEN_IN, "prev_len": 0, "required_prefix_token_ids": []}, "token_in needs a parent and prev_len > 0"),
    (R.CaptureAdmission, {**_TOKEN_IN, "parent_chain_hash": None}, "token_in needs the parent's chain hash"),
    (R.CaptureAdmission, {**_TOKEN_IN, "required_prefix_token_ids": [10, 11]}, "inline prefix length must equal prev_len"),
    (R.CaptureAdmission, {**_TOKEN_IN, "required_prefix_token_ids": []}, "inline prefix length must equal prev_len"),
    *[
        (R.CaptureAdmission, {**_TEXT, **bad}, "a text admission must be a parentless root with no prefix")
        for bad in _TEXT_VIOLATIONS
    ],
    # §3.6 StageResult
    (R.StageResult, {"ok": True, "staging_key": "k"}, None),
    (R.StageResult, {"ok": False, "error": "boom"}, None),
    (R.StageResult, {"ok": False, "error": "boom", "staging_key": "k"}, None),
    (R.StageResult, {"ok": True}, "a successful stage result needs a key"),
    (R.StageResult, {"ok": True, "error": "x"}, "a successful stage result needs a key"),
    (R.StageResult, {"ok": False}, "a failed stage result needs an error"),
    (R.StageResult, {"ok": False, "error": ""}, "a failed stage result needs an error"),
    (R.StageResult, {"ok": False, "staging_key": "k"}, "a failed stage result needs an error"),
    # §3.7 CommitCoords
    (R.CommitCoords, commit_coords_wire(), None),
    (R.CommitCoords, commit_coords_wire(parent_call_id="root", prev_len=3, delta_len=2, cum_len=5), None),
    (R.CommitCoords, _FAILED_COORDS, None),
    (R.CommitCoords, {**_FAILED_COORDS, "parent_call_id": "root", "prev_len": 3, "cum_len": 3}, None),
    (R.CommitCoords, commit_coords_wire(prev_len=3, cum_len=6), "prev_len"),
    (R.CommitCoords, commit_coords_wire(parent_call_id="root"), "prev_len > 0"),
    (R.CommitCoords, commit_coords_wire(cum_len=4), "cum_len"),
    *[(R.CommitCoords, commit_coords_wire(**{f: None}), "staged") for f in R._STAGED_PAYLOAD_FIELDS],
    (R.CommitCoords, commit_coords_wire(delta_len=0, cum_len=0), "delta_len"),
    *[
        (R.CommitCoords, {**_FAILED_COORDS, f: commit_coords_wire()[f]}, "capture_failed coordinates cannot carry staged payload metadata")
        for f in R._STAGED_PAYLOAD_FIELDS
    ],
    (R.CommitCoords, {**_FAILED_COORDS, "delta_len": 1, "cum_len": 1}, "delta_len"),
    # §3.8 CallRecord
    (R.CallRecord, call_record_wire(), None),
    (R.CallRecord, _CHILD_ROW, None),
    (R.CallRecord, _dropped(_CHILD_ROW, "mode"), None),
    (R.CallRecord, call_record_wire(admitted_at=1.5, capture_key="r1-a1", fingerprint_version=1, output_fingerprint=OTHER_HEX), None),
    (R.CallRecord, call_record_wire(delta_len=0, cum_len=0), "manifest lengths must describe a non-empty contiguous delta"),
    (R.CallRecord, call_record_wire(cum_len=4), "manifest lengths must describe a non-empty contiguous delta"),
    (R.CallRecord, {**_CHILD_ROW, "cum_len": 2}, "manifest lengths must describe a non-empty contiguous delta"),
    (R.CallRecord, call_record_wire(prev_len=1, cum_len=4), "prev_len"),
    (R.CallRecord, {**_CHILD_ROW, "prev_len": 0, "cum_len": 2}, "prev_len > 0"),
    (R.CallRecord, _dropped(call_record_wire(), "mode"), "text"),
    (R.CallRecord, {**_CHILD_ROW, "mode": "text"}, "token_in"),
    # §3.9 / §3.10 containers validate nested rows
    (R.CaptureLedgerCommit, _wire(R.CaptureLedgerCommit, record=call_record_wire(cum_len=9)), "manifest lengths"),
    (R.RolloutManifest, _wire(R.RolloutManifest, records=[_CHILD_ROW], failures=[{"model_call_id": "x", "reason": "r"}]), None),
    (R.RolloutManifest, _wire(R.RolloutManifest, records=[call_record_wire(delta_len=0, cum_len=0)]), "manifest lengths"),
    (R.RolloutRemoval, {"removed": [], "absent": ["r1"]}, None),
    # §3.11 RolloutReceipt: the three attribution states
    (R.RolloutReceipt, receipt_wire(), None),
    (R.RolloutReceipt, receipt_wire(**_POISON, terminal_selection="heuristic"), None),
    (R.RolloutReceipt, receipt_wire(**_POISON, terminal_selection="heuristic", terminal_model_call_id=None), None),
    (R.RolloutReceipt, receipt_wire(capture_poisoned=True, terminal_selection="content", terminal_attribution_reason="x"), None),
    (R.RolloutReceipt, receipt_wire(**_POISON, terminal_selection=None, terminal_model_call_id=None, manifest=[]), None),
    (R.RolloutReceipt, receipt_wire(manifest=[call_record_wire(), call_record_wire()]), "duplicate model_call_id in receipt manifest"),
    (R.RolloutReceipt, receipt_wire(terminal_model_call_id="ghost"), "terminal_model_call_id is absent from the receipt manifest"),
    (R.RolloutReceipt, receipt_wire(failure_reason="x"), "an unpoisoned receipt cannot carry a failure_reason"),
    (R.RolloutReceipt, receipt_wire(terminal_model_call_id=None), "an unpoisoned receipt must name its terminal and the selection method"),
    (R.RolloutReceipt, receipt_wire(terminal_selection=None), "an unpoisoned receipt must name its terminal and the selection method"),
    (R.RolloutReceipt, receipt_wire(**_POISON, terminal_selection=None), "a terminal requires a selection method"),
    (R.RolloutReceipt, receipt_wire(capture_poisoned=True, terminal_selection=None, terminal_model_call_id=None),
     "a receipt with no attribution stage must be poisoned with a failure_reason"),
    # rule order: earlier rules win
    (R.RolloutReceipt, receipt_wire(manifest=[call_record_wire()] * 2, failure_reason="x"), "duplicate model_call_id"),
    (R.RolloutReceipt, receipt_wire(terminal_model_call_id="ghost", failure_reason="x"), "terminal_model_call_id is absent"),
    (R.RolloutReceipt, receipt_wire(failure_reason="x", terminal_selection=None), "cannot carry a failure_reason"),
]  # fmt: skip


@pytest.mark.parametrize(("model", "wire", "fragment"), RULE_CASES, ids=_case_ids(RULE_CASES))
def test_record_rules(model: type[BaseModel], wire: dict[str, Any], fragment: str | None) -> None:
    if fragment is None:
        record = model.model_validate(wire)
        assert model.model_validate_json(record.model_dump_json()) == record
        return
    with pytest.raises(ValidationError, match=fragment):
        model.model_validate(wire)
    with pytest.raises(ValidationError, match=fragment):
        model.model_validate_json(json.dumps(wire))


def test_removal_wire_form() -> None:
    removal = R.RolloutRemoval(absent=["r1"])
    assert removal.model_dump(mode="json") == {"schema_version": 2, "removed": [], "absent": ["r1"]}


# --- §3.3 StagedCallBaseSnapshot rules 1–9 (and 10 for records) --------------------

_MAIN = main_staged_wire()
STAGED_CASES: list[tuple[dict[str, Any], str | None]] = [
    (root_staged_wire(), None),
    (_MAIN, None),
    (root_staged_wire(token_mask_delta=[-0.0, 0.0, 1.0]), None),
    (root_staged_wire(generation_log_probs_delta=[-0.0, 0.0, -0.1]), None),
    (root_staged_wire(generation_log_probs_delta=[0.0, 0.0, 0.0]), None),
    (root_staged_wire(weight_version=2**64 - 1, token_ids_delta=[0, 2**64 - 1, 5]), None),
    # rule 1-4: lineage
    (root_staged_wire(prev_len=1, cum_len=4), r"parentless.*prev_len"),
    (main_staged_wire(prev_len=0, cum_len=2), r"prev_len > 0"),
    (root_staged_wire(mode="token_in"), r"parentless.*'text'"),
    (main_staged_wire(mode="text"), r"parent.*'token_in'"),
    # rule 5-8
    (root_staged_wire(delta_len=0, cum_len=0, token_ids_delta=[], token_mask_delta=[], generation_log_probs_delta=[]),
     "a staged delta must contain at least one token"),
    (root_staged_wire(token_ids_delta=[10, -11, 12]), "non-negative"),
    (root_staged_wire(token_mask_delta=[0.0, 0.5, 1.0]), "mask"),
    (root_staged_wire(token_mask_delta=[0.0, 0.0, -1.0]), "mask"),
    (root_staged_wire(generation_log_probs_delta=[0.0, -0.1, -0.1]), "prompt-carry log probabilities must be 0.0"),
    (main_staged_wire(generation_log_probs_delta=[1e-30, -0.2]), "prompt-carry log probabilities must be 0.0"),
    # rule 9: digest comparison and digest pre-check failures
    (root_staged_wire(digest=OTHER_HEX), DIGEST_RULE),
    (root_staged_wire(digest=main_staged_wire()["digest"]), DIGEST_RULE),
    (root_staged_wire(token_mask_delta=[0.0, 0.0, -0.0], digest=ROOT_DIGEST), "prompt-carry log probabilities"),
    (root_staged_wire(token_mask_delta=[-0.0, 0.0, 1.0], digest=ROOT_DIGEST), DIGEST_RULE),
    (root_staged_wire(delta_len=4, cum_len=4), DIGEST_RULE),
    (root_staged_wire(delta_len=2, cum_len=2), DIGEST_RULE),
    (root_staged_wire(token_mask_delta=[0.0, 1.0]), DIGEST_RULE),
    (root_staged_wire(generation_log_probs_delta=[0.0, 0.0]), DIGEST_RULE),
    (root_staged_wire(token_mask_delta=[0.0, 0.0, 1.0, 1.0], generation_log_probs_delta=[0.0, 0.0, -0.1, -0.1]), DIGEST_RULE),
    (root_staged_wire(cum_len=4), DIGEST_RULE),
    (root_staged_wire(generation_log_probs_delta=[0.0, 0.0, -1e39]), DIGEST_RULE),
    (root_staged_wire(token_ids_delta=[10, 11, 2**64]), DIGEST_RULE),
    (root_staged_wire(weight_version=2**64), DIGEST_RULE),
    (root_staged_wire(extras_digest=OTHER_HEX, digest=ROOT_DIGEST), DIGEST_RULE),
    (root_staged_wire(chain_hash=OTHER_HEX, digest=ROOT_DIGEST), DIGEST_RULE),
    # earlier rules win over the digest comparison
    (root_staged_wire(prev_len=1, cum_len=4, digest=OTHER_HEX), r"parentless.*prev_len"),
    (root_staged_wire(generation_log_probs_delta=[0.0, -0.1, -0.1], digest=OTHER_HEX), "prompt-carry"),
]  # fmt: skip


@pytest.mark.parametrize("model", STAGED_MODELS, ids=_name)
@pytest.mark.parametrize(("wire", "fragment"), STAGED_CASES, ids=_case_ids(STAGED_CASES))
def test_staged_call_rules(model: type[R.StagedCallBaseSnapshot], wire: dict[str, Any], fragment: str | None) -> None:
    if fragment is None:
        record = model.model_validate(wire)
        assert model.model_validate_json(record.model_dump_json()) == record
        assert record.digest == wire["digest"]
        return
    for parse in _wire_parsers(model):
        with pytest.raises(ValidationError, match=fragment) as exc:
            parse(wire)
        if fragment != DIGEST_RULE:
            assert DIGEST_RULE not in str(exc.value)


def _golden_record_wire(**overrides: Any) -> dict[str, Any]:
    wire = {**GOLDEN_VECTOR["staged_call"], "digest": GOLDEN_VECTOR["staged_call_digest"]}
    return {**wire, "extras": GOLDEN_VECTOR["extras"], **overrides}


_EMPTY_DICT_DIGEST = compute_extras_digest({})
EXTRAS_CASES: list[tuple[dict[str, Any], str | None]] = [
    (_golden_record_wire(), None),
    ({**root_staged_wire(), "extras": None}, None),
    (root_staged_wire(), None),
    ({**root_staged_wire(extras_digest=_EMPTY_DICT_DIGEST), "extras": {}}, None),
    ({**root_staged_wire(extras_digest=compute_extras_digest({"x": 1.0})), "extras": {"x": 1.0}}, None),
    ({**root_staged_wire(), "extras": {}}, EXTRAS_RULE),
    ({**root_staged_wire(extras_digest=_EMPTY_DICT_DIGEST), "extras": None}, EXTRAS_RULE),
    ({**root_staged_wire(extras_digest=compute_extras_digest({"x": 1.0})), "extras": {"x": 1}}, EXTRAS_RULE),
    (_golden_record_wire(extras={"routed_experts": [[[1, 2]], [[3, 5]]]}), EXTRAS_RULE),
    # rules 1-9 run before rule 10
    (_golden_record_wire(extras={"other": 1}, digest=OTHER_HEX), DIGEST_RULE),
    (_golden_record_wire(extras={"other": 1}, weight_version=8), DIGEST_RULE),
]


@pytest.mark.parametrize("model", RECORD_MODELS, ids=_name)
@pytest.mark.parametrize(("wire", "fragment"), EXTRAS_CASES, ids=_case_ids(EXTRAS_CASES))
def test_extras_rule(model: type[R.StagedCallRecord], wire: dict[str, Any], fragment: str | None) -> None:
    if fragment is None:
        record = model.model_validate(wire)
        assert model.model_validate_json(record.model_dump_json()) == record
        return
    for parse in _wire_parsers(model):
        with pytest.raises(ValidationError, match=fragment):
            parse(wire)


@pytest.mark.parametrize("model", RECORD_MODELS, ids=_name)
@pytest.mark.parametrize("bad", [(1, 2), b"x", np.int64(1), np.float32(0.5), {"k": {1, 2}}], ids=stable_repr)
def test_extras_encoder_type_error_propagates_unchanged(model: type[R.StagedCallRecord], bad: object) -> None:
    with pytest.raises(TypeError) as exc:
        model.model_validate({**root_staged_wire(), "extras": {"v": bad}})
    assert not isinstance(exc.value, ValueError)
    # rule 9 still runs first: a wrong digest wins over the unsupported extras value
    with pytest.raises(ValidationError, match=DIGEST_RULE):
        model.model_validate({**root_staged_wire(digest=OTHER_HEX), "extras": {"v": bad}})


# --- §3.4 from_components ----------------------------------------------------------


def _components(**overrides: Any) -> dict[str, Any]:
    wire = _dropped(_golden_record_wire(), "schema_version", "digest_version", "extras_digest_version", "digest")
    return {**wire, **overrides}


@pytest.mark.parametrize("model", RECORD_MODELS, ids=_name)
def test_from_components_reproduces_the_golden_record(model: type[R.StagedCallRecord]) -> None:
    record = model.from_components(**_components())
    assert type(record) is model
    assert record.digest == GOLDEN_VECTOR["staged_call_digest"]
    assert record == model.model_validate(_golden_record_wire())
    assert model.model_validate(record.model_dump(mode="json")) == record


class _FloatSubclass(float):
    pass


@pytest.mark.parametrize("column", ["token_mask_delta", "generation_log_probs_delta"])
@pytest.mark.parametrize(
    "element", [0, 1, True, False, np.float64(0.0), np.float32(0.0), _FloatSubclass(0.0), None, "0.0"], ids=stable_repr
)
@pytest.mark.parametrize("also_invalid", [False, True], ids=["otherwise-valid", "otherwise-invalid"])
def test_from_components_exact_float_gate_raises_plain_value_error(
    column: str, element: object, also_invalid: bool
) -> None:
    values = list(_components()[column])
    values[0] = element
    extra = {"rollout_id": ""} if also_invalid else {}
    with pytest.raises(ValueError) as exc:
        R.StagedCallRecord.from_components(**_components(**{column: values}, **extra))
    assert type(exc.value) is ValueError  # the gate runs before any model validation


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        ({"rollout_id": ""}, "rollout_id"),
        ({"token_ids_delta": [10, True]}, "token_ids_delta"),
        ({"delta_len": 3, "cum_len": 6}, DIGEST_RULE),
        ({"token_mask_delta": [0.0, 1.0, 1.0]}, DIGEST_RULE),
        ({"cum_len": 6}, DIGEST_RULE),
        ({"parent_call_id": None}, "prev_len"),
        ({"generation_log_probs_delta": [-0.5, -0.25]}, "prompt-carry log probabilities must be 0.0"),
        ({"generation_log_probs_delta": [0.0, math.nan]}, "generation_log_probs_delta"),
        ({"generation_log_probs_delta": [0.0, -1e39]}, DIGEST_RULE),
        ({"extras": None}, EXTRAS_RULE),
        ({"extras_digest": EMPTY_EXTRAS_DIGEST}, EXTRAS_RULE),
        ({"chain_hash": "1" * 63}, "chain_hash"),
    ],
    ids=stable_repr,
)
def test_from_components_other_failures_are_validation_errors(overrides: dict[str, Any], fragment: str) -> None:
    with pytest.raises(ValidationError, match=fragment):
        R.StagedCallRecord.from_components(**_components(**overrides))


def test_from_components_derives_nothing_but_the_digest() -> None:
    # chain_hash / cumulative_hash are caller-supplied placeholders in the golden vector
    record = R.StagedCallRecord.from_components(**_components(chain_hash="3" * 64))
    assert record.chain_hash == "3" * 64
    assert record.cumulative_hash == "2" * 64
    assert (record.prev_len, record.delta_len, record.cum_len) == (3, 2, 5)
    assert record.extras_digest == GOLDEN_VECTOR["extras_digest"]
    assert record.digest != GOLDEN_VECTOR["staged_call_digest"]


@pytest.fixture
def digest_calls(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """Record every call digest computation made by the staged-call records."""
    calls: list[dict[str, Any]] = []
    original = digest.compute_staging_digest

    def counting(**fields: Any) -> str:
        calls.append(fields)
        return original(**fields)

    monkeypatch.setattr("sink.contract.staged_records.compute_staging_digest", counting)
    # The fast path hashes packed columns through a second entry point; count it too.
    packed = digest.staging_digest_from_packed

    def counting_packed(fields: Mapping[str, Any], *columns: Any) -> str:
        calls.append(dict(fields))
        return packed(fields, *columns)

    monkeypatch.setattr("sink.contract.record_form.staging_digest_from_packed", counting_packed)
    return calls


def test_from_components_computes_the_digest_exactly_once(digest_calls: list[dict[str, Any]]) -> None:
    record = R.StagedCallRecord.from_components(**_components())
    assert len(digest_calls) == 1
    assert record.digest == GOLDEN_VECTOR["staged_call_digest"]


@pytest.mark.parametrize(
    "parse",
    [
        lambda w: R.StagedCallRecord(**w),
        R.StagedCallRecord.model_validate,
        lambda w: R.StagedCallRecord.model_validate_json(json.dumps(w)),
        lambda w: R.StagedCallSnapshot.model_validate(w),
    ],
    ids=["constructor", "model_validate", "model_validate_json", "snapshot"],
)
def test_wire_construction_always_recomputes_and_compares(parse: Any, digest_calls: list[dict[str, Any]]) -> None:
    parse(_golden_record_wire())
    assert len(digest_calls) == 1
    with pytest.raises(ValidationError, match=DIGEST_RULE):
        parse(_golden_record_wire(digest=OTHER_HEX))
    with pytest.raises(ValidationError):
        parse(_dropped(_golden_record_wire(), "digest"))


@pytest.mark.parametrize(
    "context",
    [None, {}, {"build": "build"}, {"build": True}, {"build": object()}, {"build": R._BUILD_STAGING_DIGEST.__class__}],
    ids=stable_repr,
)
def test_build_sentinel_cannot_be_triggered_from_wire_data(context: dict[str, Any] | None) -> None:
    wrong = _golden_record_wire(digest=OTHER_HEX)
    with pytest.raises(ValidationError, match=DIGEST_RULE):
        R.StagedCallRecord.model_validate(wrong, context=context)
    for data in ({**wrong, "build": "build"}, {**wrong, "build": True}, {**wrong, "context": {"build": "build"}}):
        with pytest.raises(ValidationError, match="extra"):
            R.StagedCallRecord.model_validate(data)
    with pytest.raises(ValidationError):
        R.StagedCallRecord.model_validate(_golden_record_wire(digest=R._BUILD_STAGING_DIGEST))
    with pytest.raises(ValidationError):
        R.StagedCallRecord.model_validate_json(json.dumps({**wrong, "build": "build"}))


# --- digest stability (hypothesis) ---------------------------------------------------

_IDENT = st.text(st.characters(codec="utf-8"), min_size=1, max_size=8)
_EXTRAS = st.none() | st.dictionaries(
    st.text(max_size=4),
    st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.floats(allow_nan=False, allow_infinity=False)
    | st.lists(st.integers(0, 255), max_size=3),
    max_size=3,
)  # fmt: skip


@st.composite
def staged_components(draw: st.DrawFn) -> dict[str, Any]:
    parent = draw(st.none() | _IDENT)
    prev_len = 0 if parent is None else draw(st.integers(1, 2**40))
    carry = draw(st.integers(0, 3))
    generated = draw(st.integers(0 if carry else 1, 3))
    ids = draw(st.lists(st.integers(0, 2**64 - 1), min_size=carry + generated, max_size=carry + generated))
    log_probs = draw(st.lists(st.floats(-100.0, 0.0, width=32), min_size=generated, max_size=generated))
    extras = draw(_EXTRAS)
    parent_chain = None if parent is None else draw(st.sampled_from([ROOT_CHAIN_HASH, OTHER_HEX]))
    return {
        "rollout_id": draw(_IDENT),
        "model_call_id": draw(_IDENT),
        "parent_call_id": parent,
        "mode": "text" if parent is None else "token_in",
        "prev_len": prev_len,
        "delta_len": len(ids),
        "cum_len": prev_len + len(ids),
        "weight_version": draw(st.integers(0, 2**64 - 1)),
        "token_ids_delta": ids,
        "token_mask_delta": [0.0] * carry + [1.0] * generated,
        "generation_log_probs_delta": [0.0] * carry + log_probs,
        "extras": extras,
        "extras_digest": compute_extras_digest(extras),
        "chain_hash": compute_chain_hash(parent_chain, ids),
        "cumulative_hash": hash_token_ids(ids),
    }


@settings(max_examples=50, deadline=None)
@given(staged_components())
def test_same_inputs_give_the_same_digest(components: dict[str, Any]) -> None:
    first = R.StagedCallRecord.from_components(**components)
    second = R.StagedCallSnapshot.from_components(**components)
    assert first.digest == second.digest
    wire = first.model_dump(mode="json")
    assert R.StagedCallSnapshot.model_validate(wire).digest == first.digest
    assert R.StagedCallSnapshot.model_validate_json(first.model_dump_json()) == R.StagedCallSnapshot(**wire)
    base_wire = _dropped(wire, "extras")
    assert R.StagedCallBaseSnapshot.model_validate(base_wire).digest == first.digest
    digest_inputs = (*record_schema.DIGEST_SCALAR_FIELDS, *record_schema.COLUMN_FIELDS)
    assert compute_staging_digest(**{name: base_wire[name] for name in digest_inputs}) == first.digest


def _other_hex(value: str) -> str:
    return ("0" if value[0] != "0" else "1") + value[1:]


def _bump_float(values: list[float], index: int) -> list[float]:
    return [v - 1.0 if i == index else v for i, v in enumerate(values)]


TAMPERS: dict[str, Any] = {
    "schema_version": lambda v, i: 3,
    "digest_version": lambda v, i: 1,
    "extras_digest_version": lambda v, i: 2,
    "rollout_id": lambda v, i: v + "x",
    "model_call_id": lambda v, i: v + "x",
    "parent_call_id": lambda v, i: "p" if v is None else v + "x",
    "mode": lambda v, i: "text" if v == "token_in" else "token_in",
    "prev_len": lambda v, i: v + 1,
    "delta_len": lambda v, i: v + 1,
    "cum_len": lambda v, i: v + 1,
    "weight_version": lambda v, i: v + 1 if v < 2**64 - 1 else v - 1,
    "digest": lambda v, i: _other_hex(v),
    "token_ids_delta": lambda v, i: [t + 1 if j == i % len(v) and t < 2**64 - 1 else t - 1 if j == i % len(v) else t
                                     for j, t in enumerate(v)],
    "token_mask_delta": lambda v, i: [1.0 - m if j == i % len(v) else m for j, m in enumerate(v)],
    "generation_log_probs_delta": lambda v, i: _bump_float(v, i % len(v)),
    "extras_digest": lambda v, i: _other_hex(v),
    "extras": lambda v, i: {"tamper": 1} if v is None else {**v, "\x00tamper": 1},
    "chain_hash": lambda v, i: _other_hex(v),
    "cumulative_hash": lambda v, i: _other_hex(v),
}  # fmt: skip


@settings(max_examples=150, deadline=None)
@given(staged_components(), st.sampled_from(sorted(TAMPERS)), st.integers(0, 10), st.sampled_from(STAGED_MODELS))
def test_tampering_any_single_field_is_rejected(
    components: dict[str, Any], field: str, index: int, model: type[R.StagedCallBaseSnapshot]
) -> None:
    wire = R.StagedCallRecord.from_components(**components).model_dump(mode="json")
    if model is R.StagedCallBaseSnapshot:
        if field == "extras":
            return
        wire = _dropped(wire, "extras")
    model.model_validate(wire)
    tampered = {**wire, field: TAMPERS[field](wire[field], index)}
    assert tampered[field] != wire[field]
    with pytest.raises(ValidationError):
        model.model_validate(tampered)
    with pytest.raises(ValidationError):
        model.model_validate_json(json.dumps(tampered))


# --- the field table and its derivations (sink.contract.record_schema) -----------------------

# The orders below are wire facts: the digest payload (contract §4.3), the codec's
# stored scalars, step 8f of contract §8.1 and the calls-stream entry. A table
# edit that changes one of them fails here.
DIGEST_SCALARS_ON_THE_WIRE = (
    "schema_version",
    "digest_version",
    "extras_digest_version",
    "rollout_id",
    "model_call_id",
    "parent_call_id",
    "mode",
    "prev_len",
    "delta_len",
    "cum_len",
    "weight_version",
    "extras_digest",
    "chain_hash",
    "cumulative_hash",
)
IDENTITY_ON_THE_WIRE = (
    "model_call_id",
    "parent_call_id",
    "mode",
    "prev_len",
    "delta_len",
    "cum_len",
    "weight_version",
    "digest",
    "extras_digest",
    "chain_hash",
    "cumulative_hash",
)
CALLS_ENTRY_ON_THE_WIRE = ("key", "call", "parent", "digest", "prev_len", "delta_len", "cum_len", "weight", "bytes")


def test_table_derivations_keep_the_wire_orders() -> None:
    assert record_schema.DIGEST_SCALAR_FIELDS == DIGEST_SCALARS_ON_THE_WIRE
    assert record_schema.STORED_SCALAR_FIELDS == DIGEST_SCALARS_ON_THE_WIRE
    assert record_schema.IDENTITY_FIELDS == IDENTITY_ON_THE_WIRE
    assert record_schema.CALLS_ENTRY_FIELDS == CALLS_ENTRY_ON_THE_WIRE
    assert record_schema.COLUMN_FIELDS == ("token_ids_delta", "token_mask_delta", "generation_log_probs_delta")
    assert tuple(R.StagedCallBaseSnapshot.model_fields) == tuple(field.name for field in record_schema.RECORD_FIELDS)


def test_calls_entry_values() -> None:
    root = R.StagedCallRecord.model_validate(root_staged_wire())
    entry = record_schema.calls_entry("k", root, 123)
    lengths = (str(root.delta_len), str(root.cum_len), str(root.weight_version))
    assert entry == ("k", root.model_call_id, "", root.digest, "0", *lengths, "123")
    assert len(entry) == len(record_schema.CALLS_ENTRY_FIELDS)


@pytest.mark.parametrize("value", [2, True, 2.0, "2", 3, None])
def test_one_version_rule(value: object) -> None:
    problem = record_schema.unsupported_version("schema_version", value, 2)
    assert (problem is None) == (type(value) is int and value == 2)
    if problem is not None:
        assert problem == f"unsupported schema_version {value!r}: only 2 is accepted"


@pytest.mark.parametrize(
    ("parent", "prev_len", "mode", "problem"),
    [
        (None, 0, "text", None),
        ("p", 3, "token_in", None),
        (None, 0, None, None),
        ("p", 3, None, None),
        (None, 1, "text", "parentless call must have prev_len == 0"),
        (None, 0, "token_in", "parentless call must have mode 'text'"),
        ("p", 0, "token_in", "with a parent must have prev_len > 0"),
        ("p", 3.0, "token_in", "with a parent must have prev_len > 0"),
        ("p", 3, "text", "with a parent must have mode 'token_in'"),
    ],
)
def test_one_lineage_rule(parent: str | None, prev_len: object, mode: str | None, problem: str | None) -> None:
    found = record_schema.lineage_problem(parent, prev_len, mode)
    assert found is None if problem is None else problem in (found or "")
