"""The training/inference mismatch report (sink.trainer.statistics.mismatch_report): per-token differences, their
max and mean, the fraction over a threshold and the KL estimators k1, k2, k3, policy tokens apart from the tokens
the policy mask leaves out; checked against the definitions written out token by token."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from sink.contract.packed import PackedSnapshot
from sink.contract.records import RolloutReceipt, StagedCallSnapshot
from sink.errors import BatchInputError
from sink.trainer.row import LinearizedRow
from sink.trainer.statistics import MismatchStats, mismatch_report
from sink.trainer.verify import verify_decoded_and_linearize
from tests.helpers.codec import SETTINGS
from tests.helpers.e2e import call_record_of
from tests.helpers.rows import verified_pulled
from tests.helpers.sampling import sampling_extras
from tests.helpers.staging import record_of_tokens


def _row(extras: list[dict[str, Any] | None], lengths: tuple[int, ...] = (8, 6, 7)) -> LinearizedRow:
    row = verified_pulled("r1", lengths=lengths, extras=extras).row
    assert row is not None
    return row


def expected_stats(differences: list[float], threshold: float) -> tuple[float, ...]:
    """The figures by their definitions, one token at a time."""
    n = len(differences)
    return (
        max(abs(r) for r in differences),
        math.fsum(abs(r) for r in differences) / n,
        sum(abs(r) > threshold for r in differences) / n,
        math.fsum(-r for r in differences) / n,
        math.fsum(r * r / 2 for r in differences) / n,
        math.fsum(math.expm1(r) - r for r in differences) / n,
    )


def figures(stats: MismatchStats) -> tuple[float, ...]:
    return (
        stats.max_abs_diff,
        stats.mean_abs_diff,
        stats.fraction_over,
        stats.kl_k1,
        stats.kl_k2,
        stats.kl_k3,
    )


EXTRAS_CHOICES = [None, sampling_extras(), sampling_extras(logit_bias=True), sampling_extras(min_tokens=3)]


@SETTINGS
@given(
    st.lists(st.sampled_from(range(len(EXTRAS_CHOICES))), min_size=3, max_size=3),
    st.lists(st.floats(-3.0, 3.0), min_size=21, max_size=21),
    st.floats(0.0, 2.0),
)
def test_the_report_follows_its_definitions(choices: list[int], shifts: list[float], threshold: float) -> None:
    row = _row([EXTRAS_CHOICES[choice] for choice in choices])
    staged = list(row.logprobs)
    generated = [mask == 1.0 for mask in row.token_mask]
    # The trainer's values: prompt positions are never read (NaN there is accepted).
    trainer = [staged[i] + shifts[i] if generated[i] else math.nan for i in range(len(staged))]
    report = mismatch_report(row, trainer, threshold=threshold)
    policy = row.policy_mask().tolist()
    r = [trainer[i] - staged[i] if generated[i] else 0.0 for i in range(len(staged))]
    assert report.difference.dtype == np.float64 and report.difference.tolist() == pytest.approx(r, abs=1e-12)
    assert report.policy_mask.tolist() == policy and report.threshold == threshold
    on_policy = [r[i] for i in range(len(r)) if policy[i]]
    flagged = [r[i] for i in range(len(r)) if generated[i] and not policy[i]]
    assert (report.policy.tokens, report.flagged.tokens) == (len(on_policy), len(flagged))
    for stats, values in ((report.policy, on_policy), (report.flagged, flagged)):
        if values:
            assert figures(stats) == pytest.approx(expected_stats(values, threshold), rel=1e-9, abs=1e-12)
        else:
            assert all(math.isnan(value) for value in figures(stats))
    assert report.provenance_known == (None not in [EXTRAS_CHOICES[choice] for choice in choices])


def test_equal_log_probs_give_zero_everywhere_and_flagged_tokens_stay_apart() -> None:
    row = _row([sampling_extras(), sampling_extras(constraint="structured_outputs"), sampling_extras()])
    staged = np.array(row.logprobs, dtype=np.float64)
    report = mismatch_report(row, staged)
    assert report.policy.tokens == 5 + 5 and report.flagged.tokens == 4
    assert figures(report.policy) == (0.0,) * 6 and figures(report.flagged) == (0.0,) * 6
    # A far-off recompute on the constrained call only shows in `flagged`.
    constrained = slice(8, 14)
    trainer = staged.copy()
    trainer[constrained] -= 10.0
    report = mismatch_report(row, trainer, threshold=0.5)
    assert figures(report.policy) == (0.0,) * 6
    assert report.flagged.max_abs_diff == pytest.approx(10.0) and report.flagged.fraction_over == 1.0
    assert report.flagged.kl_k1 == pytest.approx(10.0)


@pytest.mark.parametrize(
    ("row_of", "values", "threshold", "message"),
    [
        (lambda row: "row", lambda row: [0.0] * 21, 0.1, "takes a LinearizedRow"),
        (lambda row: row, lambda row: [0.0] * 20, 0.1, "the row's 21 values"),
        (lambda row: row, lambda row: [[0.0] * 21], 0.1, "the row's 21 values"),
        (lambda row: row, lambda row: ["x"] * 21, 0.1, "must be numbers"),
        (lambda row: row, lambda row: [0.0] * 20 + [math.inf], 0.1, "finite at every generated position"),
        (lambda row: row, lambda row: [0.0] * 21, -0.1, "threshold"),
        (lambda row: row, lambda row: [0.0] * 21, math.nan, "threshold"),
        (lambda row: row, lambda row: [0.0] * 21, True, "threshold"),
    ],
)
def test_bad_input_is_refused_with_a_precise_error(row_of: Any, values: Any, threshold: Any, message: str) -> None:
    row = _row([None, None, None])
    with pytest.raises(BatchInputError, match=message):
        mismatch_report(row_of(row), values(row), threshold=threshold)


def test_a_packed_row_is_compared_with_its_float32_values_exactly() -> None:
    staged = [-0.5, -1.25, float(np.float32(-1 / 3)), -7.0]  # float32 values: the row stays packed
    root = record_of_tokens("r1", "c0", [5, 6, 7, 8, 9], 1, staged, extras=sampling_extras())
    receipt = RolloutReceipt(
        rollout_id="r1",
        terminal_model_call_id="c0",
        manifest=[call_record_of(root, admitted_at=1000.0)],
        terminal_selection="declared",
    )
    snapshot = PackedSnapshot.of(StagedCallSnapshot.model_validate({**root.model_dump(), "extras": root.extras}))
    row = verify_decoded_and_linearize(receipt, [snapshot])
    assert row.columns.packed_parts is not None and row.provenance_known
    report = mismatch_report(row, [math.nan, -0.5, -1.0, -1 / 3, -7.5], threshold=0.1)
    assert report.difference.tolist() == [0.0, 0.0, 0.25, -1 / 3 - float(np.float32(-1 / 3)), -0.5]
    assert report.policy.tokens == 4 and report.policy.fraction_over == 0.5
