"""Trainer-side verification and linearization (contract §8): pure, no Redis."""

from __future__ import annotations

import math
import pickle
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import FrozenInstanceError, dataclass
from typing import TYPE_CHECKING, Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sink.contract.codec import decode_packed_record, encode_record
from sink.contract.digest import EMPTY_EXTRAS_DIGEST, compute_chain_hash, compute_extras_digest, hash_token_ids
from sink.contract.record_form import unchanged_since_validation
from sink.contract.record_schema import IDENTITY_FIELDS
from sink.contract.records import (
    CallRecord,
    CaptureMode,
    RolloutReceipt,
    StagedCallBaseSnapshot,
    StagedCallRecord,
    StagedCallSnapshot,
)
from sink.errors import RebuildError, ReceiptVerificationError, StagingError
from sink.trainer.verify import (
    ExtrasCommitment,
    LinearizedRow,
    LinkSpan,
    WeightVersionSpan,
    linearize,
    verify_and_linearize,
)

if TYPE_CHECKING:
    import numpy.typing as npt

# --- builders -----------------------------------------------------------------------


@dataclass(frozen=True)
class Call:
    snapshot: StagedCallSnapshot
    record: CallRecord
    full_ids: list[int]


def make_call(
    call_id: str,
    parent: Call | None,
    ids: list[int],
    masks: list[float],
    logprobs: list[float],
    weight_version: int = 1,
    *,
    owner: str = "r1",
    capture_key: str | None = None,
    parent_id: str | None = None,
    prev_len: int | None = None,
    chain_hash: str | None = None,
    cumulative_hash: str | None = None,
    extras: dict[str, Any] | None = None,
) -> Call:
    """Stage one call through ``from_components`` and build its matching manifest row.

    Hashes default to the correct values for *parent*; overrides let a test
    build a fully valid snapshot that is wrong only in one respect.
    """
    parent_id = parent_id if parent_id is not None else (parent.record.model_call_id if parent else None)
    prev = prev_len if prev_len is not None else (parent.record.cum_len if parent else 0)
    full_ids = (parent.full_ids if parent else []) + ids
    chain = chain_hash or compute_chain_hash(parent.record.chain_hash if parent else None, ids)
    cumulative = cumulative_hash or hash_token_ids(full_ids)
    mode: CaptureMode = "text" if parent_id is None else "token_in"
    snapshot = StagedCallSnapshot.from_components(
        owner,
        call_id,
        parent_id,
        mode,
        prev,
        len(ids),
        prev + len(ids),
        weight_version,
        ids,
        masks,
        logprobs,
        extras,
        compute_extras_digest(extras),
        chain,
        cumulative,
    )
    record = CallRecord(
        model_call_id=call_id,
        parent_call_id=parent_id,
        prev_len=prev,
        delta_len=len(ids),
        cum_len=prev + len(ids),
        weight_version=weight_version,
        digest=snapshot.digest,
        extras_digest=snapshot.extras_digest,
        staging_key=snapshot.staging_key,
        mode=mode,
        chain_hash=chain,
        cumulative_hash=cumulative,
        response_id=f"resp-{call_id}",
        capture_key=capture_key,
    )
    return Call(snapshot, record, full_ids)


def make_receipt(calls: Sequence[Call], terminal: str, rollout_id: str = "r1") -> RolloutReceipt:
    return RolloutReceipt(
        rollout_id=rollout_id,
        manifest=[call.record for call in calls],
        terminal_model_call_id=terminal,
        terminal_selection="declared",
    )


def worked_example() -> dict[str, Call]:
    """Contract §8.3: rollout r1, manifest root, main, side; terminal main."""
    root = make_call("root", None, [10, 11, 12], [0.0, 0.0, 1.0], [0.0, 0.0, -0.1], 3)
    main = make_call("main", root, [20, 21], [0.0, 1.0], [0.0, -0.2], 4)
    side = make_call("side", root, [30, 31], [0.0, 1.0], [0.0, -0.5], 99)
    return {"root": root, "main": main, "side": side}


Case = tuple[RolloutReceipt, list[Any]]


def example_case(**replace: Call) -> Case:
    calls = {**worked_example(), **replace}
    ordered = [calls["root"], calls["main"], calls["side"]]
    return make_receipt(ordered, "main"), [call.snapshot for call in ordered]


def expect_failure(case: Case, code: str) -> ReceiptVerificationError:
    with pytest.raises(ReceiptVerificationError) as info:
        verify_and_linearize(*case)
    assert info.value.code == code, str(info.value)
    return info.value


# --- the worked example (§8.3) ----------------------------------------------------

EXAMPLE_DIGESTS = {
    "root": (
        "14c5e45c969e9b8b821f302201ad9d9b6b4f7427ac18dab2cb150af8e3acdd65",
        "21c8e66807865ae05ca6f5bca40bd4a1399a66c23fb9848216a23c2ab9d9858f",
        "654f4806694c45a7637bb96cbfe0beb51f82d481f20202f7f7997aca27f0f7bb",
    ),
    "main": (
        "2d5351859ece5a943589e66aeb89296664dae4b8484f106e6ff9060d7635e62a",
        "d44975e73aacb27985764338375207755e90423680439a3b6e4046c7d9dded07",
        "685728ed4a9104f5a12d40d1adbb645a0485fcb0f87e1d9223ae4e48eff3cfcb",
    ),
    "side": (
        "91af6c7a5cbbfa8a468e62d8fdc4d28c71881b1491600d6e77ed6e847d3d061d",
        "d1b40fe139cb31812fe8551ca534701010d8910ea21e4591f34ad3d73ad748c6",
        "e376e640b45b736c42be309ecd8145efba378972ef2bcab766c02e6e948e67a1",
    ),
}


@pytest.mark.parametrize("call_id", sorted(EXAMPLE_DIGESTS))
def test_worked_example_digests(call_id: str) -> None:
    snapshot = worked_example()[call_id].snapshot
    assert (snapshot.chain_hash, snapshot.cumulative_hash, snapshot.digest) == EXAMPLE_DIGESTS[call_id]


def test_worked_example_row() -> None:
    row = verify_and_linearize(*example_case())
    assert row.rollout_id == "r1"
    assert row.token_ids == (10, 11, 12, 20, 21)
    assert row.token_mask == (0.0, 0.0, 1.0, 0.0, 1.0)
    assert row.logprobs == (0.0, 0.0, -0.1, 0.0, -0.2)
    assert row.model_call_ids == row.call_ids == ("root", "main")
    assert row.prompt_len == 2
    assert row.weight_versions == (3, 4)
    assert row.weight_version_spans == (
        WeightVersionSpan("root", 0, 3, 3),
        WeightVersionSpan("main", 3, 5, 4),
    )
    assert row.link_spans == (("root", 2, 1), ("main", 1, 1))
    assert all(isinstance(link, LinkSpan) for link in row.link_spans)
    assert row.extras_commitments == (
        ExtrasCommitment("root", 1, EMPTY_EXTRAS_DIGEST),
        ExtrasCommitment("main", 1, EMPTY_EXTRAS_DIGEST),
    )
    assert 30 not in row.token_ids  # side is verified but ignored


def test_side_branch_is_verified_but_only_terminal_cumulative_hash_is_checked() -> None:
    root = worked_example()["root"]
    corrupt_side = make_call("side", root, [30, 31], [0.0, 1.0], [0.0, -0.5], 99, prev_len=2)
    expect_failure(example_case(side=corrupt_side), "parent_length_mismatch")
    # The side's cumulative hash is covered by nothing but its own digest.
    odd_side = make_call("side", root, [30, 31], [0.0, 1.0], [0.0, -0.5], 99, cumulative_hash="e" * 64)
    assert verify_and_linearize(*example_case(side=odd_side)).token_ids == (10, 11, 12, 20, 21)


def test_linearize_wrapper_matches_verify() -> None:
    receipt, snapshots = example_case()
    row = linearize("r1", snapshots, receipt.manifest, terminal_hint="main")
    assert row == verify_and_linearize(receipt, snapshots)
    side_row = linearize("r1", snapshots, receipt.manifest, terminal_hint="side")
    assert side_row.token_ids == (10, 11, 12, 30, 31)
    assert side_row.weight_versions == (3, 99)


# --- the mutation table -------------------------------------------------------------

REBUILD_CODES = {
    "missing_parent",
    "parent_length_mismatch",
    "lineage_cycle",
    "missing_terminal",
    "chain_hash_mismatch",
    "invalid_mask_order",
    "empty_generation",
    "empty_training_row",
    "cumulative_hash_mismatch",
}


def snapshot_field(call_id: str, **update: Any) -> Callable[[], Case]:
    def build() -> Case:
        receipt, snapshots = example_case()
        position = [s.model_call_id for s in snapshots].index(call_id)
        snapshots[position] = snapshots[position].model_copy(update=update)
        return receipt, snapshots

    return build


def record_field(call_id: str, **update: Any) -> Callable[[], Case]:
    def build() -> Case:
        receipt, snapshots = example_case()
        manifest = [r.model_copy(update=update) if r.model_call_id == call_id else r for r in receipt.manifest]
        return receipt.model_copy(update={"manifest": manifest}), snapshots

    return build


def receipt_field(**update: Any) -> Callable[[], Case]:
    def build() -> Case:
        receipt, snapshots = example_case()
        return receipt.model_copy(update=update), snapshots

    return build


def snapshots_as(order: Sequence[str]) -> Callable[[], Case]:
    def build() -> Case:
        receipt, _ = example_case()
        calls = worked_example()
        return receipt, [calls[c].snapshot for c in order]

    return build


def restaged(*, keep_record: bool = False, **kwargs: Any) -> Callable[[], Case]:
    """Replace the main call by a fully valid call built with the given overrides.

    With *keep_record* only the snapshot is replaced; the manifest keeps the original row.
    """

    def build() -> Case:
        root = worked_example()["root"]
        spec: dict[str, Any] = {"ids": [20, 21], "masks": [0.0, 1.0], "logprobs": [0.0, -0.2], "weight_version": 4}
        spec.update(kwargs)
        receipt, snapshots = example_case(main=make_call("main", root, **spec))
        if keep_record:
            receipt = example_case()[0]
        return receipt, snapshots

    return build


def corrupt_digest_case() -> Case:
    receipt, snapshots = example_case()
    bogus = "c" * 64
    data = snapshots[1].model_dump()
    data["digest"] = bogus
    snapshots[1] = StagedCallSnapshot.model_construct(**data)
    manifest = [r.model_copy(update={"digest": bogus}) if r.model_call_id == "main" else r for r in receipt.manifest]
    return receipt.model_copy(update={"manifest": manifest}), snapshots


def duplicate_staging_key_case() -> Case:
    receipt, snapshots = example_case()
    main_key = receipt.manifest[1].staging_key
    manifest = [*receipt.manifest[:2], receipt.manifest[2].model_copy(update={"staging_key": main_key})]
    return receipt.model_copy(update={"manifest": manifest}), snapshots


def orphan_case() -> Case:
    calls = worked_example()
    ghost = make_call("ghost", calls["root"], [40], [1.0], [-0.3])
    orphan = make_call("orphan", ghost, [50], [1.0], [-0.4])
    ordered = [calls["root"], calls["main"], calls["side"], orphan]
    return make_receipt(ordered, "main"), [c.snapshot for c in ordered]


def cycle_case() -> Case:
    calls = worked_example()
    # a <- b <- a: each row is valid alone, and b's length link holds; the walk from b revisits b.
    a = make_call("a", None, [1, 2], [1.0, 1.0], [-0.1, -0.2], parent_id="b", prev_len=3)
    b = make_call("b", None, [3], [1.0], [-0.3], parent_id="a", prev_len=5)
    ordered = [calls["root"], calls["main"], b, a]
    return make_receipt(ordered, "main"), [c.snapshot for c in ordered]


def bad_mask_order_case() -> Case:
    root = make_call("root", None, [10, 11, 12], [1.0, 0.0, 1.0], [-0.1, 0.0, -0.3], 3)
    main = make_call("main", root, [20, 21], [0.0, 1.0], [0.0, -0.2], 4)
    side = make_call("side", root, [30, 31], [0.0, 1.0], [0.0, -0.5], 99)
    return example_case(root=root, main=main, side=side)


def poisoned(failure_reason: str | None) -> Callable[[], Case]:
    def build() -> Case:
        receipt, snapshots = example_case()
        data = receipt.model_dump()
        data.update(capture_poisoned=True, failure_reason=failure_reason)
        return RolloutReceipt.model_validate(data), snapshots

    return build


MUTATIONS: dict[str, tuple[Callable[[], Case], str]] = {
    # step 2: receipt versions (only reachable past validation via model_copy)
    "receipt_schema_version": (receipt_field(schema_version=3), "unsupported_schema"),
    "receipt_digest_version": (receipt_field(digest_version=1), "unsupported_digest"),
    "receipt_extras_version": (receipt_field(extras_digest_version=2), "unsupported_extras_digest"),
    # steps 3-5
    "failed_and_poisoned": (poisoned("worker_capture_failed"), "rollout_failed"),
    "failed_unpoisoned_constructed": (receipt_field(failure_reason="worker_capture_failed"), "rollout_failed"),
    "poisoned": (poisoned(None), "capture_poisoned"),
    "empty_manifest": (receipt_field(manifest=[]), "empty_manifest"),
    # step 6
    "duplicate_manifest_id": (
        lambda: (example_case()[0].model_copy(update={"manifest": [example_case()[0].manifest[0]] * 2}), []),
        "duplicate_manifest_row",
    ),
    "duplicate_staging_key": (duplicate_staging_key_case, "duplicate_staging_key"),
    # step 7
    "snapshot_missing": (snapshots_as(["root", "main"]), "row_count_mismatch"),
    "snapshot_extra": (snapshots_as(["root", "main", "side", "side"]), "row_count_mismatch"),
    # step 8b-8e
    "snapshot_duplicated": (snapshots_as(["root", "root", "side"]), "duplicate_snapshot"),
    "snapshot_reordered": (snapshots_as(["main", "root", "side"]), "snapshot_order_mismatch"),
    "snapshot_foreign_id": (snapshot_field("side", model_call_id="ghost"), "snapshot_identity_mismatch"),
    "snapshot_wrong_rollout": (restaged(owner="r2", keep_record=True), "wrong_rollout"),
    # step 8f, every field on the snapshot (model_call_id is caught by 8c first)
    "f_model_call_id": (snapshot_field("main", model_call_id="other"), "snapshot_identity_mismatch"),
    "f_parent_call_id": (snapshot_field("main", parent_call_id="side"), "wrong_parent_call_id"),
    "f_mode": (snapshot_field("main", mode="text"), "wrong_mode"),
    "f_prev_len": (snapshot_field("main", prev_len=2), "wrong_prev_len"),
    "f_delta_len": (snapshot_field("main", delta_len=3), "wrong_delta_len"),
    "f_cum_len": (snapshot_field("main", cum_len=6), "wrong_cum_len"),
    "f_weight_version": (snapshot_field("main", weight_version=5), "wrong_weight_version"),
    "f_digest": (snapshot_field("main", digest="f" * 64), "wrong_digest"),
    "f_extras_digest": (snapshot_field("main", extras_digest=compute_extras_digest({})), "wrong_extras_digest"),
    "f_chain_hash": (snapshot_field("main", chain_hash="a" * 64), "wrong_chain_hash"),
    "f_cumulative_hash": (snapshot_field("main", cumulative_hash="b" * 64), "wrong_cumulative_hash"),
    "f_first_mismatch_wins": (restaged(weight_version=5, keep_record=True), "wrong_weight_version"),  # digest too
    "f_record_side": (record_field("side", cum_len=6, delta_len=3), "wrong_delta_len"),
    # step 8g
    "g_snapshot_schema": (snapshot_field("main", schema_version=3), "wrong_schema_version"),
    "g_record_digest_version": (record_field("root", digest_version=3), "wrong_digest_version"),
    "g_snapshot_extras_version": (snapshot_field("side", extras_digest_version=2), "wrong_extras_digest_version"),
    # step 8h
    "corrupt_digest_constructed": (corrupt_digest_case, "corrupt_digest"),
    "corrupt_digest_tampered_ids": (snapshot_field("main", token_ids_delta=[20, 22]), "corrupt_digest"),
    "invalid_snapshot_mask": (snapshot_field("main", token_mask_delta=[0.0, 0.5]), "invalid_snapshot"),
    "invalid_snapshot_lengths": (snapshot_field("side", generation_log_probs_delta=[0.0]), "invalid_snapshot"),
    "invalid_snapshot_int_mask": (snapshot_field("root", token_mask_delta=[0, 0, 1]), "invalid_snapshot"),
    # step 9
    "parent_length_mismatch": (restaged(prev_len=2), "parent_length_mismatch"),
    "missing_parent": (orphan_case, "missing_parent"),
    "lineage_cycle": (cycle_case, "lineage_cycle"),
    # step 10
    "terminal_none": (receipt_field(terminal_model_call_id=None), "missing_terminal"),
    "terminal_absent": (receipt_field(terminal_model_call_id="ghost"), "missing_terminal"),
    # step 11
    "chain_hash_mismatch": (restaged(chain_hash=compute_chain_hash(None, [20, 21])), "chain_hash_mismatch"),
    "invalid_mask_order": (bad_mask_order_case, "invalid_mask_order"),
    "empty_generation": (restaged(masks=[0.0, 0.0], logprobs=[0.0, 0.0]), "empty_generation"),
    # step 13
    "cumulative_hash_mismatch": (restaged(cumulative_hash=hash_token_ids([20, 21])), "cumulative_hash_mismatch"),
}


@pytest.mark.parametrize("name", sorted(MUTATIONS))
def test_mutation_table(name: str) -> None:
    build, code = MUTATIONS[name]
    error = expect_failure(build(), code)
    assert isinstance(error, RebuildError) == (code in REBUILD_CODES)
    assert str(error).startswith(f"{code}: ")


@pytest.mark.parametrize("name", sorted(MUTATIONS))
def test_mutation_table_through_the_trainers_packed_path(name: str) -> None:
    from sink.contract.packed import PackedSnapshot
    from sink.errors import CodecError
    from sink.trainer.verify import _verify_and_linearize

    build, code = MUTATIONS[name]
    receipt, snapshots = build()
    packed: list[Any] = []
    for snapshot in snapshots:
        try:
            packed.append(PackedSnapshot.of(snapshot) if isinstance(snapshot, StagedCallSnapshot) else snapshot)
        except CodecError:
            # The reader decodes before it verifies: only a snapshot that is no valid record on its own
            # is refused here (the reader then skips the rollout as corrupt_record).
            with pytest.raises((ValueError, TypeError)):
                StagedCallSnapshot.model_validate(snapshot.model_dump())
            return
    # The packed path reaches the public path's verdict on the models the packed snapshots verify as
    # (PackedSnapshot.of re-validates a snapshot changed since validation, which may normalize it the way
    # the model rules allow: an int mask [0, 0, 1] becomes [0.0, 0.0, 1.0]).
    models = [p.to_snapshot() if isinstance(p, PackedSnapshot) else p for p in packed]
    expected = _verdict(lambda: verify_and_linearize(receipt, models))
    assert _verdict(lambda: _verify_and_linearize(receipt, packed, use_cached_columns=True)) == expected
    if all(unchanged_since_validation(s) for s in snapshots if isinstance(s, StagedCallSnapshot)):
        assert expected == code  # nothing was normalized: the table's own code


def _verdict(verify: Callable[[], Any]) -> str | None:
    try:
        verify()
    except ReceiptVerificationError as exc:
        return exc.code
    return None


def test_unmutated_cases_pass() -> None:
    # Guards the table: the builders produce a valid case until mutated.
    assert verify_and_linearize(*restaged()()).token_ids == (10, 11, 12, 20, 21)
    assert verify_and_linearize(*snapshots_as(["root", "main", "side"])()).prompt_len == 2


# --- ownership across attempts (CallRecord.capture_key) -----------------------------


def test_rows_owned_by_different_attempts() -> None:
    root = make_call("root", None, [10, 11, 12], [0.0, 0.0, 1.0], [0.0, 0.0, -0.1], owner="r1-a0", capture_key="r1-a0")
    main = make_call("main", root, [20, 21], [0.0, 1.0], [0.0, -0.2], owner="r1-a1")
    row = verify_and_linearize(make_receipt([root, main], "main", rollout_id="r1-a1"), [root.snapshot, main.snapshot])
    assert row.rollout_id == "r1-a1"
    assert row.token_ids == (10, 11, 12, 20, 21)


def test_capture_key_overrides_receipt_rollout_id() -> None:
    # The snapshot was staged under the receipt's id, but the row says another attempt owns it.
    root = make_call("root", None, [10, 11, 12], [0.0, 0.0, 1.0], [0.0, 0.0, -0.1], owner="r1", capture_key="r1-a0")
    error = expect_failure((make_receipt([root], "root"), [root.snapshot]), "wrong_rollout")
    assert "'r1-a0'" in error.detail


# --- determinism, extras, error type --------------------------------------------------


def test_deterministic_and_retry_safe() -> None:
    receipt, snapshots = example_case()
    first = verify_and_linearize(receipt, snapshots)
    again = verify_and_linearize(receipt, snapshots)
    reloaded = verify_and_linearize(
        RolloutReceipt.model_validate_json(receipt.model_dump_json()),
        [StagedCallSnapshot.model_validate_json(s.model_dump_json()) for s in snapshots],
    )
    assert first == again == reloaded
    assert hash(first) == hash(reloaded)
    bad = snapshots_as(["main", "root", "side"])()
    codes = set()
    for _ in range(2):
        with pytest.raises(ReceiptVerificationError) as info:
            verify_and_linearize(*bad)
        codes.add(info.value.code)
    assert codes == {"snapshot_order_mismatch"}


def test_base_snapshots_and_unread_extras() -> None:
    extras = {"routed_experts": [[[1, 2]], [[3, 4]]]}
    root = make_call("root", None, [10, 11], [0.0, 1.0], [0.0, -0.5], extras=extras)
    base = StagedCallBaseSnapshot.model_validate(root.snapshot.model_dump(exclude={"extras"}))
    assert verify_and_linearize(make_receipt([root], "root"), [base]).extras_commitments == (
        ExtrasCommitment("root", 1, compute_extras_digest(extras)),
    )
    # Extras are never read: a payload that no longer matches its digest does not matter here.
    data = root.snapshot.model_dump()
    data["extras"] = {"routed_experts": "garbage"}
    unread = StagedCallSnapshot.model_construct(**data)
    assert verify_and_linearize(make_receipt([root], "root"), [unread]).token_ids == (10, 11)


def test_error_format_and_types() -> None:
    error = ReceiptVerificationError("wrong_digest", "position 1: x != y")
    assert str(error) == "wrong_digest: position 1: x != y"
    assert (error.code, error.detail) == ("wrong_digest", "position 1: x != y")
    assert isinstance(error, ValueError) and isinstance(error, StagingError)
    rebuild = RebuildError("lineage_cycle", "a -> b -> a")
    assert isinstance(rebuild, ReceiptVerificationError)
    for original in (error, rebuild):
        copy = pickle.loads(pickle.dumps(original))
        assert type(copy) is type(original)
        assert (copy.code, copy.detail, str(copy)) == (original.code, original.detail, str(original))


def test_minus_zero_is_preserved() -> None:
    root = make_call("root", None, [10, 11, 12], [-0.0, 0.0, 1.0], [-0.0, 0.0, -0.1])
    row = verify_and_linearize(make_receipt([root], "root"), [root.snapshot])
    assert math.copysign(1.0, row.token_mask[0]) == -1.0
    assert math.copysign(1.0, row.logprobs[0]) == -1.0
    assert row.prompt_len == 2
    assert (
        root.snapshot.digest != make_call("root", None, [10, 11, 12], [0.0, 0.0, 1.0], [0.0, 0.0, -0.1]).snapshot.digest
    )


def test_row_is_frozen_and_repr_is_short() -> None:
    row = verify_and_linearize(*example_case())
    with pytest.raises(FrozenInstanceError):
        row.prompt_len = 0  # type: ignore[misc]
    assert repr(row) == (
        "LinearizedRow(rollout_id='r1', tokens=5, prompt_len=2, model_call_ids=('root', 'main'), weight_versions=(3, 4))"
    )
    assert isinstance(row, LinearizedRow)


@pytest.mark.parametrize(
    ("receipt", "snapshots"),
    [
        pytest.param(lambda: example_case()[0].model_dump(), lambda: example_case()[1], id="receipt_dict"),
        pytest.param(lambda: example_case()[0], lambda: None, id="snapshots_none"),
        pytest.param(lambda: example_case()[0], lambda: iter(example_case()[1]), id="snapshots_iterator"),
        pytest.param(lambda: example_case()[0], lambda: "abc", id="snapshots_str"),
        pytest.param(lambda: example_case()[0], lambda: [s.model_dump() for s in example_case()[1]], id="element_dict"),
        pytest.param(lambda: example_case()[0], lambda: list(example_case()[0].manifest), id="element_record"),
    ],
)
def test_type_errors(receipt: Callable[[], Any], snapshots: Callable[[], Any]) -> None:
    with pytest.raises(TypeError):
        verify_and_linearize(receipt(), snapshots())


def linearize_code(*args: Any, **kwargs: Any) -> tuple[str, bool]:
    with pytest.raises(ReceiptVerificationError) as info:
        linearize(*args, **kwargs)
    return info.value.code, isinstance(info.value, RebuildError)


def test_linearize_wrapper_errors() -> None:
    receipt, snapshots = example_case()
    manifest = receipt.manifest
    assert linearize_code("r1", snapshots, manifest) == ("missing_terminal", True)
    assert linearize_code("r1", snapshots, manifest, terminal_hint="ghost") == ("missing_terminal", True)
    duplicated = [*manifest, manifest[0]]
    assert linearize_code("r1", snapshots, duplicated, terminal_hint="main") == ("duplicate_manifest_row", False)
    assert linearize_code("r1", [], [], terminal_hint="main") == ("empty_manifest", False)
    assert linearize_code("r2", snapshots, manifest, terminal_hint="main") == ("wrong_rollout", False)
    with pytest.raises(TypeError):
        linearize("r1", snapshots, iter(manifest), terminal_hint="main")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        linearize("r1", snapshots, [r.model_dump() for r in manifest], terminal_hint="main")  # type: ignore[misc]
    with pytest.raises(ValueError, match="non-empty"):
        linearize("", snapshots, manifest, terminal_hint="main")


# --- numpy columns ------------------------------------------------------------------------


def test_as_numpy_columns() -> None:
    np = pytest.importorskip("numpy")
    root = make_call("root", None, [10, 11, 12], [-0.0, 0.0, 1.0], [0.0, 0.0, -0.1], 3)
    main = make_call("main", root, [20, 2**40], [0.0, 1.0], [0.0, -0.2], 4)
    row = verify_and_linearize(make_receipt([root, main], "main"), [root.snapshot, main.snapshot])
    columns = row.as_numpy()
    assert columns.token_ids.dtype == np.int64 and columns.token_ids.tolist() == [10, 11, 12, 20, 2**40]
    assert columns.token_mask.dtype == np.float32 and columns.token_mask.tolist() == [0.0, 0.0, 1.0, 0.0, 1.0]
    assert bool(np.signbit(columns.token_mask[0])) and not bool(np.signbit(columns.token_mask[1]))
    assert columns.logprobs.dtype == np.float32
    assert columns.logprobs.tolist() == np.array(row.logprobs, dtype=np.float32).tolist()
    token_ids, _, _ = columns  # a NamedTuple unpacks
    token_ids[0] = 0
    assert row.as_numpy().token_ids[0] == 10  # fresh arrays every call


def test_as_numpy_without_numpy(monkeypatch: pytest.MonkeyPatch) -> None:
    row = verify_and_linearize(*example_case())
    monkeypatch.setitem(sys.modules, "numpy", None)
    with pytest.raises(ImportError, match=r"numpy, a default dependency"):
        row.as_numpy()


def test_module_import_does_not_import_numpy() -> None:
    code = "import sys, sink.trainer.verify, sink.errors; assert 'numpy' not in sys.modules, 'numpy imported'"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr


# --- property: random valid chains linearize to the concatenation of their deltas ---------

zero = st.sampled_from([0.0, -0.0])
delta_shape = st.tuples(st.integers(0, 4), st.integers(1, 4))  # (carry, generated)
logprob = st.floats(-30.0, 0.0, allow_nan=False, width=32)


@settings(max_examples=60, deadline=None)
@given(data=st.data(), shapes=st.lists(delta_shape, min_size=1, max_size=6))
def test_random_chains_linearize_to_concatenated_deltas(data: st.DataObject, shapes: list[tuple[int, int]]) -> None:
    calls: list[Call] = []
    expected_ids: list[int] = []
    expected_masks: list[float] = []
    expected_logprobs: list[float] = []
    for index, (carry, generated) in enumerate(shapes):
        ids = data.draw(st.lists(st.integers(0, 2**31), min_size=carry + generated, max_size=carry + generated))
        carry_masks = data.draw(st.lists(zero, min_size=carry, max_size=carry))
        carry_logprobs = data.draw(st.lists(zero, min_size=carry, max_size=carry))
        generated_logprobs = data.draw(st.lists(logprob, min_size=generated, max_size=generated))
        masks = carry_masks + [1.0] * generated
        logprobs = carry_logprobs + generated_logprobs
        weight = data.draw(st.integers(0, 1000))
        calls.append(make_call(f"c{index}", calls[-1] if calls else None, ids, masks, logprobs, weight))
        expected_ids += ids
        expected_masks += masks
        expected_logprobs += logprobs
    terminal = calls[-1].record.model_call_id
    if data.draw(st.booleans()):  # an abandoned side branch off a random call
        anchor = data.draw(st.sampled_from(calls))
        calls.append(make_call("side", anchor, [7], [1.0], [-1.0]))
    row = verify_and_linearize(make_receipt(calls, terminal), [c.snapshot for c in calls])
    assert row.token_ids == tuple(expected_ids)
    # Compare sign bits too: -0.0 must survive exactly.
    assert [(v, math.copysign(1.0, v)) for v in row.token_mask] == [(v, math.copysign(1.0, v)) for v in expected_masks]
    assert [(v, math.copysign(1.0, v)) for v in row.logprobs] == [(v, math.copysign(1.0, v)) for v in expected_logprobs]
    assert row.prompt_len == shapes[0][0]
    assert row.link_spans == tuple((f"c{i}", c, g) for i, (c, g) in enumerate(shapes))
    assert row.weight_version_spans[-1].end == len(expected_ids)
    assert [span.start for span in row.weight_version_spans[1:]] == [span.end for span in row.weight_version_spans[:-1]]
    assert row.model_call_ids == tuple(f"c{i}" for i in range(len(shapes)))


# --- the trainer's fast path over packed columns ------------------------------------------


def _decoded_chain() -> tuple[RolloutReceipt, list[Any]]:
    from sink.contract.codec import decode_record, encode_record
    from sink_tools.bench.workload import build_records

    records = build_records(1, 4, 300, tag="packed")
    snapshots = [decode_record(encode_record(r)) for r in records]
    manifest = [
        CallRecord(
            model_call_id=r.model_call_id,
            parent_call_id=r.parent_call_id,
            prev_len=r.prev_len,
            delta_len=r.delta_len,
            cum_len=r.cum_len,
            weight_version=r.weight_version,
            digest=r.digest,
            extras_digest=r.extras_digest,
            staging_key=r.staging_key,
            mode=r.mode,
            chain_hash=r.chain_hash,
            cumulative_hash=r.cumulative_hash,
            response_id=f"resp-{r.model_call_id}",
        )
        for r in records
    ]
    receipt = RolloutReceipt(
        rollout_id=records[0].rollout_id,
        manifest=manifest,
        terminal_model_call_id=records[-1].model_call_id,
        terminal_selection="heuristic",
    )
    return receipt, snapshots


def test_cached_columns_give_the_same_row_and_numpy_columns() -> None:
    from sink.trainer.verify import _verify_and_linearize

    receipt, snapshots = _decoded_chain()
    slow = verify_and_linearize(receipt, snapshots)
    fast = _verify_and_linearize(receipt, snapshots, use_cached_columns=True)
    assert fast == slow
    assert fast.columns.packed_parts is not None and slow.columns.packed_parts is None
    np = pytest.importorskip("numpy")
    fast_arrays: tuple[npt.NDArray[Any], ...] = fast.as_numpy()
    slow_arrays: tuple[npt.NDArray[Any], ...] = slow.as_numpy()
    for a, b in zip(fast_arrays, slow_arrays, strict=True):
        assert a.dtype == b.dtype
        assert np.array_equal(a, b)
        assert np.array_equal(np.signbit(a), np.signbit(b))


def test_a_replaced_column_is_not_vouched_for_by_the_cache() -> None:
    from sink.trainer.verify import _verify_and_linearize

    receipt, snapshots = _decoded_chain()
    tampered = list(snapshots[1].token_ids_delta)
    tampered[5] ^= 1
    object.__setattr__(snapshots[1], "token_ids_delta", tampered)  # a new list: the cache no longer applies
    with pytest.raises(ReceiptVerificationError) as caught:
        _verify_and_linearize(receipt, snapshots, use_cached_columns=True)
    assert caught.value.code == "corrupt_digest"


# --- verification -------------------------------------------------------------------------------------


def test_verify_names_a_string_passed_as_snapshots() -> None:
    """Kills ``not isinstance(snapshots, Sequence) or isinstance(snapshots, str...)`` -> ``and``."""
    receipt, _snapshots = example_case()
    with pytest.raises(TypeError, match="snapshots must be a sequence"):
        verify_and_linearize(receipt, "not snapshots")  # type: ignore[arg-type]


def test_verify_refuses_packed_snapshots_it_did_not_decode() -> None:
    """Kills ``own_decode and isinstance(snapshot, PackedSnapshot)`` -> ``or``."""
    receipt, snapshots = example_case()
    packed = [decode_packed_record(encode_record(StagedCallRecord.model_validate(s.model_dump()))) for s in snapshots]
    with pytest.raises(TypeError, match="not a StagedCallBaseSnapshot"):
        verify_and_linearize(receipt, packed)  # type: ignore[arg-type]


def test_linearize_checks_both_id_types() -> None:
    """Kills ``type(rollout_id) is not str or type(terminal_hint) is not str`` -> ``and``."""
    receipt, snapshots = example_case()
    with pytest.raises(TypeError, match="must be str"):
        linearize(5, snapshots, receipt.manifest, terminal_hint="main")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="must be str"):
        linearize("r1", snapshots, receipt.manifest, terminal_hint=7)  # type: ignore[arg-type]


_IDENTITY_VALUES = st.sampled_from([0, 1, 1.0, True, float("nan"), "a", "b", None])


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(IDENTITY_FIELDS), _IDENTITY_VALUES), st.data())
def test_step_8f_in_one_pass_agrees_with_the_field_by_field_loop(staged: dict[str, Any], data: Any) -> None:
    # The one-pass comparison must see a mismatch exactly when the loop would (NaN, 1 == 1.0 == True, a field
    # the snapshot lacks); the loop then names it.
    from types import SimpleNamespace

    from sink.trainer.verify import _same_identity

    recorded = {name: data.draw(_IDENTITY_VALUES) for name in IDENTITY_FIELDS}
    shared = data.draw(st.lists(st.sampled_from(IDENTITY_FIELDS)))
    staged.update({name: recorded[name] for name in shared})  # the very same objects, NaN included
    snapshot, record = SimpleNamespace(**staged), SimpleNamespace(**recorded)
    missing = object()
    loop_finds_none = not any(getattr(snapshot, name, missing) != getattr(record, name) for name in IDENTITY_FIELDS)
    assert _same_identity(snapshot, record) == loop_finds_none  # type: ignore[arg-type]
