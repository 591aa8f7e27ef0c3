"""Record builders, hypothesis strategies and blob editing for the codec and packed-snapshot tests."""

from __future__ import annotations

import struct
from typing import Any

import msgpack
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from sink.contract.codec import encode_record
from sink.contract.digest import compute_extras_digest, compute_staging_digest
from sink.contract.record_schema import COLUMN_FIELDS, DIGEST_SCALAR_FIELDS
from sink.contract.records import StagedCallBaseSnapshot, StagedCallRecord

HEX = st.text("0123456789abcdef", min_size=64, max_size=64)
GOLDEN_EXTRAS = {"routed_experts": [[[1, 2]], [[3, 4]]]}
GOLDEN_DIGEST = "1122c7fe7e914c809eb9b1c09b26d94a50c1eb2790e7430fbcd8363b846ccf27"
CHAIN_ROOT = "14c5e45c969e9b8b821f302201ad9d9b6b4f7427ac18dab2cb150af8e3acdd65"
CUMULATIVE_ROOT = "21c8e66807865ae05ca6f5bca40bd4a1399a66c23fb9848216a23c2ab9d9858f"

# --- helpers ---------------------------------------------------------------------


def exact(value: Any) -> Any:
    """A comparable form that tells -0.0 from 0.0, 1 from 1.0 and True from 1."""
    kind = type(value)
    if kind is float:
        return ("f", struct.pack("<d", value))
    if kind is list:
        return ("l", tuple(map(exact, value)))
    if kind is dict:
        return ("d", tuple((key, exact(item)) for key, item in value.items()))
    return (kind.__name__, value)


def assert_same_record(actual: StagedCallBaseSnapshot, expected: StagedCallBaseSnapshot) -> None:
    assert exact(actual.model_dump()) == exact(expected.model_dump())


def public_digest(record: StagedCallBaseSnapshot) -> str:
    """The digest by the checked public function over the record's lists (the slow reference)."""
    return compute_staging_digest(**{name: getattr(record, name) for name in (*DIGEST_SCALAR_FIELDS, *COLUMN_FIELDS)})


def components(**overrides: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "rollout_id": "rollout-1",
        "model_call_id": "call-1",
        "parent_call_id": "parent-1",
        "mode": "token_in",
        "prev_len": 3,
        "delta_len": 2,
        "cum_len": 5,
        "weight_version": 7,
        "token_ids_delta": [10, 11],
        "token_mask_delta": [0.0, 1.0],
        "generation_log_probs_delta": [0.0, -0.25],
        "extras": GOLDEN_EXTRAS,
        "extras_digest": compute_extras_digest(GOLDEN_EXTRAS),
        "chain_hash": "1" * 64,
        "cumulative_hash": "2" * 64,
    }
    base.update(overrides)
    return base


def record_of(ids: list[int], mask: list[float], log_probs: list[float], **overrides: Any) -> StagedCallRecord:
    n = len(ids)
    extras = overrides.pop("extras", None)
    fields = components(
        token_ids_delta=ids,
        token_mask_delta=mask,
        generation_log_probs_delta=log_probs,
        delta_len=n,
        cum_len=3 + n,
        extras=extras,
        extras_digest=compute_extras_digest(extras),
    )
    fields.update(overrides)
    return StagedCallRecord.from_components(**fields)


def repack(blob: bytes, edit: Any) -> bytes:
    obj = msgpack.unpackb(blob, raw=False)
    edited = edit(obj)
    packed: bytes = msgpack.packb(obj if edited is None else edited, use_bin_type=True)
    return packed


def f32(value: float) -> float:
    result: float = struct.unpack("<f", struct.pack("<f", value))[0]
    return result


# --- strategies ------------------------------------------------------------------

token_ids = st.one_of(st.integers(0, 200_000), st.integers(0, 2**64 - 1), st.sampled_from([2**31, 2**32 - 1, 2**32]))
extras_leaves = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**63 - 1),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=6),
)
extras_values = st.recursive(
    extras_leaves,
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=4), children, max_size=3),
    max_leaves=8,
)
extras_payloads = st.none() | st.dictionaries(st.text(max_size=6), extras_values, max_size=3)
generated_log_probs = st.one_of(
    st.floats(width=32, allow_nan=False, allow_infinity=False),
    st.floats(min_value=-3.4e38, max_value=3.4e38, allow_nan=False),
    st.sampled_from([0.0, -0.0, 0.1, -1e-45, 5e-324, -(2.0**-130), 2.0**120, -3.4028234663852886e38]),
)


@st.composite
def staged_records(draw: st.DrawFn) -> StagedCallRecord:
    n = draw(st.integers(1, 24))
    mask = draw(st.lists(st.sampled_from([0.0, -0.0, 1.0]), min_size=n, max_size=n))
    log_probs = [draw(st.sampled_from([0.0, -0.0])) if m == 0.0 else draw(generated_log_probs) for m in mask]
    extras = draw(extras_payloads)
    return _build(draw, n, mask, log_probs, extras, draw(st.booleans()))


def _build(
    draw: st.DrawFn, n: int, mask: list[float], log_probs: list[float], extras: Any, child: bool
) -> StagedCallRecord:
    prev_len = draw(st.integers(1, 2**40)) if child else 0
    return StagedCallRecord.from_components(
        rollout_id=draw(st.text(min_size=1, max_size=8)),
        model_call_id=draw(st.text(min_size=1, max_size=8)),
        parent_call_id=draw(st.text(min_size=1, max_size=8)) if child else None,
        mode="token_in" if child else "text",
        prev_len=prev_len,
        delta_len=n,
        cum_len=prev_len + n,
        weight_version=draw(st.integers(0, 2**64 - 1)),
        token_ids_delta=draw(st.lists(token_ids, min_size=n, max_size=n)),
        token_mask_delta=mask,
        generation_log_probs_delta=log_probs,
        extras=extras,
        extras_digest=compute_extras_digest(extras),
        chain_hash=draw(HEX),
        cumulative_hash=draw(HEX),
    )


SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def small_blob() -> tuple[StagedCallRecord, bytes]:
    record = record_of([7, 2**31 + 5, 9], [-0.0, 1.0, 1.0], [0.0, -0.5, f32(-1 / 3)], extras={"a": [1, 1.5, "x"]})
    return record, encode_record(record)
