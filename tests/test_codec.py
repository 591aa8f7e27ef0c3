"""The msgpack record codec (sink.contract.codec) and the packed-column fast path behind it."""

from __future__ import annotations

import math
import struct
from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import sink.contract.record_form as record_form_module
import sink.contract.records as R
import sink.contract.staged_records as staged_module
from sink.contract._packed import columns as _columns
from sink.contract._packed import record_columns as _record_columns
from sink.contract.codec import CODEC_VERSION, DIGEST_HEAD_BYTES, decode_record, encode_record
from sink.contract.digest import EMPTY_EXTRAS_DIGEST, compute_extras_digest
from sink.contract.records import StagedCallBaseSnapshot, StagedCallRecord, StagedCallSnapshot
from sink.contract.staged_records import record_from_trusted_columns
from sink.errors import CodecError
from tests.helpers.codec import (
    CHAIN_ROOT,
    CUMULATIVE_ROOT,
    GOLDEN_DIGEST,
    GOLDEN_EXTRAS,
    SETTINGS,
    assert_same_record,
    components,
    exact,
    f32,
    generated_log_probs,
    public_digest,
    record_of,
    repack,
    small_blob,
    staged_records,
    token_ids,
)

# --- round trips -------------------------------------------------------------------


@SETTINGS
@given(staged_records())
def test_round_trip_returns_exactly_the_staged_values(record: StagedCallRecord) -> None:
    blob = encode_record(record)
    decoded = decode_record(blob)
    assert type(decoded) is StagedCallSnapshot
    assert_same_record(decoded, record)
    assert decoded.digest == record.digest
    # soundness: the digest the fast path verified is the one the checked public function computes
    assert public_digest(decoded) == decoded.digest
    assert compute_extras_digest(decoded.extras) == decoded.extras_digest
    assert encode_record(decoded) == blob  # deterministic; the decoded record's cache reproduces the blob


@SETTINGS
@given(staged_records())
def test_wire_validated_records_encode_identically(record: StagedCallRecord) -> None:
    wire = StagedCallSnapshot.model_validate(record.model_dump())
    assert encode_record(wire) == encode_record(record)
    stripped = wire.model_copy()
    stripped._columns = None  # no cache: the codec packs the lists itself
    assert encode_record(stripped) == encode_record(record)


def test_golden_vector_round_trips_and_leads_with_version_and_digest() -> None:
    record = StagedCallRecord.from_components(**components())
    assert record.digest == GOLDEN_DIGEST
    blob = encode_record(record)
    assert blob[:DIGEST_HEAD_BYTES].endswith(GOLDEN_DIGEST.encode())
    obj = msgpack.unpackb(blob, raw=False)
    assert list(obj)[:2] == ["v", "digest"]
    assert obj["v"] == CODEC_VERSION
    assert obj["ids"] == struct.pack("<2I", 10, 11)
    assert obj["mask"] == b"\x00\x3f"
    assert obj["log_probs"] == struct.pack("<2f", 0.0, -0.25)
    assert obj["extras"] == GOLDEN_EXTRAS
    decoded = decode_record(blob)
    assert decoded.digest == GOLDEN_DIGEST
    assert_same_record(decoded, record)


def test_negative_zero_mask_survives_with_the_contract_digest() -> None:
    root = record_of(
        [10, 11, 12],
        [-0.0, 0.0, 1.0],
        [0.0, 0.0, -0.25],
        rollout_id="rollout-1",
        model_call_id="c1",
        parent_call_id=None,
        mode="text",
        prev_len=0,
        cum_len=3,
        chain_hash=CHAIN_ROOT,
        cumulative_hash=CUMULATIVE_ROOT,
    )
    assert root.digest == "bd73225d06410cb7e99d5752c1fd80652f1287e68186a53091ea988d908a8d2c"
    blob = encode_record(root)
    assert msgpack.unpackb(blob)["mask"] == b"\x80\x00\x3f"
    decoded = decode_record(blob)
    assert math.copysign(1.0, decoded.token_mask_delta[0]) == -1.0
    assert decoded.digest == root.digest


def test_column_widths_follow_the_values() -> None:
    n = 1000
    narrow = record_of(list(range(n)), [0.0] * 10 + [1.0] * (n - 10), [0.0] * 10 + [f32(-i / 7) for i in range(n - 10)])
    blob = encode_record(narrow)
    assert len(blob) <= 9 * n + 600
    obj = msgpack.unpackb(blob)
    assert (obj["ids_width"], obj["log_prob_width"]) == (4, 4)
    wide = record_of([2**32] + list(range(n - 1)), [1.0] * n, [0.1] + [-1.0] * (n - 1))
    obj = msgpack.unpackb(encode_record(wide))
    assert (obj["ids_width"], obj["log_prob_width"]) == (8, 8)
    decoded = decode_record(encode_record(wide))
    assert decoded.token_ids_delta[0] == 2**32
    assert decoded.generation_log_probs_delta[0] == 0.1  # float64-only value kept exactly
    assert_same_record(decoded, wide)


def test_float32_subnormals_are_stored_as_float64_conservatively() -> None:
    record = record_of([1, 2], [1.0, 1.0], [-1e-45, 2.0**-130])
    assert msgpack.unpackb(encode_record(record))["log_prob_width"] == 8
    assert_same_record(decode_record(encode_record(record)), record)


def test_interleaved_masks_round_trip() -> None:
    record = record_of([5, 6, 7, 8], [1.0, 0.0, 1.0, -0.0], [-0.5, -0.0, -0.25, 0.0])
    decoded = decode_record(encode_record(record))
    assert_same_record(decoded, record)
    assert public_digest(decoded) == record.digest


def test_non_canonical_widths_decode_to_the_same_record() -> None:
    record = record_of([1, 2, 3], [0.0, 1.0, 1.0], [0.0, -0.5, -0.25])

    def widen(obj: dict[str, Any]) -> None:
        obj["ids_width"], obj["ids"] = 8, struct.pack("<3Q", 1, 2, 3)
        obj["log_prob_width"], obj["log_probs"] = 8, struct.pack("<3d", 0.0, -0.5, -0.25)

    assert_same_record(decode_record(repack(encode_record(record), widen)), record)


def test_bytes_like_inputs_are_accepted() -> None:
    blob = encode_record(StagedCallRecord.from_components(**components()))
    for data in (bytearray(blob), memoryview(blob)):
        assert decode_record(data).digest == GOLDEN_DIGEST  # type: ignore[arg-type]  # documented bytes-like


# --- the fast path agrees with the reference path ----------------------------------

junk_floats = st.one_of(
    st.sampled_from([0.0, -0.0, 1.0, -1.0, 0.5, 2.0, 1e39, -1e39, 3.4028235e38, 3.4028236e38, 1e-46, 5e-324]),
    st.sampled_from([math.nan, math.inf, -math.inf, 0, 1, True, False]),
    st.floats(),
)
junk_ids = st.one_of(st.integers(-3, 2**64 + 3), st.sampled_from([True, -(2**63), 2**64 - 1, 2**64]))


def _outcome(build: Any) -> tuple[str, Any]:
    try:
        record = build()
    except Exception as exc:  # noqa: BLE001 - the comparison is the point: any error must match
        return ("error", (type(exc).__name__, str(exc)))
    return ("ok", (record.digest, exact(record.model_dump())))


@st.composite
def perturbed_columns(draw: st.DrawFn) -> tuple[list[Any], list[Any], list[Any]]:
    """Valid columns (any float64 log-probability) with, half the time, one element or length broken."""
    n = draw(st.integers(1, 8))
    ids = draw(st.lists(token_ids, min_size=n, max_size=n))
    mask = draw(st.lists(st.sampled_from([0.0, -0.0, 1.0]), min_size=n, max_size=n))
    log_probs = [draw(st.sampled_from([0.0, -0.0])) if m == 0.0 else draw(generated_log_probs) for m in mask]
    columns: tuple[list[Any], list[Any], list[Any]] = (ids, mask, log_probs)
    damage = draw(st.sampled_from(["none", "none", "ids", "mask", "log_probs", "length"]))
    if damage == "length":
        draw(st.sampled_from(columns)).pop()
    elif damage != "none":
        column = columns[("ids", "mask", "log_probs").index(damage)]
        column[draw(st.integers(0, n - 1))] = draw(junk_ids if damage == "ids" else junk_floats)
    return columns


@settings(max_examples=400, deadline=None)
@given(perturbed_columns())
def test_fast_path_accepts_exactly_what_the_reference_path_accepts(
    columns: tuple[list[Any], list[Any], list[Any]],
) -> None:
    ids, mask, log_probs = columns
    n = len(log_probs)
    wire = components(
        token_ids_delta=ids, token_mask_delta=mask, generation_log_probs_delta=log_probs, delta_len=n, cum_len=3 + n
    )
    wire.update(digest="0" * 64)
    build_context = {"build": R._BUILD_STAGING_DIGEST}

    def validate() -> StagedCallRecord:
        return StagedCallRecord.model_validate(wire, context=build_context)

    def from_components() -> StagedCallRecord:
        return StagedCallRecord.from_components(**{k: v for k, v in wire.items() if k != "digest"})

    fast = (_outcome(validate), _outcome(from_components))
    with pytest.MonkeyPatch.context() as patched:
        patched.setattr(record_form_module, "pack_validated_columns", lambda *args: None)
        patched.setattr(staged_module, "trusted_components", lambda *args: None)
        reference = (_outcome(validate), _outcome(from_components))
    assert fast == reference


# --- the cache never makes wrong contents verify -----------------------------------


def test_replaced_columns_are_packed_again_and_then_fail_verification() -> None:
    record = StagedCallRecord.from_components(**components())
    record.token_ids_delta = [10, 12]
    with pytest.raises(CodecError, match="digest does not match"):
        decode_record(encode_record(record))
    copy = StagedCallRecord.from_components(**components()).model_copy(
        update={"generation_log_probs_delta": [0.0, -0.5]}
    )
    with pytest.raises(CodecError, match="digest does not match"):
        decode_record(encode_record(copy))


def test_in_place_mutation_never_comes_back_verified() -> None:
    original = StagedCallRecord.from_components(**components())
    record = original.model_copy(deep=True)
    record.token_ids_delta[1] = 99  # unsupported: records are values
    decoded = decode_record(encode_record(record))
    assert decoded.token_ids_delta == [10, 11]  # the validated contents, which the digest covers
    assert public_digest(decoded) == decoded.digest == GOLDEN_DIGEST


def test_columns_mutated_into_invalid_values_cannot_be_encoded() -> None:
    for field, value in (("token_mask_delta", [2.0, 1.0]), ("token_ids_delta", [10]), ("token_ids_delta", [-1, 2])):
        record = StagedCallRecord.from_components(**components())
        setattr(record, field, value)
        with pytest.raises(CodecError, match="cannot encode"):
            encode_record(record)


def test_a_foreign_context_value_is_not_trusted() -> None:
    wire = StagedCallRecord.from_components(**components()).model_dump()
    wire["token_ids_delta"] = [10, 12]
    forged = _columns.TrustedColumns(
        _columns.PackedColumns(length=2, mask_codes=b"\x00\x3f", lp_f32be=bytes(8), lp_f32_exact=True),
        [0.0, 1.0],
        [0.0, -0.25],
        None,
    )
    for context in ({"columns": "yes"}, {"columns": forged}, {"columns": {"token_ids": [10, 11]}}):
        with pytest.raises(ValueError, match="digest does not match"):
            StagedCallSnapshot.model_validate(wire, context=context)


# --- malformed, truncated, oversized, tampered -------------------------------------


def test_every_single_byte_flip_is_rejected_or_harmless() -> None:
    record, blob = small_blob()
    for position in range(len(blob)):
        for flip in (0x01, 0x80, 0xFF):
            tampered = bytearray(blob)
            tampered[position] ^= flip
            try:
                decoded = decode_record(bytes(tampered))
            except CodecError:
                continue
            assert_same_record(decoded, record)


def test_byte_flips_in_float64_columns_can_only_change_bits_the_digest_ignores() -> None:
    record = record_of([1, 2], [1.0, 1.0], [0.1, -0.3])  # float64 column: the digest covers binary32 roundings
    blob = encode_record(record)
    for position in range(len(blob)):
        tampered = bytearray(blob)
        tampered[position] ^= 0x01
        try:
            decoded = decode_record(bytes(tampered))
        except CodecError:
            continue
        assert decoded.digest == record.digest
        assert [f32(v) for v in decoded.generation_log_probs_delta] == [f32(0.1), f32(-0.3)]
        assert decoded.model_dump(exclude={"generation_log_probs_delta"}) == record.model_dump(
            exclude={"generation_log_probs_delta"}
        )


def test_truncated_and_padded_blobs_are_rejected() -> None:
    _, blob = small_blob()
    for size in range(len(blob)):
        with pytest.raises(CodecError):
            decode_record(blob[:size])
    with pytest.raises(CodecError, match="malformed"):
        decode_record(blob + b"\xc0")


def test_oversized_blobs_are_rejected_before_parsing() -> None:
    _, blob = small_blob()
    assert decode_record(blob, max_record_bytes=len(blob)).delta_len == 3
    with pytest.raises(CodecError, match="exceeds max_record_bytes"):
        decode_record(blob, max_record_bytes=len(blob) - 1)


def _set(key: str, value: Any) -> Any:
    def edit(obj: dict[str, Any]) -> None:
        obj[key] = value

    return edit


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda obj: [obj], "top level is list"),
        (lambda obj: 5, "top level is int"),
        (_set("v", 2), "unsupported codec version 2"),
        (_set("v", True), "unsupported codec version True"),
        (_set("v", "1"), "unsupported codec version '1'"),
        (lambda obj: {key: obj[key] for key in reversed(obj)}, "must be the first map entry"),
        (lambda obj: obj.pop("mask") and None, "missing keys \\['mask'\\]"),
        (_set("extra", 1), "unknown keys \\['extra'\\]"),
        (_set("ids_width", 5), "'ids_width' must be 4 or 8"),
        (_set("ids_width", True), "'ids_width' must be 4 or 8"),
        (_set("log_prob_width", 2), "'log_prob_width' must be 4 or 8"),
        (_set("ids", b"\x00" * 11), "'ids' holds 11 bytes"),
        (_set("ids", "abc"), "'ids' must be msgpack bin"),
        (_set("mask", b"\x00\x3f\x01"), "mask code 0x01"),
        (_set("log_probs", struct.pack("<3f", 0.0, math.inf, -0.5)), "failed verification"),
        (_set("log_probs", struct.pack("<3f", 0.0, math.nan, -0.5)), "failed verification"),
        (_set("delta_len", -3), "delta_len must be a non-negative int"),
        (_set("delta_len", 3.0), "delta_len must be a non-negative int"),
        (_set("digest", "f" * 64), "digest does not match"),
        (_set("weight_version", 8), "digest does not match"),
        (_set("prev_len", 0), "failed verification"),
        (_set("rollout_id", 5), "rollout_id"),
        (_set("extras", {"a": [1, 1.5, "x"], "b": None}), "extras_digest does not match"),
        (_set("extras", {"a": [1.0, 1.5, "x"]}), "extras_digest does not match"),
        (_set("extras", {"a": [1, 1.5, b"x"]}), "unsupported extras value type"),
        (_set("extras", [1]), "failed verification"),
    ],
)
def test_malformed_blobs_raise_codec_error_naming_the_problem(edit: Any, message: str) -> None:
    _, blob = small_blob()
    with pytest.raises(CodecError, match=message):
        decode_record(repack(blob, edit))


def test_duplicate_keys_and_extension_types_are_rejected() -> None:
    _, blob = small_blob()
    obj = msgpack.unpackb(blob, raw=False)
    body = b"".join(msgpack.packb(key) + msgpack.packb(value, use_bin_type=True) for key, value in obj.items())
    duplicated = b"\xde" + struct.pack(">H", len(obj) + 1) + body + msgpack.packb("mode") + msgpack.packb("text")
    with pytest.raises(CodecError, match="duplicate map key"):
        decode_record(duplicated)
    with pytest.raises(CodecError, match="extension type 5"):
        decode_record(repack(blob, _set("extras", {"a": msgpack.ExtType(5, b"x")})))
    with pytest.raises(CodecError, match="malformed"):
        decode_record(repack(blob, _set("extras", {1: 2})))  # non-string map key
    with pytest.raises(CodecError, match="malformed"):
        decode_record(blob.replace(b"rollout-1", b"rollout-\xff"))  # invalid UTF-8


# --- wrong input types -------------------------------------------------------------


def test_wrong_input_types_raise_type_error() -> None:
    record = StagedCallRecord.from_components(**components())
    base = StagedCallBaseSnapshot.model_validate(record.model_dump(exclude={"extras"}))
    for value in (None, {}, record.model_dump(), base, b"blob"):
        with pytest.raises(TypeError, match="StagedCallRecord"):
            encode_record(value)  # type: ignore[arg-type]
    blob = encode_record(record)
    for data in (None, "text", [1, 2], 5):
        with pytest.raises(TypeError, match="must be bytes"):
            decode_record(data)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="max_record_bytes"):
        decode_record(blob, max_record_bytes="1024")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="positive"):
        decode_record(blob, max_record_bytes=0)


def test_empty_extras_and_no_extras_are_distinct() -> None:
    extras: dict[str, Any] | None
    for extras in (None, {}):
        record = record_of([1], [1.0], [-1.0], extras=extras)
        decoded = decode_record(encode_record(record))
        assert decoded.extras == extras
        assert decoded.extras_digest == compute_extras_digest(extras)
    assert compute_extras_digest(None) == EMPTY_EXTRAS_DIGEST


@st.composite
def engine_outputs(draw: st.DrawFn) -> tuple[list[Any], list[Any], list[Any]]:
    """(prompt tail, generated ids, generated log-probs) as an engine returns them, half the time broken."""
    tail = draw(st.lists(token_ids, max_size=5))
    n = draw(st.integers(0, 6))
    generated = draw(st.lists(token_ids, min_size=n, max_size=n))
    log_probs = draw(st.lists(generated_log_probs, min_size=n, max_size=n))
    damage = draw(st.sampled_from(["none", "none", "tail", "generated", "log_probs", "length"]))
    if damage == "length":
        log_probs.append(-0.5)
    elif damage != "none":
        columns: dict[str, list[Any]] = {"tail": tail, "generated": generated, "log_probs": log_probs}
        column = columns[damage]
        column.insert(draw(st.integers(0, len(column))), draw(junk_ids if damage != "log_probs" else junk_floats))
    return tail, generated, log_probs


@settings(max_examples=400, deadline=None)
@given(engine_outputs())
def test_the_workers_delta_build_agrees_with_build_staging_delta_and_from_components(
    outputs: tuple[list[Any], list[Any], list[Any]],
) -> None:
    from sink.contract.digest import build_staging_delta

    tail, generated, log_probs = outputs
    prefix = [1, 2, 3]
    scalars = {k: v for k, v in components().items() if not k.endswith("_delta") and k not in ("delta_len", "cum_len")}
    scalars["extras"], scalars["extras_digest"] = None, EMPTY_EXTRAS_DIGEST

    def reference() -> StagedCallRecord:
        ids, mask, lps = build_staging_delta(prefix + tail, generated, log_probs, len(prefix))
        return StagedCallRecord.from_components(
            **scalars,
            token_ids_delta=ids,
            token_mask_delta=mask,
            generation_log_probs_delta=lps,
            delta_len=len(ids),
            cum_len=3 + len(ids),
        )

    proved = _record_columns.staging_delta_columns(list(tail), list(generated), list(log_probs))
    if proved is None or proved.token_ids is None:
        return  # not proved: the worker takes the reference path itself
    fast = _outcome(lambda: record_from_trusted_columns(proved, **scalars))
    assert fast == _outcome(reference)
    assert fast[0] == "ok"


def test_ordinary_engine_output_takes_the_proved_delta_build() -> None:
    proved = _record_columns.staging_delta_columns([5, 6], [7, 8, 9], [-0.5, -0.25, -1 / 3])
    assert proved is not None and proved.token_ids == [5, 6, 7, 8, 9]
    assert proved.token_mask == [0.0, 0.0, 1.0, 1.0, 1.0]
    assert proved.log_probs == [0.0, 0.0, -0.5, -0.25, -1 / 3]
    record = record_from_trusted_columns(
        proved, **{**components(), "extras": None, "extras_digest": EMPTY_EXTRAS_DIGEST, "delta_len": None}
    )
    assert record.delta_len == 5 and record.cum_len == 8
    assert record.digest == public_digest(record)
    assert _record_columns.staging_delta_columns([], [], []) is None  # an empty delta: the reference path raises
    assert _record_columns.staging_delta_columns([1], [2], [1]) is None  # an int log-prob is not an exact float
