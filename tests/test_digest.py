"""The v2 digest contract (contract §4) and ``build_staging_delta`` (§5.4)."""

from __future__ import annotations

import hashlib
import math
import struct
import types
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sink.contract.digest import (
    EMPTY_EXTRAS_DIGEST,
    build_staging_delta,
    chain_hash_of_packed,
    check_mask_values,
    compute_chain_hash,
    compute_extras_digest,
    compute_staging_digest,
    encode_f32s,
    encode_token_ids,
    hash_packed_token_ids,
    hash_token_ids,
    is_digest_hex,
    is_token_id_list,
)
from tests.helpers.contract_examples import GOLDEN_VECTOR, root_staged_wire
from tests.helpers.param_ids import stable_repr

FLOAT32_MAX = float(np.finfo(np.float32).max)
# Above the midpoint between FLOAT32_MAX and 2**128: rounds to inf in binary32.
ROUNDS_TO_F32_INF = 3.4028236e38
U64_LIMIT = 2**64


def _sha(domain: bytes, payload: bytes) -> str:
    return hashlib.sha256(domain + payload).hexdigest()


def _ids(seq: list[int]) -> bytes:
    return struct.pack(f">Q{len(seq)}Q", len(seq), *seq)


def _root_fields(**overrides: Any) -> dict[str, Any]:
    fields = root_staged_wire()
    del fields["digest"]
    fields.update(overrides)
    return fields


# --- §4.8 golden vector and check values ------------------------------------


def test_golden_vector_extras_digest() -> None:
    assert compute_extras_digest(GOLDEN_VECTOR["extras"]) == GOLDEN_VECTOR["extras_digest"]
    assert GOLDEN_VECTOR["extras_digest"] == "032024e899456be6e9a78c6d0399c5112d2ca7fa18d4ea9cf0d8cb7d0094f3a3"


def test_golden_vector_call_digest() -> None:
    assert compute_staging_digest(**GOLDEN_VECTOR["staged_call"]) == GOLDEN_VECTOR["staged_call_digest"]
    assert GOLDEN_VECTOR["staged_call_digest"] == "1122c7fe7e914c809eb9b1c09b26d94a50c1eb2790e7430fbcd8363b846ccf27"


ROOT_C1 = {
    "rollout_id": "rollout-1",
    "model_call_id": "c1",
    "token_ids_delta": [10, 11, 12],
    "weight_version": 7,
    "generation_log_probs_delta": [0.0, 0.0, -0.25],
}
CHILD_C2 = {
    "rollout_id": "rollout-1",
    "model_call_id": "c2",
    "parent_call_id": "c1",
    "mode": "token_in",
    "prev_len": 3,
    "delta_len": 4,
    "cum_len": 7,
    "weight_version": 7,
    "token_ids_delta": [20, 21, 22, 23],
    "token_mask_delta": [0.0, 0.0, 1.0, 1.0],
    "generation_log_probs_delta": [0.0, 0.0, -0.3, -0.4],
    "chain_hash": "5ca11828ba5b13cb84473842daeec0b7b88f2d1b31435509de0d3c2fc7607f70",
    "cumulative_hash": "3918f976cd9824c692b3fe34ef047dd276d49af97ec8f86154ef43b345beb4d8",
}


def test_check_value_hashes() -> None:
    assert hash_token_ids([]) == "17088fc6f8fd317bf02bd83e106f7ca2dfb7b9cfc63927c2387d4c87f29578ef"
    assert hash_token_ids([10, 11, 12]) == "21c8e66807865ae05ca6f5bca40bd4a1399a66c23fb9848216a23c2ab9d9858f"
    assert compute_chain_hash(None, [10, 11, 12]) == "14c5e45c969e9b8b821f302201ad9d9b6b4f7427ac18dab2cb150af8e3acdd65"
    c1_chain = compute_chain_hash(None, [10, 11, 12])
    assert compute_chain_hash(c1_chain, [20, 21, 22, 23]) == CHILD_C2["chain_hash"]
    assert hash_token_ids([10, 11, 12, 20, 21, 22, 23]) == CHILD_C2["cumulative_hash"]


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        (_root_fields(**ROOT_C1), "8af9f9ca6164804ce4624f3ac42478714694b25bcd861d96611c71f5cb15ca93"),
        (
            _root_fields(**ROOT_C1, token_mask_delta=[-0.0, 0.0, 1.0]),
            "bd73225d06410cb7e99d5752c1fd80652f1287e68186a53091ea988d908a8d2c",
        ),
        (_root_fields(**CHILD_C2), "34c30a3b94fa73ed21ade56db0c8ecebe2b92b842b6d02e0b8c4146e9f0b1847"),
    ],
    ids=["root-c1", "root-c1-negative-zero-mask", "child-c2"],
)
def test_check_value_call_digests(fields: dict[str, Any], expected: str) -> None:
    assert compute_staging_digest(**fields) == expected


WORKED_EXAMPLE = [
    # call, parent, weight, ids, generated log-prob, chain, cumulative, digest (contract §8.3)
    (
        "root",
        None,
        3,
        [10, 11, 12],
        -0.1,
        "14c5e45c969e9b8b821f302201ad9d9b6b4f7427ac18dab2cb150af8e3acdd65",
        "21c8e66807865ae05ca6f5bca40bd4a1399a66c23fb9848216a23c2ab9d9858f",
        "654f4806694c45a7637bb96cbfe0beb51f82d481f20202f7f7997aca27f0f7bb",
    ),
    (
        "main",
        "root",
        4,
        [20, 21],
        -0.2,
        "2d5351859ece5a943589e66aeb89296664dae4b8484f106e6ff9060d7635e62a",
        "d44975e73aacb27985764338375207755e90423680439a3b6e4046c7d9dded07",
        "685728ed4a9104f5a12d40d1adbb645a0485fcb0f87e1d9223ae4e48eff3cfcb",
    ),
    (
        "side",
        "root",
        99,
        [30, 31],
        -0.5,
        "91af6c7a5cbbfa8a468e62d8fdc4d28c71881b1491600d6e77ed6e847d3d061d",
        "d1b40fe139cb31812fe8551ca534701010d8910ea21e4591f34ad3d73ad748c6",
        "e376e640b45b736c42be309ecd8145efba378972ef2bcab766c02e6e948e67a1",
    ),
]


@pytest.mark.parametrize(("call", "parent", "weight", "ids", "lp", "chain", "cumulative", "digest"), WORKED_EXAMPLE)
def test_worked_example_digests(
    call: str, parent: str | None, weight: int, ids: list[int], lp: float, chain: str, cumulative: str, digest: str
) -> None:
    root_ids = [10, 11, 12]
    parent_chain = None if parent is None else compute_chain_hash(None, root_ids)
    full = ids if parent is None else root_ids + ids
    prev_len = 0 if parent is None else 3
    carry = len(ids) - 1
    assert compute_chain_hash(parent_chain, ids) == chain
    assert hash_token_ids(full) == cumulative
    fields = _root_fields(
        model_call_id=call,
        parent_call_id=parent,
        mode="text" if parent is None else "token_in",
        prev_len=prev_len,
        delta_len=len(ids),
        cum_len=prev_len + len(ids),
        weight_version=weight,
        token_ids_delta=ids,
        token_mask_delta=[0.0] * carry + [1.0],
        generation_log_probs_delta=[0.0] * carry + [lp],
        chain_hash=chain,
        cumulative_hash=cumulative,
    )
    assert compute_staging_digest(**fields) == digest


def test_empty_extras_digest() -> None:
    assert EMPTY_EXTRAS_DIGEST == "a1edc33c107616cf344faf0103daa025cfb125f8e1c784ae5f6a49faf2b768b6"
    assert compute_extras_digest(None) == EMPTY_EXTRAS_DIGEST
    assert EMPTY_EXTRAS_DIGEST == _sha(b"nemo-gym-staging-extras-v1", b"\x01N")
    empty_dict = "1fd859b283c766e508af525e02edd53f1861163b644f36caccdb8b2316f52e77"
    assert compute_extras_digest({}) == empty_dict != EMPTY_EXTRAS_DIGEST


# --- §4.3 call digest pre-checks ---------------------------------------------

BAD_HEX = ["A" * 64, "a" * 63, "a" * 65, "0x" + "a" * 62, "g" * 64, "a" * 64 + "\n", "", None, b"a" * 64]


@pytest.mark.parametrize(
    "overrides",
    [
        {"schema_version": 3},
        {"schema_version": 1},
        {"schema_version": True},
        {"schema_version": 2.0},
        {"schema_version": "2"},
        {"digest_version": 1},
        {"digest_version": 3},
        {"digest_version": 2.0},
        {"extras_digest_version": 2},
        {"extras_digest_version": 0},
        {"extras_digest_version": True},
        {"extras_digest_version": 1.0},
        {"rollout_id": ""},
        {"model_call_id": ""},
        {"parent_call_id": ""},
        {"parent_call_id": "", "mode": "token_in", "prev_len": 1, "cum_len": 4},
        {"mode": "chat"},
        {"mode": "TEXT"},
        {"prev_len": 1, "cum_len": 4},
        {"mode": "token_in"},
        {"parent_call_id": "p"},
        {"parent_call_id": "p", "prev_len": 2, "cum_len": 5},
        {"delta_len": 0, "cum_len": 0, "token_ids_delta": [], "token_mask_delta": [], "generation_log_probs_delta": []},
        {"delta_len": 2, "cum_len": 2},
        {"delta_len": 4, "cum_len": 4},
        {"token_mask_delta": [0.0, 1.0]},
        {"generation_log_probs_delta": [0.0, -0.1]},
        {"token_mask_delta": [0.0, 0.0, 1.0, 1.0]},
        {"token_mask_delta": [0.0, 0.5, 1.0]},
        {"token_mask_delta": [0.0, 0.0, 2.0]},
        {"generation_log_probs_delta": [0.0, -0.1, -0.1]},
        {"cum_len": 4},
        {"cum_len": 2},
        *({"extras_digest": bad} for bad in BAD_HEX),
        *({"chain_hash": bad} for bad in BAD_HEX),
        *({"cumulative_hash": bad} for bad in BAD_HEX),
        {"weight_version": -1},
        {"weight_version": True},
        {"weight_version": 1.0},
        {"weight_version": U64_LIMIT},
        {"prev_len": True, "cum_len": 4},
        {"cum_len": 3.0},
        {"token_ids_delta": [10, 11, -1]},
        {"token_ids_delta": [10, 11, True]},
        {"token_ids_delta": [10, 11, 12.0]},
        {"token_ids_delta": [10, 11, U64_LIMIT]},
        {"token_mask_delta": [0, 0, 1]},
        {"token_mask_delta": [False, False, True]},
        {"token_mask_delta": [0.0, 0.0, np.float64(1.0)]},
        {"generation_log_probs_delta": [0.0, 0.0, np.float32(-0.1)]},
        {"generation_log_probs_delta": [0.0, 0.0, -1]},
        {"generation_log_probs_delta": [0.0, 0.0, math.nan]},
        {"generation_log_probs_delta": [0.0, 0.0, math.inf]},
        {"generation_log_probs_delta": [0.0, 0.0, -math.inf]},
        {"generation_log_probs_delta": [0.0, 0.0, -ROUNDS_TO_F32_INF]},
        {"generation_log_probs_delta": [0.0, 0.0, -1e39]},
    ],
    ids=stable_repr,
)
def test_call_digest_precheck_raises_value_error(overrides: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        compute_staging_digest(**_root_fields(**overrides))


@pytest.mark.parametrize("field", ["rollout_id", "model_call_id", "parent_call_id"])
@pytest.mark.parametrize("value", [5, b"r1", ["r1"]])
def test_call_digest_non_str_text_raises_type_error(field: str, value: object) -> None:
    overrides: dict[str, Any] = {field: value}
    if field == "parent_call_id":
        overrides |= {"mode": "token_in", "prev_len": 1, "cum_len": 4}
    with pytest.raises(TypeError):
        compute_staging_digest(**_root_fields(**overrides))


@pytest.mark.parametrize(
    ("overrides", "changes"),
    [
        ({"weight_version": U64_LIMIT - 1}, True),
        ({"weight_version": 0}, True),
        ({"token_ids_delta": [0, U64_LIMIT - 1, 12]}, True),
        ({"generation_log_probs_delta": [0.0, 0.0, -FLOAT32_MAX]}, True),
        ({"generation_log_probs_delta": [0.0, 0.0, 1e-45]}, True),  # rounds to the smallest subnormal
        ({"generation_log_probs_delta": [0.0, 0.0, -0.1 + 2**-40]}, False),  # same binary32 as -0.1
        ({"generation_log_probs_delta": [-0.0, 0.0, -0.1]}, True),  # carry -0.0 passes, encodes differently
        ({"token_mask_delta": [0.0, -0.0, 1.0]}, True),
    ],
    ids=stable_repr,
)
def test_call_digest_accepted_edge_values(overrides: dict[str, Any], changes: bool) -> None:
    base = compute_staging_digest(**_root_fields())
    assert (compute_staging_digest(**_root_fields(**overrides)) != base) is changes


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_binary32_range_edge(sign: float) -> None:
    # The largest binary32 passes; a float64 that rounds to inf in binary32 fails.
    assert is_digest_hex(
        compute_staging_digest(**_root_fields(generation_log_probs_delta=[0.0, 0.0, sign * FLOAT32_MAX]))
    )
    with pytest.raises(ValueError):
        compute_staging_digest(**_root_fields(generation_log_probs_delta=[0.0, 0.0, sign * ROUNDS_TO_F32_INF]))


@settings(max_examples=60, deadline=None)
@given(st.floats(width=32, allow_nan=False, allow_infinity=False).filter(bool))
def test_float64_values_rounding_to_one_binary32_share_a_digest(value: float) -> None:
    # One float64 ulp towards zero from a binary32 value is far below half a
    # binary32 ulp, so both round to the same binary32.
    neighbour = math.nextafter(value, 0.0)
    assert neighbour != value
    assert struct.pack(">f", neighbour) == struct.pack(">f", value)
    first = compute_staging_digest(**_root_fields(generation_log_probs_delta=[0.0, 0.0, value]))
    second = compute_staging_digest(**_root_fields(generation_log_probs_delta=[0.0, 0.0, neighbour]))
    assert first == second


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_distinct_binary32_values_give_distinct_digests(data: st.DataObject) -> None:
    finite32 = st.floats(width=32, allow_nan=False, allow_infinity=False)
    first = data.draw(finite32)
    second = data.draw(finite32.filter(lambda v: struct.pack(">f", v) != struct.pack(">f", first)))
    digests = {
        compute_staging_digest(**_root_fields(generation_log_probs_delta=[0.0, 0.0, v])) for v in (first, second)
    }
    assert len(digests) == 2


def test_call_digest_layout_reproduced_independently() -> None:
    fields = _root_fields()

    def text(s: str) -> bytes:
        raw = s.encode()
        return struct.pack(">Q", len(raw)) + raw

    def lp(b: bytes) -> bytes:
        return struct.pack(">Q", len(b)) + b

    def f32s(seq: list[float]) -> bytes:
        return struct.pack(f">Q{len(seq)}f", len(seq), *seq)

    payload = b"".join(
        [
            bytes([2, 2, 1]),
            text("r1"),
            text("root"),
            b"\x00",
            text("text"),
            struct.pack(">4Q", 0, 3, 3, 3),
            lp(_ids([10, 11, 12])),
            lp(f32s([0.0, 0.0, 1.0])),
            lp(f32s([0.0, 0.0, -0.1])),
            bytes.fromhex(EMPTY_EXTRAS_DIGEST),
            b"\x01" + bytes.fromhex(fields["chain_hash"]),
            b"\x01" + bytes.fromhex(fields["cumulative_hash"]),
        ]
    )
    assert compute_staging_digest(**fields) == _sha(b"nemo-gym-staging-call-v2", payload)


# --- §4.4 / §4.5 cumulative and chain hashes ---------------------------------


@settings(max_examples=40, deadline=None)
@given(st.lists(st.lists(st.integers(0, U64_LIMIT - 1), max_size=6), min_size=1, max_size=4))
def test_chain_hash_links_each_delta_to_its_parent(deltas: list[list[int]]) -> None:
    running: str | None = None
    for delta in deltas:
        prefix = b"\x00" if running is None else b"\x01" + bytes.fromhex(running)
        expected = _sha(b"nemo-gym-staging-chain-v1", prefix + _ids(delta))
        running = compute_chain_hash(running, delta)
        assert running == expected
    flat = [t for delta in deltas for t in delta]
    assert hash_token_ids(flat) == _sha(b"nemo-gym-staging-prefix-v2", _ids(flat))
    assert encode_token_ids(flat) == _ids(flat)


def test_chain_hash_depends_on_parent() -> None:
    root = compute_chain_hash(None, [1])
    assert compute_chain_hash(root, [2]) != compute_chain_hash(None, [2])
    assert compute_chain_hash(root, [2]) != compute_chain_hash(compute_chain_hash(None, [9]), [2])


@pytest.mark.parametrize("parent", [p for p in BAD_HEX if p is not None])
def test_chain_hash_rejects_invalid_parent(parent: object) -> None:
    with pytest.raises(ValueError):
        compute_chain_hash(parent, [1])  # type: ignore[arg-type]


@pytest.mark.parametrize("ids", [[-1], [True], [1.0], [U64_LIMIT], ["1"], [np.int64(1)]], ids=stable_repr)
def test_token_id_encoding_rejects(ids: list[Any]) -> None:
    with pytest.raises(ValueError):
        hash_token_ids(ids)
    with pytest.raises(ValueError):
        compute_chain_hash(None, ids)


# --- §4.6 extras digest ------------------------------------------------------


def test_extras_encoding_reproduced_independently() -> None:
    def text(s: str) -> bytes:
        return struct.pack(">Q", len(s.encode())) + s.encode()

    value = {"b": [None, True, False, -1, 1.5, "x"], "a": {"k": 2**63 - 1}}
    encoded = (
        b"D" + struct.pack(">Q", 2)
        + text("a") + b"D" + struct.pack(">Q", 1) + text("k") + b"I" + struct.pack(">q", 2**63 - 1)
        + text("b") + b"L" + struct.pack(">Q", 6)
        + b"N" + b"B\x01" + b"B\x00" + b"I" + struct.pack(">q", -1) + b"F" + struct.pack(">d", 1.5) + b"S" + text("x")
    )  # fmt: skip
    assert compute_extras_digest(value) == _sha(b"nemo-gym-staging-extras-v1", b"\x01" + encoded)


@pytest.mark.parametrize(
    ("left", "right"),
    [
        ({"a": True}, {"a": 1}),
        ({"a": False}, {"a": 0}),
        ({"a": 1}, {"a": 1.0}),
        ({"a": 0.0}, {"a": -0.0}),
        ({"a": None}, {}),
        ({"a": "1"}, {"a": 1}),
        ({"a": []}, {"a": {}}),
        ({"a": [1, 2]}, {"a": [2, 1]}),
        ({"a": 1}, {"b": 1}),
    ],
    ids=stable_repr,
)
def test_extras_encoding_distinguishes(left: dict[str, Any], right: dict[str, Any]) -> None:
    assert compute_extras_digest(left) != compute_extras_digest(right)


@settings(max_examples=40, deadline=None)
@given(st.dictionaries(st.text(max_size=4), st.integers(-(2**63), 2**63 - 1), max_size=6), st.randoms())
def test_extras_key_order_is_irrelevant(value: dict[str, int], rng: Any) -> None:
    items = list(value.items())
    rng.shuffle(items)
    assert compute_extras_digest(dict(items)) == compute_extras_digest(value)
    assert compute_extras_digest({"n": dict(items)}) == compute_extras_digest({"n": value})


class _ReadOnlyMapping(Mapping[str, Any]):
    def __init__(self, data: dict[str, Any]) -> None:
        self._data = data

    def __getitem__(self, key: str) -> Any:
        return self._data[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)


@pytest.mark.parametrize("wrap", [types.MappingProxyType, _ReadOnlyMapping], ids=["proxy", "custom"])
def test_extras_top_level_mapping_is_accepted(wrap: Any) -> None:
    extras = GOLDEN_VECTOR["extras"]
    assert compute_extras_digest(wrap(extras)) == GOLDEN_VECTOR["extras_digest"]


class _IntSubclass(int):
    pass


class _StrSubclass(str):
    __slots__ = ()


class _DictSubclass(dict[str, Any]):
    pass


@pytest.mark.parametrize(
    "value",
    [
        (1, 2),
        b"raw",
        bytearray(b"raw"),
        {1, 2},
        np.int64(1),
        np.float64(1.0),
        np.bool_(True),
        np.array([1, 2]),
        _IntSubclass(1),
        _StrSubclass("s"),
        _DictSubclass(a=1),
        [1, (2,)],
        {"nested": {"deep": b"x"}},
        object(),
        1j,
    ],
    ids=stable_repr,
)
def test_extras_unsupported_values_raise_type_error(value: object) -> None:
    with pytest.raises(TypeError):
        compute_extras_digest({"v": value})


@pytest.mark.parametrize("key", [1, b"k", None, ("k",), _StrSubclass("k"), 1.0, True])
def test_extras_non_str_keys_raise_type_error(key: object) -> None:
    with pytest.raises(TypeError):
        compute_extras_digest({key: 1})  # type: ignore[dict-item]
    with pytest.raises(TypeError):
        compute_extras_digest({"outer": {key: 1}})


@pytest.mark.parametrize("extras", [[], [("a", 1)], "a", 1, ("a",), b"", object()], ids=stable_repr)
def test_extras_top_level_must_be_none_or_mapping(extras: object) -> None:
    with pytest.raises(TypeError):
        compute_extras_digest(extras)  # type: ignore[arg-type]


@pytest.mark.parametrize("value", [2**63, -(2**63) - 1, math.nan, math.inf, -math.inf], ids=stable_repr)
def test_extras_out_of_range_values_raise_value_error(value: object) -> None:
    with pytest.raises(ValueError):
        compute_extras_digest({"v": value})
    with pytest.raises(ValueError):
        compute_extras_digest({"v": [[value]]})


def test_extras_int64_bounds_are_accepted() -> None:
    assert compute_extras_digest({"v": 2**63 - 1}) != compute_extras_digest({"v": -(2**63)})


# --- helpers ------------------------------------------------------------------


def test_encode_f32s_layout_and_rejections() -> None:
    assert encode_f32s([1.0, -0.0, -0.25]) == struct.pack(">Q3f", 3, 1.0, -0.0, -0.25)
    assert encode_f32s([]) == struct.pack(">Q", 0)
    for bad in ([1], [True], [np.float64(1.0)], [math.nan], [math.inf], [ROUNDS_TO_F32_INF]):
        with pytest.raises(ValueError):
            encode_f32s(bad)


@pytest.mark.parametrize(
    ("masks", "log_probs", "ok"),
    [
        ([0.0, 1.0], [0.0, -3.0], True),
        ([-0.0, 1.0], [-0.0, -3.0], True),
        ([0.0, 0.5], [0.0, -3.0], False),
        ([0.0, 1.0], [-1e-9, -3.0], False),
        ([math.nan], [0.0], False),
    ],
)
def test_check_mask_values(masks: list[float], log_probs: list[float], ok: bool) -> None:
    if ok:
        check_mask_values(masks, log_probs)
    else:
        with pytest.raises(ValueError):
            check_mask_values(masks, log_probs)


def test_is_digest_hex() -> None:
    assert is_digest_hex("0123456789abcdef" * 4)
    assert not any(is_digest_hex(bad) for bad in BAD_HEX)


# --- §5.4 build_staging_delta --------------------------------------------------


def test_build_staging_delta_contract_example() -> None:
    ids, mask, logprobs = build_staging_delta([1, 2, 3, 4], [5, 6], [-0.5, -0.25], 2)
    assert (ids, mask, logprobs) == ([3, 4, 5, 6], [0.0, 0.0, 1.0, 1.0], [0.0, 0.0, -0.5, -0.25])
    assert all(type(v) is float for v in mask + logprobs)


@pytest.mark.parametrize(
    ("prompt", "generated", "logprobs", "prev_len", "expected"),
    [
        ([1, 2], [3], [-1.0], 2, ([3], [1.0], [-1.0])),
        ([1, 2], [], [], 0, ([1, 2], [0.0, 0.0], [0.0, 0.0])),
        ([], [7], [-0.5], 0, ([7], [1.0], [-0.5])),
    ],
)
def test_build_staging_delta_edges(
    prompt: list[int], generated: list[int], logprobs: list[float], prev_len: int, expected: tuple[Any, ...]
) -> None:
    assert build_staging_delta(prompt, generated, logprobs, prev_len) == expected


@pytest.mark.parametrize(
    ("prompt", "generated", "logprobs", "prev_len"),
    [
        ([1, 2], [3], [-1.0], -1),
        ([1, 2], [3], [-1.0], 3),
        ([1, 2], [3, 4], [-1.0], 0),
        ([1, 2], [3], [], 0),
        ([1, 2], [], [], 2),
        ([], [], [], 0),
    ],
)
def test_build_staging_delta_errors(
    prompt: list[int], generated: list[int], logprobs: list[float], prev_len: int
) -> None:
    with pytest.raises(ValueError):
        build_staging_delta(prompt, generated, logprobs, prev_len)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.integers(min_value=0, max_value=2**31 - 1),
            st.integers(min_value=-(2**70), max_value=2**70),
            st.booleans(),
        ),
        max_size=40,
    )
)
def test_encode_token_ids_fast_path_matches_the_reference(values: list[Any]) -> None:
    """The marshal fast path and the reference encoding agree, including on what they reject."""
    valid = all(type(v) is int and 0 <= v < 2**64 for v in values)
    if valid:
        expected = struct.pack(">Q", len(values)) + b"".join(struct.pack(">Q", v) for v in values)
        assert encode_token_ids(values) == expected
        assert is_token_id_list(values) == all(v < 2**31 for v in values)
    else:
        with pytest.raises(ValueError):
            encode_token_ids(values)
        assert not is_token_id_list(values)


@settings(max_examples=200, deadline=None)
@given(
    parent=st.one_of(st.none(), st.binary(min_size=32, max_size=32).map(bytes.hex)),
    pieces=st.lists(st.lists(st.integers(min_value=0, max_value=2**64 - 1), max_size=12), max_size=4),
)
def test_packed_chain_and_cumulative_hashes_are_the_list_hashes(parent: str | None, pieces: list[list[int]]) -> None:
    """The chain and cumulative hashes have one definition (contract §4.4-§4.5): the packed entry points the
    worker, the prefix resolver and the verifier use on u64 big-endian ids equal the list ones, piece by piece."""
    ids = [token_id for piece in pieces for token_id in piece]
    parts = [b"".join(struct.pack(">Q", token_id) for token_id in piece) for piece in pieces]
    assert hash_packed_token_ids(parts, len(ids)) == hash_token_ids(ids)
    assert chain_hash_of_packed(parent, b"".join(parts)) == compute_chain_hash(parent, ids)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (True, "expected an int for a u64 field, got bool"),
        (2.0, "expected an int for a u64 field, got float"),
        ("2", "expected an int for a u64 field, got str"),
        (-1, "u64 field out of range: -1"),
        (2**64, f"u64 field out of range: {2**64}"),
    ],
)
def test_encode_u64_refuses_what_a_u64_field_cannot_carry(value: object, message: str) -> None:
    from sink.contract.digest_encoding import encode_u64

    with pytest.raises(ValueError) as caught:
        encode_u64(value)
    assert str(caught.value) == message


def test_encode_u64_packs_the_whole_range() -> None:
    from sink.contract.digest_encoding import encode_u64

    assert encode_u64(0) == bytes(8)
    assert encode_u64(2**64 - 1) == b"\xff" * 8
