"""The NeMo Gym transport's entry codec: lossless, canonical, and strict on read (property-based)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sink.errors import CodecError
from sink.gym import LocalTokenEntry
from sink.gym.codec import check_rollout_id, decode_entry, encode_entry

_json = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**53), 2**53)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)


@st.composite
def entries(draw: st.DrawFn) -> LocalTokenEntry:
    n = draw(st.integers(0, 40))
    items = draw(st.lists(st.dictionaries(st.text(max_size=5), _json, max_size=3), max_size=3))
    return LocalTokenEntry(
        rollout_id=draw(st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._-]{0,20}", fullmatch=True)),
        model_call_id=draw(st.text(min_size=1, max_size=20)),
        model=draw(st.text(max_size=10)),
        prompt_token_ids=draw(st.lists(st.integers(0, 2**64 - 1), max_size=40)),
        generation_token_ids=draw(st.lists(st.integers(0, 2**32 - 1), min_size=n, max_size=n)),
        generation_log_probs=draw(st.lists(st.floats(allow_nan=False, allow_infinity=False), min_size=n, max_size=n)),
        routed_experts=draw(_json),
        output_items=items,
        token_item_index=draw(st.none() | st.integers(0, len(items) - 1)) if items else None,
        created_at=draw(st.floats(allow_nan=False, allow_infinity=False)),
        **draw(st.dictionaries(st.sampled_from(["extra_a", "extra_b"]), _json, max_size=2)),
    )


@given(entries())
def test_round_trip_is_lossless(entry: LocalTokenEntry) -> None:
    decoded = decode_entry(encode_entry(entry).blob, LocalTokenEntry)
    assert decoded.model_dump(mode="json") == entry.model_dump(mode="json")
    assert decoded.generation_log_probs == entry.generation_log_probs


@given(entries(), entries())
def test_digest_is_the_json_identity(a: LocalTokenEntry, b: LocalTokenEntry) -> None:
    # Gym's identity: the JSON dumps, keys sorted, are equal (so 1 and 1.0, or 0.0 and -0.0, differ)
    same = json.dumps(a.model_dump(mode="json"), sort_keys=True) == json.dumps(
        b.model_dump(mode="json"), sort_keys=True
    )
    assert (encode_entry(a).digest == encode_entry(b).digest) == same
    # key order of nested dicts does not matter
    reordered = LocalTokenEntry(**dict(reversed(list(a.model_dump().items()))))
    assert encode_entry(reordered).digest == encode_entry(a).digest


@given(entries(), st.integers(0, 200), st.binary(min_size=1, max_size=3))
def test_a_damaged_blob_is_refused(entry: LocalTokenEntry, position: int, junk: bytes) -> None:
    blob = encode_entry(entry).blob
    cut = position % len(blob)
    damaged = blob[:cut] + bytes(b ^ 0xFF for b in junk) + blob[cut + len(junk) :]
    if damaged != blob:
        with pytest.raises(CodecError):
            decode_entry(damaged, LocalTokenEntry)


@pytest.mark.parametrize("value", ["a", "A.b_c-1", "task-3-a2", "0"])
def test_rollout_ids_gym_accepts(value: str) -> None:
    assert check_rollout_id(value) == value


@pytest.mark.parametrize("value", ["", "_a", "-a", "a:b", "a}", "a\n", b"a", 1])
def test_rollout_ids_gym_refuses(value: Any) -> None:
    with pytest.raises(ValueError):
        check_rollout_id(value)
