"""Receipt assembly (contract §7.1 steps 1–4 and the outcome table; §3.11 states)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sink.contract.fingerprint import assistant_fingerprint
from sink.contract.records import (
    INVALID_COMMIT_COORDS_REASON,
    TERMINAL_AMBIGUOUS,
    TERMINAL_DUPLICATE_CALL_ID,
    TERMINAL_NO_RECORDS,
    UNRESOLVED_PARENT_REASON,
    WORKER_CAPTURE_FAILED_REASON,
    CallRecord,
    ManifestFailure,
    RolloutManifest,
    RolloutReceipt,
)
from sink.rollout.receipt import MANIFEST_UNAVAILABLE_REASON, build_receipt
from tests.helpers.contract_examples import manifest_row

ROLLOUT = "rollout-1"
MSG = {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "final answer"}]}


def row(call_id: str, parent: str | None = None, **fields: Any) -> CallRecord:
    """A valid manifest row (see ``contract_examples.manifest_row``)."""
    return manifest_row(call_id, parent, rollout=ROLLOUT, capture_key=ROLLOUT, **fields)


def manifest(records: list[CallRecord], failures: list[tuple[str, str]] | None = None) -> RolloutManifest:
    return RolloutManifest(
        rollout_id=ROLLOUT,
        records=records,
        failures=[ManifestFailure(model_call_id=call_id, reason=reason) for call_id, reason in failures or []],
    )


def chain() -> list[CallRecord]:
    return [row("a"), row("b", "a"), row("c", "b", output_fp=assistant_fingerprint([MSG]))]


def assert_valid(receipt: RolloutReceipt) -> None:
    """The receipt round-trips through the wire and sits in exactly one §3.11 state."""
    assert RolloutReceipt.model_validate_json(receipt.model_dump_json()) == receipt
    trainable = not receipt.capture_poisoned
    attributed_poison = receipt.capture_poisoned and receipt.terminal_selection is not None
    no_stage = receipt.capture_poisoned and receipt.terminal_selection is None
    assert [trainable, attributed_poison, no_stage].count(True) == 1
    if receipt.capture_poisoned:
        assert receipt.failure_reason  # we always say why


# --- step 1: unreadable manifest -------------------------------------------------------


def test_unreadable_manifest_is_state_three() -> None:
    receipt = build_receipt(None, rollout_id=ROLLOUT, reward=1.0, response={"id": "resp-c"}, declared_response_id="x")
    assert_valid(receipt)
    assert MANIFEST_UNAVAILABLE_REASON == "manifest_unavailable"
    assert receipt.manifest == []
    assert receipt.capture_poisoned is True
    assert receipt.failure_reason == "manifest_unavailable"
    assert receipt.terminal_selection is None
    assert receipt.terminal_model_call_id is None
    assert receipt.terminal_attribution_reason is None
    assert receipt.reward == 1.0
    assert receipt.rollout_id == ROLLOUT


def test_manifest_of_another_rollout_is_rejected() -> None:
    other = RolloutManifest(rollout_id="rollout-2", records=chain())
    with pytest.raises(ValueError, match="rollout-2"):
        build_receipt(other, rollout_id=ROLLOUT, reward=0.0)


# --- outcome table ------------------------------------------------------------------------


def test_witness_attributes() -> None:
    receipt = build_receipt(manifest(chain()), rollout_id=ROLLOUT, reward=0.5, response={"id": "resp-c"})
    assert_valid(receipt)
    assert (receipt.terminal_selection, receipt.terminal_model_call_id) == ("response_id", "c")
    assert receipt.terminal_attribution_reason == "response_has_no_output"
    assert receipt.capture_poisoned is False
    assert receipt.failure_reason is None
    assert receipt.manifest == chain()


def test_content_witness_attributes_with_corroboration() -> None:
    response = {"id": "resp-c", "output": [MSG]}
    receipt = build_receipt(
        manifest(chain()), rollout_id=ROLLOUT, reward=None, response=response, declared_response_id="resp-c"
    )
    assert_valid(receipt)
    assert (receipt.terminal_selection, receipt.terminal_model_call_id) == ("declared", "c")
    assert receipt.terminal_attribution_reason == "corroborated_by=response_id+content"


@pytest.mark.parametrize(
    ("records", "reason"),
    [
        (chain(), "declared_terminal_not_captured"),
        ([row("a"), row("b", "a", response_id="dup"), row("c", "a", response_id="dup")], "declared_ambiguous"),
    ],
)
def test_declaration_failures_poison_without_fallback(records: list[CallRecord], reason: str) -> None:
    declared = "nope" if reason == "declared_terminal_not_captured" else "dup"
    # The response id alone would attribute "a" and the walk would select; neither may run.
    receipt = build_receipt(
        manifest(records), rollout_id=ROLLOUT, reward=1.0, response={"id": "resp-a"}, declared_response_id=declared
    )
    assert_valid(receipt)
    assert receipt.terminal_selection == "declared"
    assert receipt.terminal_model_call_id is None
    assert receipt.terminal_attribution_reason == reason
    assert receipt.capture_poisoned is True
    assert receipt.failure_reason == reason


def test_witness_disagreement_poisons_without_fallback() -> None:
    response = {"id": "resp-b", "output": [MSG]}
    receipt = build_receipt(manifest(chain()), rollout_id=ROLLOUT, reward=1.0, response=response)
    assert_valid(receipt)
    trail = "witness_disagreement[response_id=b;content=c]"
    assert receipt.terminal_selection == "response_id"
    assert receipt.terminal_model_call_id is None
    assert receipt.terminal_attribution_reason == trail
    assert receipt.failure_reason == trail
    assert receipt.capture_poisoned is True


def test_no_witness_walk_selects() -> None:
    receipt = build_receipt(manifest(chain()), rollout_id=ROLLOUT, reward=1.0, response={"id": "unknown"})
    assert_valid(receipt)
    assert (receipt.terminal_selection, receipt.terminal_model_call_id) == ("heuristic", "c")
    assert receipt.terminal_attribution_reason == "response_id_no_match,response_has_no_output,selected"
    assert receipt.capture_poisoned is False
    assert receipt.failure_reason is None


def test_no_response_walk_selects() -> None:
    receipt = build_receipt(manifest(chain()), rollout_id=ROLLOUT, reward=1.0)
    assert_valid(receipt)
    assert (receipt.terminal_selection, receipt.terminal_model_call_id) == ("heuristic", "c")
    assert receipt.terminal_attribution_reason == "no_response_object,selected"


def test_empty_declaration_allows_the_walk() -> None:
    receipt = build_receipt(manifest(chain()), rollout_id=ROLLOUT, reward=1.0, declared_response_id="")
    assert (receipt.terminal_selection, receipt.terminal_model_call_id) == ("heuristic", "c")


def test_no_witness_walk_fails() -> None:
    records = [row("a"), row("b1", "a"), row("b2", "a")]
    receipt = build_receipt(manifest(records), rollout_id=ROLLOUT, reward=1.0)
    assert_valid(receipt)
    assert receipt.terminal_selection == "heuristic"
    assert receipt.terminal_model_call_id is None
    assert receipt.terminal_attribution_reason == f"no_response_object,{TERMINAL_AMBIGUOUS}"
    assert receipt.capture_poisoned is True
    assert receipt.failure_reason == TERMINAL_AMBIGUOUS


def test_empty_manifest_walk_fails_with_no_records() -> None:
    receipt = build_receipt(manifest([]), rollout_id=ROLLOUT, reward=None, response={"id": "r", "output": [MSG]})
    assert_valid(receipt)
    assert receipt.terminal_selection == "heuristic"
    assert receipt.failure_reason == TERMINAL_NO_RECORDS
    assert receipt.terminal_attribution_reason == f"response_id_no_match,no_content_match,{TERMINAL_NO_RECORDS}"


# --- failures poisoning ---------------------------------------------------------------------


def test_failure_poisons_an_attributed_receipt_and_keeps_the_terminal() -> None:
    failures = [("x", UNRESOLVED_PARENT_REASON)]
    receipt = build_receipt(manifest(chain(), failures), rollout_id=ROLLOUT, reward=1.0, response={"id": "resp-c"})
    assert_valid(receipt)
    assert (receipt.terminal_selection, receipt.terminal_model_call_id) == ("response_id", "c")
    assert receipt.capture_poisoned is True
    assert receipt.failure_reason == UNRESOLVED_PARENT_REASON


def test_first_failure_in_manifest_order_wins() -> None:
    failures = [("y", WORKER_CAPTURE_FAILED_REASON), ("x", INVALID_COMMIT_COORDS_REASON)]
    receipt = build_receipt(manifest(chain(), failures), rollout_id=ROLLOUT, reward=1.0)
    assert_valid(receipt)
    assert receipt.failure_reason == WORKER_CAPTURE_FAILED_REASON
    assert (receipt.terminal_selection, receipt.terminal_model_call_id) == ("heuristic", "c")


def test_manifest_failure_beats_the_attribution_failure_reason() -> None:
    failures = [("x", UNRESOLVED_PARENT_REASON)]
    receipt = build_receipt(manifest(chain(), failures), rollout_id=ROLLOUT, reward=1.0, declared_response_id="nope")
    assert_valid(receipt)
    assert receipt.failure_reason == UNRESOLVED_PARENT_REASON
    assert receipt.terminal_attribution_reason == "declared_terminal_not_captured"
    assert receipt.terminal_selection == "declared"


def test_failures_only_manifest() -> None:
    receipt = build_receipt(manifest([], [("x", UNRESOLVED_PARENT_REASON)]), rollout_id=ROLLOUT, reward=0.0)
    assert_valid(receipt)
    assert receipt.failure_reason == UNRESOLVED_PARENT_REASON
    assert receipt.terminal_selection == "heuristic"
    assert receipt.terminal_attribution_reason == f"no_response_object,{TERMINAL_NO_RECORDS}"


def test_duplicate_ids_keep_first_row_and_poison() -> None:
    first, second = row("a"), row("a", same_as="other")
    receipt = build_receipt(manifest([first, row("b", "a"), second]), rollout_id=ROLLOUT, reward=1.0, response=None)
    assert_valid(receipt)
    assert [r.model_call_id for r in receipt.manifest] == ["a", "b"]
    assert receipt.manifest[0] == first
    assert receipt.terminal_selection == "heuristic"
    assert receipt.terminal_model_call_id is None
    assert receipt.failure_reason == TERMINAL_DUPLICATE_CALL_ID
    assert receipt.terminal_attribution_reason == TERMINAL_DUPLICATE_CALL_ID


# --- purity -----------------------------------------------------------------------------------


def test_build_is_deterministic_and_pure() -> None:
    source = manifest(chain(), [("x", UNRESOLVED_PARENT_REASON)])
    snapshot = source.model_dump()
    response = {"id": "resp-b", "output": [MSG]}
    first = build_receipt(source, rollout_id=ROLLOUT, reward=2, response=response)
    second = build_receipt(source, rollout_id=ROLLOUT, reward=2, response=response)
    assert first.model_dump_json() == second.model_dump_json()
    assert source.model_dump() == snapshot
    assert first.reward == 2.0


def test_non_finite_reward_is_a_caller_error() -> None:
    with pytest.raises(ValueError, match="finite"):
        build_receipt(manifest(chain()), rollout_id=ROLLOUT, reward=float("nan"))


# --- property: every manifest yields a valid receipt ------------------------------------------

_IDS = ["a", "b", "c", "d", "e"]


@st.composite
def _manifests(draw: st.DrawFn) -> RolloutManifest:
    count = draw(st.integers(min_value=0, max_value=5))
    records = []
    for index in range(count):
        call_id = draw(st.sampled_from(_IDS)) if draw(st.booleans()) else _IDS[index]
        parent = draw(st.sampled_from([None, *_IDS, "ghost"]))
        records.append(
            row(
                call_id,
                parent,
                admitted_at=draw(st.none() | st.floats(0, 10)),
                response_id=draw(st.sampled_from(["r1", "r2", None])),
                same_as=draw(st.sampled_from(["s", None])),
                output_fp=draw(st.sampled_from([assistant_fingerprint([MSG]), None])),
            )
        )
    failures = draw(st.lists(st.sampled_from([UNRESOLVED_PARENT_REASON, WORKER_CAPTURE_FAILED_REASON]), max_size=2))
    return manifest(records, [(f"f{i}", reason) for i, reason in enumerate(failures)])


@settings(max_examples=150, deadline=None)
@given(
    _manifests() | st.none(),
    st.sampled_from([None, "", "r1", "r2", "resp-a", "missing"]),
    st.sampled_from([None, "junk", {"id": "r1"}, {"id": "resp-b", "output": [MSG]}, {"output": [MSG]}]),
)
def test_every_manifest_yields_a_valid_receipt(
    source: RolloutManifest | None, declared: str | None, response: Any
) -> None:
    receipt = build_receipt(source, rollout_id=ROLLOUT, reward=1.0, response=response, declared_response_id=declared)
    assert_valid(receipt)
    if source is None:
        assert receipt.failure_reason == MANIFEST_UNAVAILABLE_REASON
        return
    assert receipt.terminal_selection is not None
    if source.failures:
        assert receipt.failure_reason == source.failures[0].reason
    if declared and receipt.terminal_model_call_id is None:
        assert receipt.terminal_selection in ("declared", "heuristic")
    if declared and receipt.terminal_selection == "heuristic":
        # Only a manifest with repeated ids skips the witnesses.
        assert len({r.model_call_id for r in source.records}) != len(source.records)
