"""The drift check of ``complete_call`` (contract §5.5 step 2): an engine prompt that does not begin with the
gate-authorized prefix is a capture failure, never a staged record, and its one log line names the first token
index that differs and both ids (docs/vllm.md, "drift"). The sequence cache never stands in for that check: a
prompt that begins with the parent's remembered sequence still has to begin with the authorized prefix."""

from __future__ import annotations

import logging

import pytest

from tests.helpers.capture import (
    ROOT_GEN,
    ROOT_KWARGS,
    ROOT_PROMPT,
    RecordingSink,
    child_admission,
    expected_failed,
    make_capture,
    root_admission,
)

DRIFT = (
    "capture failed for rollout rollout-1 call c2: record build failed: prompt drifts from the gate-authorized prefix"
)


def _capture_messages(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [record.getMessage() for record in caplog.records if record.name == "worker.capture"]


@pytest.mark.parametrize(
    ("prompt", "where"),
    [
        ([10, 99, 12, 20], "at token index 1: expected id 11, received id 99"),
        ([10, 11, 77, 12], "at token index 2: expected id 12, received id 77"),
        ([10, 11], "at token index 2: expected id 12, received nothing (the prompt has 2 ids)"),
    ],
    ids=["an-id-differs", "the-last-id-differs", "the-prompt-is-shorter"],
)
def test_a_drifting_prompt_fails_the_call_and_logs_the_first_differing_index_and_both_ids(
    prompt: list[int], where: str, caplog: pytest.LogCaptureFixture
) -> None:
    sink = RecordingSink()
    capture = make_capture(sink)
    root = capture.complete_call(capture.begin_call(root_admission()), **ROOT_KWARGS)
    admission = child_admission(root, ROOT_PROMPT + ROOT_GEN, "c2")
    with caplog.at_level(logging.WARNING, logger="worker.capture"):
        coords = capture.complete_call(
            capture.begin_call(admission), prompt_token_ids=prompt, generated_token_ids=[1], generated_logprobs=[-1.0]
        )
    assert coords.model_dump() == expected_failed(admission, 7)
    assert [record.model_call_id for record in sink.records] == ["c1"]
    assert _capture_messages(caplog) == [f"{DRIFT} {where}"]


def test_a_prompt_the_sequence_cache_holds_is_still_checked_against_the_authorized_prefix(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The capture remembers its root's staged sequence ``[10, 11, 12]``; the gate authorized ``[10, 11, 13]``
    for the child (inline). A prompt that begins with the remembered sequence drifts from the authorized one."""
    sink = RecordingSink()
    capture = make_capture(sink)
    root = capture.complete_call(capture.begin_call(root_admission()), **ROOT_KWARGS)
    admission = child_admission(root, [10, 11, 13], "c2")
    with caplog.at_level(logging.WARNING, logger="worker.capture"):
        coords = capture.complete_call(
            capture.begin_call(admission),
            prompt_token_ids=[*ROOT_PROMPT, *ROOT_GEN, 20],
            generated_token_ids=[21],
            generated_logprobs=[-0.5],
        )
    assert coords.model_dump() == expected_failed(admission, 7)
    assert [record.model_call_id for record in sink.records] == ["c1"]
    assert _capture_messages(caplog) == [f"{DRIFT} at token index 2: expected id 13, received id 12"]
