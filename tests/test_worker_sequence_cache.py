"""The worker's sequence cache never changes a cumulative hash; it only skips re-packing."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from sink.digest import hash_token_ids
from worker.sequence_cache import SequenceHashCache

ids = st.lists(st.integers(min_value=0, max_value=2**40), max_size=30)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["r1", "r2"]), st.integers(min_value=0, max_value=3), ids, ids),
        min_size=1,
        max_size=12,
    )
)
def test_cached_hashes_equal_the_reference(steps: list[tuple[str, int, list[int], list[int]]]) -> None:
    cache = SequenceHashCache(max_rollouts=1)  # evictions happen too
    sequences: dict[tuple[str, str], list[int]] = {}
    for index, (rollout, parent_pick, fallback_prefix, rest) in enumerate(steps):
        known = [key for key in sequences if key[0] == rollout]
        parent = known[parent_pick % len(known)] if known else None
        prefix = sequences[parent] if parent is not None else fallback_prefix
        call_id = f"c{index}"
        digest = cache.cumulative_hash(rollout, call_id, parent[1] if parent else None, prefix, rest)
        assert digest == hash_token_ids(prefix + rest)
        sequences[(rollout, call_id)] = prefix + rest


def test_a_prefix_that_differs_from_the_cached_parent_is_packed_in_full() -> None:
    cache = SequenceHashCache()
    cache.cumulative_hash("r", "c0", None, [], [1, 2, 3])
    # Same parent id, different contents (e.g. a caller bug): the value check prevents re-use.
    assert cache.cumulative_hash("r", "c1", "c0", [9, 9, 9], [4]) == hash_token_ids([9, 9, 9, 4])
    assert cache.cumulative_hash("r", "c2", "c1", [9, 9, 9, 4], [5]) == hash_token_ids([9, 9, 9, 4, 5])
