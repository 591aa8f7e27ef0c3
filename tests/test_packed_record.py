"""The packed write form of a staged call (sink.contract.packed_record) against the seed's model.

The worker builds a :class:`PackedCallRecord` without pydantic; the model is built at the public boundary.
Both forms must be the same call: the same digest, key and blob, the same errors for the same bad input, and
every sink must stage either.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import redis
from hypothesis import given
from hypothesis import strategies as st

import sink.contract.packed_record as packed_record_module
from sink.contract._packed import TrustedColumns
from sink.contract.codec import decode_record, encode_record
from sink.contract.digest import EMPTY_EXTRAS_DIGEST, build_staging_delta, compute_extras_digest
from sink.contract.packed import staging_delta_columns
from sink.contract.packed_record import PackedCallRecord, verified_record
from sink.contract.records import CaptureAdmission, StagedCallRecord
from sink.contract.staged_records import record_from_trusted_columns
from sink.keys import record_key
from sink.store.memory import MemoryStagingStore
from sink.store.sink import AsyncRedisStagingSink, RedisStagingSink
from sink.store.source import AsyncRedisStagingSource
from tests.helpers.codec import HEX, SETTINGS, exact, extras_payloads, generated_log_probs
from worker.call import ActiveCall, build_call_record

NS = "stg"
SMALL_IDS = st.integers(0, 2**31 - 1)  # the ids the worker's one-pass delta build proves


def _scalars(**overrides: Any) -> dict[str, Any]:
    """The components of a root call other than its columns and lengths."""
    scalars: dict[str, Any] = {
        "rollout_id": "rollout-1",
        "model_call_id": "call-1",
        "parent_call_id": None,
        "mode": "text",
        "prev_len": 0,
        "weight_version": 7,
        "extras": None,
        "extras_digest": EMPTY_EXTRAS_DIGEST,
        "chain_hash": "1" * 64,
        "cumulative_hash": "2" * 64,
    }
    scalars.update(overrides)
    return scalars


def _columns(tail: list[int], generated: list[int], log_probs: list[float]) -> TrustedColumns:
    proved = staging_delta_columns(tail, generated, log_probs)
    assert proved is not None and proved.token_ids is not None
    return proved


def _model(tail: list[int], generated: list[int], log_probs: list[float], scalars: dict[str, Any]) -> StagedCallRecord:
    """The same call built the reference way: the public delta build and ``from_components``."""
    prev_len = scalars["prev_len"]
    ids, mask, lps = build_staging_delta([0] * prev_len + tail, generated, log_probs, prev_len)
    return StagedCallRecord.from_components(
        **scalars,
        delta_len=len(ids),
        cum_len=prev_len + len(ids),
        token_ids_delta=ids,
        token_mask_delta=mask,
        generation_log_probs_delta=lps,
    )


def _both(
    tail: list[int], generated: list[int], log_probs: list[float], **overrides: Any
) -> tuple[PackedCallRecord, StagedCallRecord]:
    scalars = _scalars(**overrides)
    packed = PackedCallRecord.from_trusted_columns(_columns(tail, generated, log_probs), **scalars)
    return packed, _model(tail, generated, log_probs, scalars)


# --- one call, two forms, one blob -------------------------------------------------------


@st.composite
def deltas(draw: st.DrawFn) -> tuple[list[int], list[int], list[float], dict[str, Any]]:
    """A valid delta as an engine returns it (prompt tail, generated ids and log-probs) and its call's scalars."""
    tail = draw(st.lists(SMALL_IDS, max_size=12))
    n = draw(st.integers(0 if tail else 1, 12))
    generated = draw(st.lists(SMALL_IDS, min_size=n, max_size=n))
    log_probs = draw(st.lists(generated_log_probs, min_size=n, max_size=n))
    extras = draw(extras_payloads)
    child = draw(st.booleans())
    scalars = _scalars(
        rollout_id=draw(st.text(min_size=1, max_size=8)),
        model_call_id=draw(st.text(min_size=1, max_size=8)),
        parent_call_id=draw(st.text(min_size=1, max_size=8)) if child else None,
        mode="token_in" if child else "text",
        prev_len=draw(st.integers(1, 64)) if child else 0,
        weight_version=draw(st.integers(0, 2**64 - 1)),
        extras=extras,
        extras_digest=compute_extras_digest(extras),
        chain_hash=draw(HEX),
        cumulative_hash=draw(HEX),
    )
    return tail, generated, log_probs, scalars


def _no_model_build(*args: Any, **kwargs: Any) -> StagedCallRecord:
    raise AssertionError("the packed build fell back to the model build")


@SETTINGS
@given(deltas())
def test_the_packed_form_and_the_model_are_the_same_call_and_blob(
    delta: tuple[list[int], list[int], list[float], dict[str, Any]],
) -> None:
    tail, generated, log_probs, scalars = delta
    model = _model(tail, generated, log_probs, scalars)
    with pytest.MonkeyPatch.context() as patched:  # a valid delta is proved without the model build
        patched.setattr(packed_record_module, "record_from_trusted_columns", _no_model_build)
        packed = PackedCallRecord.from_trusted_columns(_columns(tail, generated, log_probs), **scalars)
    assert packed.digest == model.digest
    assert packed.staging_key == model.staging_key
    blob = encode_record(model)
    assert encode_record(packed) == blob
    # the conversions both ways are the same call again
    assert encode_record(packed.to_record()) == blob
    assert packed.to_record() == model
    assert encode_record(PackedCallRecord.of(model)) == blob
    assert exact(decode_record(blob).model_dump()) == exact(model.model_dump())
    for name in StagedCallRecord.model_fields:
        assert exact(getattr(packed, name)) == exact(getattr(model, name)), name


def test_the_model_of_a_packed_record_owns_its_columns() -> None:
    packed, model = _both([5, 6], [7], [-0.5])
    converted = packed.to_record()
    assert converted.token_ids_delta == packed.token_ids_delta
    assert converted.token_ids_delta is not packed.token_ids_delta
    converted.token_ids_delta.append(9)  # the caller's model; the packed record is unchanged
    assert packed.token_ids_delta == [5, 6, 7] and encode_record(packed) == encode_record(model)
    assert PackedCallRecord.of(model).token_mask_delta is not model.token_mask_delta


def test_the_packed_form_is_immutable_and_built_only_by_its_builders() -> None:
    packed, _ = _both([5, 6], [7], [-0.5])
    with pytest.raises(dataclasses.FrozenInstanceError):
        packed.digest = "0" * 64  # type: ignore[misc]
    values = {field.name: getattr(packed, field.name) for field in dataclasses.fields(packed)}
    with pytest.raises(TypeError, match="build a PackedCallRecord"):
        PackedCallRecord(**values, _token=None)
    with pytest.raises(ValueError, match="_token"):
        dataclasses.replace(packed, weight_version=8)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="TrustedColumns"):
        PackedCallRecord.from_trusted_columns(None, **_scalars())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="StagedCallRecord"):
        PackedCallRecord.of(packed)  # type: ignore[arg-type]
    assert "delta_len=3" in repr(packed) and "token_ids" not in repr(packed)


def test_the_worker_builds_the_packed_form_on_both_paths() -> None:
    """The proved one-pass build and the reference build (ids beyond 2**31) both give the packed form."""
    for generated in ([7, 8], [7, 2**40]):
        call = ActiveCall(CaptureAdmission(rollout_id="rollout-1", model_call_id="call-1", mode="text"), 7, [])
        record = build_call_record(
            call, prompt_token_ids=[5, 6], generated_token_ids=generated, generated_logprobs=[-0.5, -0.25]
        )
        assert type(record) is PackedCallRecord
        hashes = {"chain_hash": record.chain_hash, "cumulative_hash": record.cumulative_hash}
        model = _model([5, 6], generated, [-0.5, -0.25], _scalars(**hashes))
        assert record.digest == model.digest and encode_record(record) == encode_record(model)


# --- the same refusals ---------------------------------------------------------------------


class _Key(str):
    """A str subclass: the model converts it to a str key, the packed build leaves such extras to the model."""


BAD_SCALARS: list[dict[str, Any]] = [
    {"rollout_id": ""},
    {"rollout_id": 5},
    {"model_call_id": None},
    {"parent_call_id": ""},
    {"parent_call_id": "p"},  # a parent with prev_len 0
    {"mode": "token_in"},  # a parentless call must be a text call
    {"mode": "chat"},
    {"prev_len": -1},
    {"prev_len": True},
    {"prev_len": 1.0},
    {"parent_call_id": "p", "mode": "token_in", "prev_len": 2**64 - 2},  # cum_len beyond u64
    {"weight_version": -1},
    {"weight_version": 2**64},
    {"weight_version": "7"},
    {"chain_hash": "x"},
    {"cumulative_hash": "A" * 64},
    {"extras_digest": "0" * 64},  # not the digest of the extras
    {"extras": {"a": 1}},  # extras without their digest
    {"extras": {"a": object()}},  # unsupported extras value: TypeError, as the model raises it
    {"extras": {1: 2}, "extras_digest": EMPTY_EXTRAS_DIGEST},
    {"extras": [1], "extras_digest": EMPTY_EXTRAS_DIGEST},
    {"extras": {"f": float("nan")}},
    {"schema_version": 3},
    {"schema_version": True},
    {"digest_version": 1},
    {"extras_digest_version": 2.0},
    {"surprise": 1},
]


def _outcome(build: Any) -> tuple[str, Any]:
    try:
        record = build()
    except Exception as exc:  # noqa: BLE001 - the comparison is the point: any error must match
        return ("error", (type(exc), str(exc)))
    return ("ok", (record.digest, encode_record(record)))


@pytest.mark.parametrize("bad", BAD_SCALARS, ids=[",".join(sorted(bad)) for bad in BAD_SCALARS])
def test_the_packed_form_refuses_bad_scalars_exactly_as_the_model(bad: dict[str, Any]) -> None:
    scalars = _scalars(**bad)

    def packed() -> PackedCallRecord:
        return PackedCallRecord.from_trusted_columns(_columns([5, 6], [7], [-0.5]), **scalars)

    def model() -> StagedCallRecord:
        return record_from_trusted_columns(_columns([5, 6], [7], [-0.5]), **scalars)

    outcome = _outcome(packed)
    assert outcome[0] == "error"
    assert outcome == _outcome(model)
    assert issubclass(outcome[1][0], (ValueError, TypeError))


def test_extras_the_packed_build_leaves_to_the_model_still_build_the_same_record() -> None:
    """A key of a str subclass is not proved on the packed path; the model converts it, and the record follows."""
    scalars = _scalars(extras={_Key("k"): [1, 2.5]}, extras_digest=compute_extras_digest({"k": [1, 2.5]}))
    packed = PackedCallRecord.from_trusted_columns(_columns([5], [7], [-0.5]), **scalars)
    model = record_from_trusted_columns(_columns([5], [7], [-0.5]), **scalars)
    assert packed.extras == {"k": [1, 2.5]} and [type(key) for key in packed.extras] == [str]
    assert encode_record(packed) == encode_record(model)


def test_verified_record_checks_a_packed_records_extras() -> None:
    extras = {"a": [1, 2]}
    packed, _ = _both([5], [7], [-0.5], extras=extras, extras_digest=compute_extras_digest(extras))
    assert verified_record(packed) is packed
    assert packed.extras is not None and packed.extras is not extras  # its own copy
    packed.extras["a"].append(3)  # records are values: a mutated payload no longer matches its digest
    with pytest.raises(ValueError, match="extras_digest does not match extras"):
        verified_record(packed)


# --- every sink stages either form ---------------------------------------------------------


def test_the_memory_store_stages_either_form() -> None:
    store = MemoryStagingStore()
    packed, model = _both([5, 6], [7], [-0.5])
    first = store.stage(packed)
    again = store.stage(model)
    assert first.ok and again.ok and first.staging_key == again.staging_key == model.staging_key
    assert store.fetch([model.staging_key])[0].model_dump() == model.model_dump()
    other, _ = _both([5, 6], [8], [-0.5])
    assert store.stage(other).error is not None  # another digest under the same key: a conflict
    with pytest.raises(TypeError, match="StagedCallRecord or a PackedCallRecord"):
        store.stage(model.model_dump())  # type: ignore[arg-type]


@pytest.mark.anyio
async def test_the_redis_sink_stages_either_form_as_the_same_blob(redis_url: str) -> None:
    packed, model = _both([5, 6], [7, 8], [-0.5, -1 / 3], rollout_id="forms")
    later_packed, later_model = _both([9], [10], [-0.125], rollout_id="forms", model_call_id="call-2")
    async with AsyncRedisStagingSink.from_url(redis_url, namespace=NS) as sink:
        results = [
            await sink.stage(packed),
            await sink.stage(model),  # the same call as a model: already present, same bytes
            await sink.stage(later_model),
            await sink.stage(later_packed),
        ]
        stats = sink.statistics()
        with pytest.raises(TypeError, match="StagedCallRecord or a PackedCallRecord"):
            await sink.stage(model.model_dump())  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="StagedCallRecord or a PackedCallRecord"):
            await sink.stage_generation_prefix(None, checkpoint_id="ck", chunk_sequence=0)  # type: ignore[arg-type]
        cut = await sink.stage_generation_prefix(packed, checkpoint_id="ck", chunk_sequence=0)
    assert [r.ok for r in results] == [True] * 4 and cut.ok
    assert [r.staging_key for r in results] == ["forms/call-1"] * 2 + ["forms/call-2"] * 2
    assert (stats.staged, stats.already_present, stats.repaired, stats.conflicts) == (2, 2, 0, 0)
    with redis.Redis.from_url(redis_url) as client:
        assert client.get(record_key(NS, "forms/call-1")) == encode_record(model)
        assert client.get(record_key(NS, "forms/call-2")) == encode_record(later_packed)
    async with AsyncRedisStagingSource.from_url(redis_url, namespace=NS) as source:
        fetched = await source.fetch(["forms/call-1", "forms/call-2", cut.staging_key or ""])
    assert [s.model_dump() for s in fetched] == [model.model_dump(), later_model.model_dump(), model.model_dump()]


@pytest.mark.anyio
async def test_the_redis_sink_refuses_a_packed_record_whose_extras_changed(redis_url: str) -> None:
    extras = {"a": 1}
    packed, _ = _both(
        [5], [7], [-0.5], rollout_id="mutated", extras=extras, extras_digest=compute_extras_digest(extras)
    )
    assert packed.extras is not None
    packed.extras["a"] = 2
    async with AsyncRedisStagingSink.from_url(redis_url, namespace=NS) as sink:
        result = await sink.stage(packed)
    assert not result.ok and result.error is not None and "extras_digest does not match extras" in result.error
    with redis.Redis.from_url(redis_url) as client:
        assert client.exists(record_key(NS, "mutated/call-1")) == 0


def test_the_sync_redis_sink_stages_either_form(redis_url: str) -> None:
    packed, model = _both([5, 6], [7], [-0.5], rollout_id="sync-forms")
    with RedisStagingSink.from_url(redis_url, namespace=NS) as sink:
        assert sink.stage(packed).ok and sink.stage(model).ok
        assert (sink.statistics().staged, sink.statistics().already_present) == (1, 1)
        with pytest.raises(TypeError, match="StagedCallRecord or a PackedCallRecord"):
            sink.stage("record")  # type: ignore[arg-type]
