"""Sampling provenance on the trainer side: each staged call's ``extras["sampling"]`` entry, checked against its extras
digest, becomes the row's ``sampling`` and its per-token ``policy_mask`` (True only where the staged log-prob is the
model's own and the token was sampled from the model's distribution), through the reader, ``collate``, ``pack`` and
the export, against real servers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from sink.contract.digest import compute_extras_digest
from sink.contract.records import RolloutReceipt, StagedCallRecord
from sink.contract.sampling import MODEL_LOGPROBS_MODES, SamplingProvenance
from sink.errors import ReceiptVerificationError, SamplingProvenanceError
from sink.trainer.batch import collate
from sink.trainer.export import EXPORT_FORMATS, read_export, write_export
from sink.trainer.packing import pack
from sink.trainer.reader.rollout_reader import RolloutReader
from sink.trainer.statistics import mismatch_report
from sink.trainer.verify import verify_and_linearize
from tests.helpers.codec import SETTINGS
from tests.helpers.e2e import call_record_of, pull_until
from tests.helpers.rows import verified_pulled
from tests.helpers.sampling import sampling_entries, sampling_entry, sampling_extras
from tests.helpers.staging import make_chain
from tests.helpers.trainer import publish

# --- the entry ---------------------------------------------------------------------


@SETTINGS
@given(sampling_entries)
def test_an_entry_reads_back_as_written_and_its_digest_covers_it(entry: dict[str, Any]) -> None:
    provenance = SamplingProvenance.parse(entry)
    assert provenance.as_extras() == entry
    assert SamplingProvenance.from_extras({"sampling": entry, "routed_experts": "AAAA"}) == provenance
    changed = {**entry, "logit_bias": not entry["logit_bias"]}
    assert compute_extras_digest({"sampling": entry}) != compute_extras_digest({"sampling": changed})


@pytest.mark.parametrize("extras", [None, {}, {"routed_experts": "AAAA"}])
def test_a_call_without_an_entry_has_no_provenance(extras: dict[str, Any] | None) -> None:
    assert SamplingProvenance.from_extras(extras) is None


def test_an_int_where_a_float_is_documented_reads_as_a_float_and_unknown_keys_are_ignored() -> None:
    provenance = SamplingProvenance.parse({**sampling_entry(temperature=1, top_p=0), "added_later": [1]})
    assert (provenance.temperature, provenance.top_p) == (1.0, 0.0)
    assert type(provenance.temperature) is float and type(provenance.top_p) is float


def _without(name: str) -> dict[str, Any]:
    entry = sampling_entry()
    del entry[name]
    return entry


@pytest.mark.parametrize(
    ("entry", "names"),
    [
        ("greedy", "must be a dict"),
        (_without("min_tokens"), "'min_tokens'"),
        (_without("constraint"), "'constraint'"),
        (sampling_entry(source="vllm"), "source"),
        (sampling_entry(temperature="1.0"), "temperature"),
        (sampling_entry(top_p=True), "top_p"),
        (sampling_entry(top_k=1.5), "top_k"),
        (sampling_entry(seed=False), "seed"),
        (sampling_entry(min_tokens=-1), "min_tokens"),
        (sampling_entry(min_tokens=None), "min_tokens"),
        (sampling_entry(ignore_eos=1), "ignore_eos"),
        (sampling_entry(logit_bias=None), "logit_bias"),
        (sampling_entry(constraint="json"), "constraint"),
        (sampling_entry(logprobs_mode=3), "logprobs_mode"),
    ],
)
def test_a_malformed_entry_is_refused_naming_its_field(entry: object, names: str) -> None:
    with pytest.raises(SamplingProvenanceError, match=names) as raised:
        SamplingProvenance.from_extras({"sampling": entry})
    assert isinstance(raised.value, ValueError)


# --- the policy mask ---------------------------------------------------------------


def expected_policy_mask(calls: list[tuple[int, int, dict[str, Any] | None]]) -> list[bool]:
    """The mask by its definition, token by token: (length, carry, entry) per call."""
    out: list[bool] = []
    for length, carry, entry in calls:
        out += [False] * carry
        for position in range(length - carry):
            if entry is None:
                out.append(True)
            elif (
                entry["constraint"] is not None
                or entry["logit_bias"]
                or entry["logprobs_mode"] not in {None, *MODEL_LOGPROBS_MODES}
            ):
                out.append(False)
            else:
                out.append(position >= entry["min_tokens"])
    return out


@st.composite
def chains(draw: st.DrawFn) -> list[tuple[int, int, dict[str, Any] | None]]:
    calls = []
    for index in range(draw(st.integers(1, 5))):
        length = draw(st.integers(2, 14))
        carry = draw(st.integers(0 if index else 1, length - 1))  # the root carries a prompt; every call generates
        calls.append((length, carry, draw(st.none() | sampling_entries)))
    return calls


@SETTINGS
@given(chains())
def test_the_policy_mask_is_true_exactly_on_policy_tokens(calls: list[tuple[int, int, dict[str, Any] | None]]) -> None:
    pulled = verified_pulled(
        "r1",
        lengths=[length for length, _, _ in calls],
        carries=[carry for _, carry, _ in calls],
        extras=[None if entry is None else {"sampling": entry} for _, _, entry in calls],
    )
    assert pulled.row is not None
    row = pulled.row
    mask = row.policy_mask()
    assert mask.dtype == bool and mask.tolist() == expected_policy_mask(calls)
    assert not (mask & (row.as_numpy().token_mask == 0)).any()  # never a prompt token
    assert row.sampling == tuple(None if entry is None else SamplingProvenance.parse(entry) for _, _, entry in calls)
    assert row.provenance_known == all(entry is not None for _, _, entry in calls)
    mask[:] = ~mask  # a fresh array each time
    assert row.policy_mask().tolist() == expected_policy_mask(calls)


def test_write_policy_mask_refuses_a_target_of_another_length() -> None:
    row = verified_pulled("r1").row
    assert row is not None
    with pytest.raises(ValueError, match="16 elements"):
        row.write_policy_mask(np.empty(15, dtype=bool))


# --- verification (contract §8.1 step 14) ------------------------------------------


def _receipt(chain: list[StagedCallRecord]) -> RolloutReceipt:
    return RolloutReceipt(
        rollout_id=chain[0].rollout_id,
        terminal_model_call_id=chain[-1].model_call_id,
        manifest=[call_record_of(record, admitted_at=1000.0 + i) for i, record in enumerate(chain)],
        terminal_selection="declared",
    )


def test_an_entry_changed_after_validation_fails_verification_as_corrupt_extras() -> None:
    chain = make_chain("r1", 2, extras=[sampling_extras(), sampling_extras()])
    receipt = _receipt(chain)
    assert verify_and_linearize(receipt, chain).provenance_known
    assert chain[1].extras is not None
    chain[1].extras["sampling"]["constraint"] = "structured_outputs"  # the record's digest still holds
    with pytest.raises(ReceiptVerificationError, match="'c1': extras digest") as raised:
        verify_and_linearize(receipt, chain)
    assert raised.value.code == "corrupt_extras"


def test_a_malformed_entry_fails_verification_as_invalid_sampling() -> None:
    chain = make_chain("r1", 2, extras=[None, {"sampling": _without("seed")}])
    with pytest.raises(ReceiptVerificationError, match="'c1': the sampling entry has no 'seed'") as raised:
        verify_and_linearize(_receipt(chain), chain)
    assert raised.value.code == "invalid_sampling"


# --- through the reader, batches and export (real servers) -------------------------

CALL_EXTRAS = [
    sampling_extras(temperature=0.7, seed=3),
    sampling_extras(constraint="structured_outputs"),
    sampling_extras(min_tokens=2, ignore_eos=True),
    None,
]
# make_chain: the root carries 3 prompt tokens, each child 2; 8 tokens per call.
EXPECTED = [False] * 3 + [True] * 5 + [False] * 8 + [False] * 4 + [True] * 4 + [False] * 2 + [True] * 6


@pytest.mark.anyio
async def test_provenance_reaches_the_reader_batches_and_export(redis_url: str, tmp_path: Path) -> None:
    await publish(redis_url, ["prov"], calls=4, extras=CALL_EXTRAS)
    async with RolloutReader.from_url(redis_url) as reader:
        [pulled] = await pull_until(reader, 1)
        await reader.ack([pulled.rollout_id])
    row = pulled.row
    assert row is not None
    assert row.sampling == tuple(None if e is None else SamplingProvenance.parse(e["sampling"]) for e in CALL_EXTRAS)
    assert row.policy_mask().tolist() == EXPECTED
    assert not row.provenance_known  # the last call has none: its tokens count as policy tokens

    # The mismatch report on the pulled row: against its staged values exactly (float64 here: make_record's are
    # not float32 values), flagged tokens apart.
    report = mismatch_report(row, np.array(row.logprobs) - 0.25)
    assert (report.policy.tokens, report.flagged.tokens) == (EXPECTED.count(True), 6 + 2)
    assert report.policy.max_abs_diff == pytest.approx(0.25) and report.policy.kl_k1 == pytest.approx(0.25)

    batch = collate([pulled], pad_to_multiple_of=12)  # 32 tokens, padded to 36
    assert batch.policy_mask.shape == (1, 36) and batch.policy_mask.tolist() == [EXPECTED + [False] * 4]
    assert batch.tensors()["policy_mask"] is batch.policy_mask and batch.provenance_known.tolist() == [False]
    packed = pack([pulled], max_tokens=40)
    assert packed.policy_mask.tolist() == [EXPECTED + [False] * 8] and packed.provenance_known.tolist() == [False]

    for fmt in EXPORT_FORMATS:
        path = tmp_path / f"rows.{fmt}"
        write_export([pulled], path, fmt=fmt)
        [exported] = read_export(path)
        assert exported["sampling"] == [None if e is None else e["sampling"] for e in CALL_EXTRAS]


@pytest.mark.anyio
async def test_a_malformed_entry_skips_its_rollout_with_a_precise_code(redis_url: str) -> None:
    await publish(redis_url, ["bad"], calls=2, extras=[None, {"sampling": sampling_entry(min_tokens=-3)}])
    async with RolloutReader.from_url(redis_url) as reader:
        [pulled] = await pull_until(reader, 1)
        await reader.ack([pulled.rollout_id])
    assert not pulled.trainable
    assert pulled.skip_code == "invalid_sampling"
    assert "'c1'" in (pulled.skip_reason or "") and "min_tokens" in (pulled.skip_reason or "")
