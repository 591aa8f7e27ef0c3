"""The packed decode path (``decode_packed_record``) accepts exactly what ``decode_record`` accepts, with equal values."""

from __future__ import annotations

import math
import struct
from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sink.contract._packed.floats import MASK_CODES, mask_values_from_codes
from sink.contract.codec import decode_packed_record, decode_record, encode_record
from sink.contract.packed import SCALAR_NAMES, PackedSnapshot
from sink.contract.records import StagedCallRecord
from sink.errors import CodecError
from tests.helpers.codec import HEX, SETTINGS, exact, record_of, repack, small_blob, staged_records


def _decoded(decode: Any, blob: bytes) -> tuple[str, Any]:
    """What a decoder makes of *blob*: the values it returns (columns as lists), or that it raised CodecError."""
    try:
        snapshot = decode(blob)
    except CodecError:
        return ("rejected", None)
    columns = {
        name: exact(getattr(snapshot, name))
        for name in ("token_ids_delta", "token_mask_delta", "generation_log_probs_delta")
    }
    scalars = {name: exact(getattr(snapshot, name)) for name in ("rollout_id", "digest", "extras", "cum_len")}
    return ("accepted", (columns, scalars))


def assert_same_outcome(blob: bytes) -> None:
    reference = _decoded(decode_record, blob)
    assert _decoded(decode_packed_record, blob) == reference
    if reference[0] == "accepted":
        packed = decode_packed_record(blob)
        assert type(packed) is PackedSnapshot
        assert packed.to_snapshot() == decode_record(blob)


@SETTINGS
@given(staged_records())
def test_packed_decode_returns_the_same_values(record: StagedCallRecord) -> None:
    assert_same_outcome(encode_record(record))


def test_every_single_byte_flip_gets_the_same_verdict_from_both_decoders() -> None:
    _, blob = small_blob()
    for position in range(len(blob)):
        for flip in (0x01, 0x80, 0xFF):
            tampered = bytearray(blob)
            tampered[position] ^= flip
            assert_same_outcome(bytes(tampered))


def _column_edits() -> list[tuple[str, Any]]:
    def set_key(key: str, value: Any) -> Any:
        def edit(obj: dict[str, Any]) -> None:
            obj[key] = value

        return edit

    return [
        ("carry log-prob not zero", set_key("log_probs", b"\x00\x00\x80\xbf" + bytes(4) * 2)),
        ("mask code invalid", set_key("mask", b"\x00\x3f\x01")),
        ("log-prob infinite", set_key("log_probs", bytes(4) + b"\x00\x00\x80\x7f" + bytes(4))),
        ("log-prob nan", set_key("log_probs", bytes(4) + b"\x00\x00\xc0\x7f" + bytes(4))),
        ("ids column short", set_key("ids", bytes(8))),
        ("rollout id empty", set_key("rollout_id", "")),
        ("digest upper case", lambda obj: obj.update(digest=obj["digest"].upper())),
        ("extras not a map", set_key("extras", [1])),
        ("extras changed", set_key("extras", {"a": 2})),
        ("version bool", set_key("schema_version", True)),
        ("prev_len negative", set_key("prev_len", -1)),
    ]


@pytest.mark.parametrize(("what", "edit"), _column_edits(), ids=[name for name, _ in _column_edits()])
def test_a_broken_blob_is_rejected_by_both_decoders(what: str, edit: Any) -> None:
    record = record_of([7, 8, 9], [0.0, 1.0, 1.0], [0.0, -0.5, -0.25], extras={"a": 1})
    tampered = repack(encode_record(record), edit)
    with pytest.raises(CodecError):
        decode_record(tampered)
    with pytest.raises(CodecError):
        decode_packed_record(tampered)


@pytest.mark.parametrize(
    ("mask", "log_probs"),
    [
        ([0.0, 1.0, 0.0, 1.0], [0.0, -0.5, 0.0, -0.25]),  # interleaved: not provable on bytes, reference path
        ([0.0, 1.0, 1.0, 1.0], [0.0, 0.1, -0.3, -1e-40]),  # float64 column: reference path, exact values kept
        ([-0.0, 0.0, 1.0, 1.0], [-0.0, 0.0, -0.5, -0.25]),  # signed zeros survive
        ([0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]),  # all carry: a valid record
    ],
)
def test_shapes_outside_the_byte_proof_fall_back_and_keep_exact_values(
    mask: list[float], log_probs: list[float]
) -> None:
    record = record_of([1, 2, 3, 2**40], mask, log_probs)
    blob = encode_record(record)
    assert_same_outcome(blob)
    packed = decode_packed_record(blob)
    assert exact(packed.generation_log_probs_delta) == exact(record.generation_log_probs_delta)
    assert exact(packed.token_mask_delta) == exact(record.token_mask_delta)


def test_a_packed_snapshot_is_immutable() -> None:
    _, blob = small_blob()
    packed = decode_packed_record(blob)
    with pytest.raises(AttributeError):
        packed.digest = "0" * 64  # type: ignore[misc]


@settings(max_examples=60, deadline=None)
@given(st.binary(max_size=300))
def test_random_bytes_get_the_same_verdict(data: bytes) -> None:
    assert_same_outcome(data)
    _, blob = small_blob()
    assert_same_outcome(blob[: len(data) % len(blob)] + data)


def test_oversize_and_wrong_types_raise_like_the_reference() -> None:
    _, blob = small_blob()
    with pytest.raises(CodecError):
        decode_packed_record(blob, max_record_bytes=len(blob) - 1)
    with pytest.raises(TypeError):
        decode_packed_record("text")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        decode_packed_record(blob, max_record_bytes=0)
    assert msgpack.unpackb(blob)["v"] == 1


def test_the_usual_shape_is_proved_on_the_bytes_without_the_reference_decode(monkeypatch: pytest.MonkeyPatch) -> None:
    import sink.contract.codec

    def no_reference_decode(blob: Any) -> Any:
        raise AssertionError("the reference decode ran")

    record, blob = small_blob()
    monkeypatch.setattr(sink.contract.codec, "_snapshot", no_reference_decode)
    packed = decode_packed_record(blob)
    assert packed.digest == record.digest
    assert exact(packed.token_ids_delta) == exact(record.token_ids_delta)


@settings(max_examples=80, deadline=None)
@given(st.sampled_from([4, 8]), st.integers(0, 700), st.randoms(use_true_random=False))
def test_numpy_and_plain_id_widening_agree(width: int, length: int, rng: Any) -> None:
    from sink.contract._packed.ids import ids_u64be, ids_u64be_plain

    ids_le = rng.randbytes(width * length)
    assert ids_u64be(ids_le, width, length) == ids_u64be_plain(ids_le, width, length)
    assert len(ids_u64be_plain(ids_le, width, length)) == 8 * length


# --- the mask and float primitives equal their reference formulas ------------------------------

mask_codes = st.lists(st.sampled_from(b"\x00\x80\x3f"), max_size=300).map(bytes)


def _runs_of_codes() -> st.SearchStrategy[bytes]:
    """Codes as runs (carry zeros, minus zeros, generated), the shapes the fast paths look for."""
    run = st.tuples(st.sampled_from(b"\x00\x80\x3f"), st.integers(0, 5000))
    return st.lists(run, max_size=4).map(lambda runs: b"".join(bytes([code]) * n for code, n in runs))


def _reference_carry_prefix(codes: bytes) -> int | None:
    carry = len(codes) - codes.count(0x3F)
    return carry if carry == len(codes) or codes.find(0x3F) == carry else None


@settings(max_examples=300, deadline=None)
@given(st.one_of(mask_codes, _runs_of_codes(), st.binary(max_size=64)))
def test_carry_prefix_and_the_usual_shape_equal_the_counting_reference(codes: bytes) -> None:
    from sink.contract._packed.floats import carry_prefix, mask_f32be, mask_pieces, usual_mask_carry
    from sink.contract.packed import PackedColumns
    from sink.trainer.rebuild import _mask_counts

    carry = carry_prefix(codes)
    assert carry == _reference_carry_prefix(codes)
    usual = carry if carry is not None and codes.count(0) == carry else None
    assert usual_mask_carry(codes) == usual
    if not codes.translate(None, MASK_CODES):
        assert b"".join(mask_pieces(codes, carry)) == mask_f32be(codes)
        columns = PackedColumns(length=len(codes), mask_codes=codes, lp_f32be=bytes(4 * len(codes)), lp_f32_exact=True)
        generated = codes.count(0x3F)
        assert _mask_counts(columns) == (len(codes) - generated, generated, codes.find(0x3F))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(st.binary(min_size=4, max_size=4), st.floats(width=32).map(lambda v: struct.pack("<f", v)))))
def test_finite_f32le_is_exactly_every_value_finite(values: list[bytes]) -> None:
    from sink.contract._packed.floats import finite_f32le

    buf = b"".join(values)
    assert finite_f32le(buf) == all(math.isfinite(v) for v in struct.unpack(f"<{len(values)}f", buf))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(mask_codes, _runs_of_codes().map(lambda codes: codes[:700])), min_size=1, max_size=4))
def test_packed_rows_write_the_masks_their_codes_name(parts_codes: list[bytes]) -> None:
    np = pytest.importorskip("numpy")
    from sink.contract.packed import PackedColumns
    from sink.trainer.row import RowColumns

    parts = [
        PackedColumns(
            length=len(codes),
            ids_width=4,
            ids_le=bytes(4 * len(codes)),
            mask_codes=codes,
            lp_f32be=bytes(4 * len(codes)),
            lp_f32_exact=True,
        )
        for codes in parts_codes
    ]
    value_of_code = {0x00: 0.0, 0x80: -0.0, 0x3F: 1.0}
    expected = [value_of_code[code] for codes in parts_codes for code in codes]
    mask = RowColumns(parts=parts).as_numpy().token_mask
    assert mask.tolist() == expected
    assert np.signbit(mask).tolist() == [math.copysign(1.0, value) < 0 for value in expected]


@settings(max_examples=200, deadline=None)
@given(st.one_of(mask_codes, _runs_of_codes()))
def test_mask_values_from_codes_reads_each_code(codes: bytes) -> None:
    value_of_code = {0x00: 0.0, 0x80: -0.0, 0x3F: 1.0}
    values = mask_values_from_codes(codes)
    assert [(v, math.copysign(1.0, v)) for v in values] == [
        (value_of_code[c], math.copysign(1.0, value_of_code[c])) for c in codes
    ]


# --- a scalar the record refuses is refused on the packed path too, even under a matching digest -------------

scalar_values = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(),
    st.text(max_size=8),
    st.binary(max_size=8),
    HEX,
    HEX.map(str.upper),
    st.lists(st.integers(0, 3), max_size=2),
    st.dictionaries(st.text(max_size=2), st.integers(0, 3), max_size=2),
    st.sampled_from([0, 1, 2, 2.0, "2", "", "text", "token_in", "TEXT", 2**64 - 1, 2**63, "0" * 64 + "\n"]),
)


@settings(max_examples=400, deadline=None)
@given(st.sampled_from(SCALAR_NAMES), scalar_values, st.booleans())
def test_an_edited_scalar_gets_the_same_verdict_from_both_decoders(name: str, value: Any, parentless: bool) -> None:
    from sink.contract._packed.floats import mask_f32be
    from sink.contract.digest import staging_digest_from_packed

    overrides: dict[str, Any] = (
        {"parent_call_id": None, "prev_len": 0, "cum_len": 3, "mode": "text"} if parentless else {}
    )
    record = record_of([7, 8, 9], [0.0, 1.0, 1.0], [0.0, -0.5, -0.25], **overrides)
    blob = encode_record(record)
    packed = decode_packed_record(blob)
    fields = {field: getattr(packed, field) for field in SCALAR_NAMES}
    fields[name] = value
    try:  # sign the edit, so that only the value itself can make the record invalid
        fields["digest"] = staging_digest_from_packed(
            fields, (packed.ids_u64be,), (mask_f32be(packed.columns.mask_codes),), (packed.columns.lp_f32be,)
        )
    except (ValueError, TypeError):
        pass
    if name == "digest":
        fields["digest"] = value

    def edit(obj: dict[str, Any]) -> None:
        obj.update(fields)

    assert_same_outcome(repack(blob, edit))


@settings(max_examples=300, deadline=None)
@given(st.one_of(mask_codes, _runs_of_codes()), st.one_of(mask_codes, _runs_of_codes()))
def test_packed_columns_work_out_the_mask_shape_of_the_codes_they_hold(first: bytes, second: bytes) -> None:
    # The shape is remembered per codes object: the same answers as the functions, and new codes get new answers.
    from sink.contract._packed.floats import carry_prefix, usual_mask_carry
    from sink.contract.packed import PackedColumns

    columns = PackedColumns(length=len(first), mask_codes=first, lp_f32be=bytes(4 * len(first)), lp_f32_exact=True)
    for codes in (first, first, second, first):
        columns.mask_codes, columns.length = codes, len(codes)
        assert columns.carry_length() == carry_prefix(codes)
        assert columns.usual_carry_length() == usual_mask_carry(codes)


_id_parts = st.lists(
    st.tuples(st.sampled_from([4, 8]), st.lists(st.floats(width=32, allow_nan=False), max_size=40)),
    min_size=1,
    max_size=5,
)


@settings(max_examples=200, deadline=None)
@given(_id_parts, st.randoms(use_true_random=False))
def test_packed_rows_write_the_same_columns_as_the_tuples(parts: list[tuple[int, list[float]]], rng: Any) -> None:
    # as_numpy converts every part's ids and log-probabilities in one pass over the parts (widths mixed).
    np = pytest.importorskip("numpy")
    from sink.contract.packed import PackedColumns
    from sink.trainer.row import RowColumns

    packed, ids, log_probs = [], [], []
    for width, values in parts:
        part_ids = [rng.randrange(1 << (8 * width - 1)) for _ in values]
        packed.append(
            PackedColumns(
                length=len(values),
                ids_width=width,
                ids_le=struct.pack(f"<{len(values)}{'I' if width == 4 else 'Q'}", *part_ids),
                mask_codes=b"\x3f" * len(values),
                lp_f32be=struct.pack(f">{len(values)}f", *values),
                lp_f32_exact=True,
            )
        )
        ids += part_ids
        log_probs += values
    columns = RowColumns(parts=packed).as_numpy()
    assert columns.token_ids.dtype == np.int64 and columns.token_ids.tolist() == ids
    assert columns.logprobs.dtype == np.float32
    assert np.signbit(columns.logprobs).tolist() == [math.copysign(1.0, v) < 0 for v in log_probs]
    assert columns.logprobs.tolist() == log_probs
    reference = RowColumns(tuples=(tuple(ids), (1.0,) * len(ids), tuple(log_probs))).as_numpy()
    assert all(np.array_equal(a, b) for a, b in zip(columns, reference, strict=True))


def test_a_packed_row_refuses_an_id_beyond_int64() -> None:
    pytest.importorskip("numpy")
    from sink.contract.packed import PackedColumns
    from sink.trainer.row import RowColumns

    small = PackedColumns(
        length=1, ids_width=4, ids_le=bytes(4), mask_codes=b"\x3f", lp_f32be=bytes(4), lp_f32_exact=True
    )
    huge = PackedColumns(
        length=1,
        ids_width=8,
        ids_le=struct.pack("<Q", 1 << 63),
        mask_codes=b"\x3f",
        lp_f32be=bytes(4),
        lp_f32_exact=True,
    )
    with pytest.raises(OverflowError, match="int64"):
        RowColumns(parts=[small, huge]).as_numpy()
