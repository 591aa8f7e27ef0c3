"""Terminal selection: the heuristic walk (§7.4), the collapse rule (§7.3) and the witness resolver (§7.2)."""

from __future__ import annotations

from typing import Any

import pytest

from sink.contract.fingerprint import assistant_fingerprint
from sink.contract.records import (
    TERMINAL_AMBIGUOUS,
    TERMINAL_DUPLICATE_CALL_ID,
    TERMINAL_NO_RECORDS,
    TERMINAL_NO_ROOT,
    TERMINAL_ORPHANED_ROW,
    TERMINAL_SELECTED,
    CallRecord,
)
from sink.rollout.terminal import (
    TerminalAttribution,
    TerminalSelection,
    collapse_candidates,
    resolve_terminal,
    select_terminal_call,
)
from tests.helpers.contract_examples import manifest_row


def row(call_id: str, parent: str | None = None, **fields: Any) -> CallRecord:
    """A valid manifest row (see ``contract_examples.manifest_row``)."""
    return manifest_row(call_id, parent, **fields)


# --- heuristic walk ---------------------------------------------------------------


def test_selection_types_are_tuples_with_named_fields() -> None:
    selection = select_terminal_call([row("a")])
    assert isinstance(selection, TerminalSelection)
    assert selection == TerminalSelection(terminal_model_call_id="a", reason=TERMINAL_SELECTED)
    assert TerminalAttribution("a", "declared", None).method == "declared"


def test_empty_manifest() -> None:
    assert select_terminal_call([]) == (None, TERMINAL_NO_RECORDS)


def test_linear_chain_selects_the_leaf() -> None:
    assert select_terminal_call([row("a"), row("b", "a"), row("c", "b")]) == ("c", TERMINAL_SELECTED)


def test_abandoned_mid_rollout_retry_is_ignored() -> None:
    records = [row("a"), row("b", "a"), row("b_retry", "a"), row("c", "b")]
    assert select_terminal_call(records) == ("c", TERMINAL_SELECTED)
    # The abandoned sibling may come after the extended one in manifest order, too.
    records = [row("a"), row("b", "a"), row("c", "b"), row("b_retry", "a")]
    assert select_terminal_call(records) == ("c", TERMINAL_SELECTED)


def test_retried_final_call_is_ambiguous() -> None:
    records = [row("a"), row("b", "a"), row("c1", "b"), row("c2", "b", same_as="c1")]
    assert select_terminal_call(records) == (None, TERMINAL_AMBIGUOUS)


def test_two_extended_branches_are_ambiguous() -> None:
    records = [row("a"), row("b", "a"), row("c", "a"), row("d", "b"), row("e", "c")]
    assert select_terminal_call(records) == (None, TERMINAL_AMBIGUOUS)


def test_ambiguity_deeper_in_the_tree() -> None:
    records = [row("a"), row("b", "a"), row("b2", "a"), row("c", "b"), row("d1", "c"), row("d2", "c")]
    assert select_terminal_call(records) == (None, TERMINAL_AMBIGUOUS)


def test_several_childless_roots_earliest_admission_wins() -> None:
    records = [row("r1", admitted_at=5.0), row("r2", admitted_at=3.0), row("r3", admitted_at=4.0)]
    assert select_terminal_call(records) == ("r2", TERMINAL_SELECTED)


def test_stamped_root_beats_unstamped_root() -> None:
    records = [row("r1"), row("r2", admitted_at=9.0)]
    assert select_terminal_call(records) == ("r2", TERMINAL_SELECTED)


def test_zero_admission_time_is_stamped() -> None:
    records = [row("r1"), row("r2", admitted_at=0.0)]
    assert select_terminal_call(records) == ("r2", TERMINAL_SELECTED)


def test_root_ties_fall_back_to_manifest_order() -> None:
    assert select_terminal_call([row("r2", admitted_at=1.0), row("r1", admitted_at=1.0)]) == ("r2", TERMINAL_SELECTED)
    assert select_terminal_call([row("z"), row("a")]) == ("z", TERMINAL_SELECTED)


def test_extended_root_beats_earlier_childless_root() -> None:
    records = [row("early", admitted_at=1.0), row("late", admitted_at=2.0), row("child", "late", admitted_at=3.0)]
    assert select_terminal_call(records) == ("child", TERMINAL_SELECTED)


def test_two_extended_roots_pick_the_earliest() -> None:
    records = [
        row("r1", admitted_at=2.0),
        row("r2", admitted_at=1.0),
        row("c1", "r1"),
        row("c2", "r2"),
    ]
    assert select_terminal_call(records) == ("c2", TERMINAL_SELECTED)


def test_orphaned_row() -> None:
    assert select_terminal_call([row("a"), row("b", "missing")]) == (None, TERMINAL_ORPHANED_ROW)


def test_cycle_without_root() -> None:
    assert select_terminal_call([row("a", "b"), row("b", "a")]) == (None, TERMINAL_NO_ROOT)
    assert select_terminal_call([row("self", "self")]) == (None, TERMINAL_NO_ROOT)


def test_cycle_beside_a_root_is_never_reached() -> None:
    records = [row("root"), row("x", "y"), row("y", "x")]
    assert select_terminal_call(records) == ("root", TERMINAL_SELECTED)


def test_duplicate_ids_are_checked_before_orphans() -> None:
    assert select_terminal_call([row("a"), row("a")]) == (None, TERMINAL_DUPLICATE_CALL_ID)
    assert select_terminal_call([row("a"), row("b", "zz"), row("b", "zz")]) == (None, TERMINAL_DUPLICATE_CALL_ID)


def test_orphans_are_checked_before_missing_root() -> None:
    assert select_terminal_call([row("a", "b"), row("b", "zz")]) == (None, TERMINAL_ORPHANED_ROW)


# --- collapse rule ------------------------------------------------------------------


def test_collapse_rule() -> None:
    assert collapse_candidates([]) is None
    single = row("x")
    assert collapse_candidates([single]) is single
    retries = [row("b2", same_as="b"), row("b", same_as="b"), row("b3", same_as="b")]
    assert collapse_candidates(retries) is retries[1]
    assert collapse_candidates([row("b"), row("c")]) is None


# --- witness resolver ---------------------------------------------------------------

FC1 = {"type": "function_call", "call_id": "c1", "name": "search", "arguments": '{"q":"x"}'}
FCO1 = {"type": "function_call_output", "call_id": "c1", "output": "found"}
MSG2 = {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "answer"}]}
USER = {"role": "user", "content": "question"}
REASONING = {"type": "reasoning", "summary": []}


def conversation_rows(**overrides: Any) -> list[CallRecord]:
    """Two calls of one agent loop, stamped as the gate stamps them (§6.6 step 9)."""
    first = row(
        "a",
        output_fp=assistant_fingerprint([FC1]),
        continuation_fp=assistant_fingerprint([USER, FC1]),
    )
    second_fields: dict[str, Any] = {
        "output_fp": assistant_fingerprint([MSG2]),
        "continuation_fp": assistant_fingerprint([USER, FC1, FCO1, MSG2]),
    }
    second_fields.update(overrides)
    return [first, row("b", "a", **second_fields)]


TRAJECTORY = {"id": "agent-resp", "output": [FC1, FCO1, REASONING, MSG2]}


def test_declared_hit() -> None:
    records = [row("a"), row("b", "a")]
    assert resolve_terminal(records, None, declared_response_id="resp-b") == ("b", "declared", "no_response_object")


def test_declared_miss_does_not_fall_back() -> None:
    records = [row("a"), row("b", "a")]
    outcome = resolve_terminal(records, {"id": "resp-b"}, declared_response_id="resp-zzz")
    assert outcome == (None, "declared", "declared_terminal_not_captured")


def test_declared_ambiguous_does_not_fall_back() -> None:
    records = [row("a"), row("b", "a", response_id="dup"), row("c", "a", response_id="dup")]
    outcome = resolve_terminal(records, {"id": "resp-a"}, declared_response_id="dup")
    assert outcome == (None, "declared", "declared_ambiguous")


def test_declared_identical_retries_collapse_to_smallest_id() -> None:
    records = [row("a"), row("b2", "a", response_id="dup", same_as="b"), row("b1", "a", response_id="dup", same_as="b")]
    assert resolve_terminal(records, None, declared_response_id="dup").model_call_id == "b1"


def test_empty_declaration_is_no_declaration() -> None:
    outcome = resolve_terminal([row("a")], None, declared_response_id="")
    assert outcome == (None, None, "no_response_object")


def test_response_id_hit() -> None:
    records = [row("a"), row("b", "a")]
    assert resolve_terminal(records, {"id": "resp-a"}) == ("a", "response_id", "response_has_no_output")


def test_response_id_miss_is_no_witness() -> None:
    outcome = resolve_terminal([row("a")], {"id": "other"})
    assert outcome == (None, None, "response_id_no_match,response_has_no_output")


def test_response_id_ambiguous() -> None:
    records = [row("a", response_id="x"), row("b", "a", response_id="x")]
    assert resolve_terminal(records, {"id": "x", "output": []}) == (
        None,
        None,
        "response_id_ambiguous,response_has_no_output",
    )


@pytest.mark.parametrize("response", [{"output": [MSG2]}, {"id": "", "output": [MSG2]}, {"id": 7, "output": [MSG2]}])
def test_response_without_usable_id(response: dict[str, Any]) -> None:
    outcome = resolve_terminal(conversation_rows(), response)
    assert outcome == ("b", "content", "response_has_no_id")


@pytest.mark.parametrize("response", [None, "text", ["list"], 5])
def test_response_not_an_object(response: Any) -> None:
    assert resolve_terminal([row("a")], response) == (None, None, "no_response_object")


def test_content_via_continuation_and_tail() -> None:
    # target = fp(FC1 + MSG2) = b's continuation; tail = fp(MSG2) = b's output.
    assert resolve_terminal(conversation_rows(), TRAJECTORY) == ("b", "content", "response_id_no_match")


def test_content_via_continuation_alone() -> None:
    records = conversation_rows(output_fp=None)
    assert resolve_terminal(records, TRAJECTORY) == ("b", "content", "response_id_no_match")


def test_content_via_tail_alone() -> None:
    records = conversation_rows(continuation_fp=None)
    assert resolve_terminal(records, TRAJECTORY) == ("b", "content", "response_id_no_match")


def test_content_via_output_fingerprint_of_the_whole_output() -> None:
    records = conversation_rows(continuation_fp=None)
    assert resolve_terminal(records, {"output": [REASONING, MSG2]}) == ("b", "content", "response_has_no_id")


def test_no_tail_when_the_last_item_is_not_model_authored() -> None:
    # The trailing model-authored run is empty, so only the full target can match.
    records = conversation_rows(continuation_fp=None)
    response = {"output": [FC1, FCO1, MSG2, REASONING]}
    assert resolve_terminal(records, response) == (None, None, "response_has_no_id,no_content_match")


def test_content_ignores_rows_of_another_fingerprint_version() -> None:
    records = conversation_rows(fingerprint_version=2)
    assert resolve_terminal(records, TRAJECTORY) == (None, None, "response_id_no_match,no_content_match")


def test_content_ignores_non_dict_output_items() -> None:
    response = {"output": ["junk", 3, REASONING, MSG2]}
    assert resolve_terminal(conversation_rows(continuation_fp=None), response).model_call_id == "b"


def test_content_identical_retries_collapse() -> None:
    fingerprint = assistant_fingerprint([MSG2])
    records = [
        row("a"),
        row("b2", "a", same_as="b", output_fp=fingerprint),
        row("b1", "a", same_as="b", output_fp=fingerprint),
    ]
    assert resolve_terminal(records, {"output": [MSG2]}) == ("b1", "content", "response_has_no_id")


def test_content_ambiguous() -> None:
    fingerprint = assistant_fingerprint([MSG2])
    records = [row("a"), row("b", "a", output_fp=fingerprint), row("c", "a", output_fp=fingerprint)]
    assert resolve_terminal(records, {"output": [MSG2]}) == (None, None, "response_has_no_id,content_ambiguous")


@pytest.mark.parametrize(
    ("output", "reason"),
    [
        (None, "response_has_no_output"),
        ([], "response_has_no_output"),
        ("text", "response_has_no_output"),
        ([USER, REASONING], "no_model_authored_output"),
        ([{"role": "assistant", "content": 5}], "response_output_unfingerprintable"),
        ([{"role": "assistant", "content": [{"no": "type"}]}], "response_output_unfingerprintable"),
    ],
)
def test_content_failures(output: Any, reason: str) -> None:
    outcome = resolve_terminal(conversation_rows(), {"id": "x", "output": output})
    assert outcome == (None, None, f"response_id_no_match,{reason}")


def test_disagreement_between_response_id_and_content() -> None:
    response = {"id": "resp-a", "output": TRAJECTORY["output"]}
    outcome = resolve_terminal(conversation_rows(), response)
    assert outcome == (None, "response_id", "witness_disagreement[response_id=a;content=b]")


def test_disagreement_with_a_declaration() -> None:
    response = {"id": "resp-b", "output": TRAJECTORY["output"]}
    outcome = resolve_terminal(conversation_rows(), response, declared_response_id="resp-a")
    assert outcome == (None, "declared", "witness_disagreement[declared=a;response_id=b;content=b]")


def test_corroboration_by_every_witness() -> None:
    response = {"id": "resp-b", "output": TRAJECTORY["output"]}
    outcome = resolve_terminal(conversation_rows(), response, declared_response_id="resp-b")
    assert outcome == ("b", "declared", "corroborated_by=response_id+content")


def test_corroboration_keeps_the_trail() -> None:
    outcome = resolve_terminal(conversation_rows(), {"id": "resp-b"}, declared_response_id="resp-b")
    assert outcome == ("b", "declared", "response_has_no_output,corroborated_by=response_id")


def test_witnesses_naming_identical_retries_agree() -> None:
    fingerprint = assistant_fingerprint([MSG2])
    records = [
        row("a"),
        row("b2", "a", same_as="b", response_id="resp-b2"),
        row("b1", "a", same_as="b", output_fp=fingerprint),
    ]
    outcome = resolve_terminal(records, {"id": "resp-b2", "output": [MSG2]})
    assert outcome == ("b1", "response_id", "corroborated_by=content")


def test_no_witness_on_empty_manifest() -> None:
    assert resolve_terminal([], TRAJECTORY) == (None, None, "response_id_no_match,no_content_match")
    assert resolve_terminal([], None, declared_response_id="x") == (None, "declared", "declared_terminal_not_captured")


def test_resolver_never_raises_on_hostile_output() -> None:
    nested: list[Any] = []
    for _ in range(5000):
        nested = [nested]
    response = {"id": "x", "output": [{"role": "assistant", "content": [{"type": "blob", "v": nested}]}]}
    outcome = resolve_terminal(conversation_rows(), response)
    assert outcome == (None, None, "response_id_no_match,response_output_unfingerprintable")
