"""The digests written again from docs/contract.md §4 alone, and checked against its published values.

Nothing here imports the package's digest code except to compare with it: if the document's byte layout
(§4.1-§4.6) were incomplete or wrong, this second implementation would miss the golden vector (§4.8) or the
worked example (§8.3), or disagree with ``sink.contract.digest`` on random inputs.
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from sink.contract.digest import compute_chain_hash, compute_extras_digest, compute_staging_digest, hash_token_ids

GOLDEN = json.loads((Path(__file__).parent / "golden_vector_v2.json").read_text())

# §4.1: every hash is SHA-256 over the ASCII domain followed by the payload.
CALL_DOMAIN = b"nemo-gym-staging-call-v2"
PREFIX_DOMAIN = b"nemo-gym-staging-prefix-v2"
CHAIN_DOMAIN = b"nemo-gym-staging-chain-v1"
EXTRAS_DOMAIN = b"nemo-gym-staging-extras-v1"


def sha(domain: bytes, payload: bytes) -> str:
    return hashlib.sha256(domain + payload).hexdigest()


# §4.2 primitive encodings.
def u8(n: int) -> bytes:
    return bytes([n])


def u64(n: int) -> bytes:
    return struct.pack(">Q", n)


def lp(data: bytes) -> bytes:
    return u64(len(data)) + data


def text(s: str) -> bytes:
    return lp(s.encode("utf-8"))


def opt_text(s: str | None) -> bytes:
    return b"\x00" if s is None else b"\x01" + text(s)


def ids(seq: list[int]) -> bytes:
    return u64(len(seq)) + b"".join(u64(t) for t in seq)


def f32s(seq: list[float]) -> bytes:
    return u64(len(seq)) + b"".join(struct.pack(">f", v) for v in seq)


def hexbytes(h: str) -> bytes:
    return bytes.fromhex(h)


def req_digest(h: str) -> bytes:
    return b"\x01" + hexbytes(h)


# §4.3-§4.5.
def call_digest(f: dict[str, Any]) -> str:
    payload = b"".join(
        (
            u8(f["schema_version"]),
            u8(f["digest_version"]),
            u8(f["extras_digest_version"]),
            text(f["rollout_id"]),
            text(f["model_call_id"]),
            opt_text(f["parent_call_id"]),
            text(f["mode"]),
            u64(f["prev_len"]),
            u64(f["delta_len"]),
            u64(f["cum_len"]),
            u64(f["weight_version"]),
            lp(ids(f["token_ids_delta"])),
            lp(f32s(f["token_mask_delta"])),
            lp(f32s(f["generation_log_probs_delta"])),
            hexbytes(f["extras_digest"]),
            req_digest(f["chain_hash"]),
            req_digest(f["cumulative_hash"]),
        )
    )
    return sha(CALL_DOMAIN, payload)


def prefix_hash(seq: list[int]) -> str:
    return sha(PREFIX_DOMAIN, ids(seq))


def chain_hash(parent: str | None, delta: list[int]) -> str:
    link = b"\x00" if parent is None else b"\x01" + hexbytes(parent)
    return sha(CHAIN_DOMAIN, link + ids(delta))


# §4.6 tagged extras encoding.
def enc(value: object) -> bytes:
    if value is None:
        return b"N"
    if type(value) is bool:
        return b"B" + (b"\x01" if value else b"\x00")
    if type(value) is int:
        return b"I" + struct.pack(">q", value)
    if type(value) is float:
        return b"F" + struct.pack(">d", value)
    if type(value) is str:
        return b"S" + text(value)
    if type(value) is list:
        return b"L" + u64(len(value)) + b"".join(enc(item) for item in value)
    if type(value) is dict:
        keys = sorted(value, key=lambda key: key.encode("utf-8"))
        return b"D" + u64(len(value)) + b"".join(text(key) + enc(value[key]) for key in keys)
    raise TypeError(type(value).__name__)


def extras_digest(extras: dict[str, Any] | None) -> str:
    return sha(EXTRAS_DOMAIN, u8(1) + enc(extras))


# --- the published values ---------------------------------------------------------


def test_golden_vector_from_the_document() -> None:
    assert extras_digest(GOLDEN["extras"]) == GOLDEN["extras_digest"]
    assert call_digest(GOLDEN["staged_call"]) == GOLDEN["staged_call_digest"]


def test_empty_extras_digests_from_the_document() -> None:
    assert extras_digest(None) == "a1edc33c107616cf344faf0103daa025cfb125f8e1c784ae5f6a49faf2b768b6"
    assert extras_digest({}) == "1fd859b283c766e508af525e02edd53f1861163b644f36caccdb8b2316f52e77"


def _root(**overrides: Any) -> dict[str, Any]:
    fields: dict[str, Any] = {
        "schema_version": 2,
        "digest_version": 2,
        "extras_digest_version": 1,
        "rollout_id": "rollout-1",
        "model_call_id": "c1",
        "parent_call_id": None,
        "mode": "text",
        "prev_len": 0,
        "delta_len": 3,
        "cum_len": 3,
        "weight_version": 7,
        "token_ids_delta": [10, 11, 12],
        "token_mask_delta": [0.0, 0.0, 1.0],
        "generation_log_probs_delta": [0.0, 0.0, -0.25],
        "extras_digest": extras_digest(None),
        "chain_hash": chain_hash(None, [10, 11, 12]),
        "cumulative_hash": prefix_hash([10, 11, 12]),
    }
    fields.update(overrides)
    return fields


def test_check_values_of_section_4_8() -> None:
    assert prefix_hash([]) == "17088fc6f8fd317bf02bd83e106f7ca2dfb7b9cfc63927c2387d4c87f29578ef"
    assert prefix_hash([10, 11, 12]) == "21c8e66807865ae05ca6f5bca40bd4a1399a66c23fb9848216a23c2ab9d9858f"
    assert chain_hash(None, [10, 11, 12]) == "14c5e45c969e9b8b821f302201ad9d9b6b4f7427ac18dab2cb150af8e3acdd65"
    root = _root()
    assert call_digest(root) == "8af9f9ca6164804ce4624f3ac42478714694b25bcd861d96611c71f5cb15ca93"
    negative_zero = _root(token_mask_delta=[-0.0, 0.0, 1.0])
    assert call_digest(negative_zero) == "bd73225d06410cb7e99d5752c1fd80652f1287e68186a53091ea988d908a8d2c"
    child_chain = chain_hash(root["chain_hash"], [20, 21, 22, 23])
    child_cumulative = prefix_hash([10, 11, 12, 20, 21, 22, 23])
    assert child_chain == "5ca11828ba5b13cb84473842daeec0b7b88f2d1b31435509de0d3c2fc7607f70"
    assert child_cumulative == "3918f976cd9824c692b3fe34ef047dd276d49af97ec8f86154ef43b345beb4d8"
    child = _root(
        model_call_id="c2",
        parent_call_id="c1",
        mode="token_in",
        prev_len=3,
        delta_len=4,
        cum_len=7,
        token_ids_delta=[20, 21, 22, 23],
        token_mask_delta=[0.0, 0.0, 1.0, 1.0],
        generation_log_probs_delta=[0.0, 0.0, -0.3, -0.4],
        chain_hash=child_chain,
        cumulative_hash=child_cumulative,
    )
    assert call_digest(child) == "34c30a3b94fa73ed21ade56db0c8ecebe2b92b842b6d02e0b8c4146e9f0b1847"


def test_worked_example_of_section_8_3() -> None:
    root = _root(
        rollout_id="r1",
        model_call_id="root",
        weight_version=3,
        generation_log_probs_delta=[0.0, 0.0, -0.1],
    )
    assert call_digest(root) == "654f4806694c45a7637bb96cbfe0beb51f82d481f20202f7f7997aca27f0f7bb"
    expected = {
        "main": (
            [20, 21],
            4,
            -0.2,
            "2d5351859ece5a943589e66aeb89296664dae4b8484f106e6ff9060d7635e62a",
            "d44975e73aacb27985764338375207755e90423680439a3b6e4046c7d9dded07",
            "685728ed4a9104f5a12d40d1adbb645a0485fcb0f87e1d9223ae4e48eff3cfcb",
        ),
        "side": (
            [30, 31],
            99,
            -0.5,
            "91af6c7a5cbbfa8a468e62d8fdc4d28c71881b1491600d6e77ed6e847d3d061d",
            "d1b40fe139cb31812fe8551ca534701010d8910ea21e4591f34ad3d73ad748c6",
            "e376e640b45b736c42be309ecd8145efba378972ef2bcab766c02e6e948e67a1",
        ),
    }
    for call, (delta, weight, log_prob, chain, cumulative, digest) in expected.items():
        assert chain_hash(root["chain_hash"], delta) == chain
        assert prefix_hash([10, 11, 12, *delta]) == cumulative
        fields = _root(
            rollout_id="r1",
            model_call_id=call,
            parent_call_id="root",
            mode="token_in",
            prev_len=3,
            delta_len=2,
            cum_len=5,
            weight_version=weight,
            token_ids_delta=delta,
            token_mask_delta=[0.0, 1.0],
            generation_log_probs_delta=[0.0, log_prob],
            chain_hash=chain,
            cumulative_hash=cumulative,
        )
        assert call_digest(fields) == digest


# --- the document's layout and the package agree on any input --------------------

_ids = st.lists(st.integers(min_value=0, max_value=2**64 - 1), min_size=1, max_size=12)
_name = st.text(min_size=1, max_size=12)
_f32_range = st.floats(min_value=-1e30, max_value=0.0, allow_nan=False, allow_infinity=False)
_json = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**63 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)


@settings(max_examples=150, deadline=None)
@given(
    rollout_id=_name,
    call_id=_name,
    parent=st.none() | _name,
    prev_len=st.integers(min_value=1, max_value=2**40),
    weight=st.integers(min_value=0, max_value=2**64 - 1),
    delta=_ids,
    data=st.data(),
)
def test_document_layout_matches_the_package(
    rollout_id: str, call_id: str, parent: str | None, prev_len: int, weight: int, delta: list[int], data: Any
) -> None:
    carry = data.draw(st.integers(min_value=0, max_value=len(delta)))
    mask = [0.0] * carry + [1.0] * (len(delta) - carry)
    log_probs = [0.0] * carry + data.draw(
        st.lists(_f32_range, min_size=len(delta) - carry, max_size=len(delta) - carry)
    )
    prev = 0 if parent is None else prev_len
    extras = data.draw(st.none() | st.dictionaries(st.text(max_size=6), _json, max_size=3))
    fields = _root(
        rollout_id=rollout_id,
        model_call_id=call_id,
        parent_call_id=parent,
        mode="text" if parent is None else "token_in",
        prev_len=prev,
        delta_len=len(delta),
        cum_len=prev + len(delta),
        weight_version=weight,
        token_ids_delta=delta,
        token_mask_delta=mask,
        generation_log_probs_delta=log_probs,
        extras_digest=extras_digest(extras),
        chain_hash=chain_hash(None, delta),
        cumulative_hash=prefix_hash(delta),
    )
    assert extras_digest(extras) == compute_extras_digest(extras)
    assert chain_hash(None, delta) == compute_chain_hash(None, delta)
    assert chain_hash(fields["chain_hash"], delta) == compute_chain_hash(fields["chain_hash"], delta)
    assert prefix_hash(delta) == hash_token_ids(delta)
    assert call_digest(fields) == compute_staging_digest(**fields)
