"""Collation (sink.trainer.batch) and sequence packing (sink.trainer.packing): in memory, by property, and on pulled rows."""

from __future__ import annotations

import math
from typing import Any

import anyio
import numpy as np
import pytest
import redis.asyncio as aioredis
from hypothesis import given, settings
from hypothesis import strategies as st

from sink.errors import BatchInputError, StagingError
from sink.rollout.assembler import finished
from sink.rollout.done_event import GroupTag
from sink.trainer.batch import OverlongRow, collate
from sink.trainer.packing import first_fit_decreasing, pack
from sink.trainer.pulled import PulledRollout
from sink.trainer.reader.rollout_reader import RolloutReader
from tests.helpers.e2e import EventCounter, pull_until, running_assembler, stage_rollouts
from tests.helpers.rows import skipped_pulled, verified_pulled


def _row_arrays(item: PulledRollout) -> tuple[Any, Any, Any]:
    assert item.row is not None
    return item.row.as_numpy()


def test_collate_pads_right_and_keeps_every_value() -> None:
    a = verified_pulled("a", lengths=(5, 3), weight_versions=(4, 7), reward=0.5)
    b = verified_pulled("b", lengths=(3,), weight_versions=(2,), reward=None)
    batch = collate([a, b], pad_token_id=7, pad_to_multiple_of=4)
    assert batch.input_ids.shape == (2, 8) and batch.input_ids.dtype == np.int64
    assert batch.loss_mask.dtype == np.float32 and batch.generation_logprobs.dtype == np.float32
    assert batch.attention_mask.dtype == np.bool_
    assert batch.input_lengths.tolist() == [8, 3]
    for index, item in enumerate((a, b)):
        ids, mask, logprobs = _row_arrays(item)
        n = len(ids)
        assert batch.input_ids[index, :n].tolist() == ids.tolist()
        assert (batch.input_ids[index, n:] == 7).all()
        assert batch.loss_mask[index, :n].tolist() == mask.tolist()
        assert (batch.loss_mask[index, n:] == 0).all()
        assert batch.generation_logprobs[index, :n].tobytes() == logprobs.tobytes()
        assert batch.attention_mask[index].tolist() == [True] * n + [False] * (8 - n)
    assert batch.rewards[0] == 0.5 and math.isnan(batch.rewards[1])
    assert batch.weight_versions.tolist() == [[4, 7], [2, 2]]
    assert batch.rollout_ids == ("a", "b") and batch.ack_ids == ("a", "b")
    assert "rows=2" in repr(batch)
    assert set(batch.tensors()) >= {"input_ids", "attention_mask", "loss_mask", "generation_logprobs"}


def test_rows_carry_their_group() -> None:
    grouped = verified_pulled("a", group=GroupTag("prompt-1", 2))
    batch = collate([grouped, verified_pulled("b")])
    packed = pack([grouped, verified_pulled("b")], max_tokens=64)
    assert batch.group_ids == ("prompt-1", None) and packed.group_ids == ("prompt-1", None)


def test_pad_to_multiple_of_rounds_the_width_up() -> None:
    batch = collate([verified_pulled("a", lengths=(9,))], pad_to_multiple_of=8)
    assert batch.input_ids.shape == (1, 16)


def test_overlong_rows_are_reported_never_truncated_and_skips_are_listed() -> None:
    long = verified_pulled("long", lengths=(10, 10))
    short = verified_pulled("short", lengths=(6,))
    failed = skipped_pulled("failed")
    batch = collate([long, short, failed], max_tokens=12)
    assert batch.rollout_ids == ("short",)
    assert batch.overlong == (OverlongRow("long", 20, 12),)
    assert [s.rollout_id for s in batch.skipped] == ["failed"] and batch.skipped[0].skip_code == "rollout_failed"
    assert set(batch.ack_ids) == {"long", "short", "failed"}


def test_an_empty_selection_gives_an_empty_batch() -> None:
    batch = collate([skipped_pulled("x")])
    assert batch.input_ids.shape == (0, 0) and batch.size == 0 and batch.ack_ids == ("x",)


@pytest.mark.parametrize(
    ("pulled", "options"),
    [
        ([], {"pad_token_id": -1}),
        ([], {"pad_to_multiple_of": 0}),
        ([], {"max_tokens": 0}),
        ([], {"pad_token_id": True}),
        (["not a rollout"], {}),
        ("ab", {}),
    ],
)
def test_bad_input_is_a_typed_error(pulled: Any, options: dict[str, Any]) -> None:
    with pytest.raises(BatchInputError) as info:
        collate(pulled, **options)
    assert isinstance(info.value, StagingError) and isinstance(info.value, ValueError)


def test_a_rollout_twice_is_refused() -> None:
    item = verified_pulled("a")
    with pytest.raises(BatchInputError, match="twice"):
        collate([item, item])
    with pytest.raises(BatchInputError, match="twice"):
        pack([item, item], max_tokens=64)


def test_first_fit_decreasing_places_longest_first_into_the_first_bin_with_room() -> None:
    # 7 opens bin 0, 5 opens bin 1, 4 fits only bin 1, 3 fills bin 0, 2 fits nowhere: bin 2.
    assert first_fit_decreasing([3, 7, 5, 2, 4], 10) == [[1, 0], [2, 4], [3]]
    assert first_fit_decreasing([], 10) == []


_lengths = st.lists(st.lists(st.integers(2, 12), min_size=1, max_size=3), min_size=1, max_size=8)


@settings(max_examples=40, deadline=None)
@given(rows=_lengths, max_tokens=st.integers(1, 40), pad=st.integers(0, 5))
def test_packing_places_every_token_exactly_once_in_order(rows: list[list[int]], max_tokens: int, pad: int) -> None:
    pulled = [verified_pulled(f"r{i}", lengths=lengths, reward=float(i)) for i, lengths in enumerate(rows)]
    packed = pack(pulled, max_tokens=max_tokens, pad_token_id=pad)
    fitting = [p for p in pulled if p.row is not None and len(p.row.columns) <= max_tokens]
    assert packed.rollout_ids == tuple(p.rollout_id for p in fitting)
    assert {o.rollout_id for o in packed.overlong} == {p.rollout_id for p in pulled} - set(packed.rollout_ids)
    seen_tokens = 0
    for index, item in enumerate(fitting):
        ids, mask, logprobs = _row_arrays(item)
        where = np.argwhere(packed.segment_ids == index)
        assert len(where) == len(ids)  # exactly once
        bins = set(where[:, 0].tolist())
        assert len(bins) == 1  # never split across bins
        slot = bins.pop()
        positions = where[:, 1]
        assert (np.diff(positions) == 1).all()  # contiguous and in order
        start, end = int(positions[0]), int(positions[-1]) + 1
        assert packed.input_ids[slot, start:end].tolist() == ids.tolist()
        assert packed.loss_mask[slot, start:end].tobytes() == mask.tobytes()
        assert packed.generation_logprobs[slot, start:end].tobytes() == logprobs.tobytes()
        assert packed.position_ids[slot, start:end].tolist() == list(range(len(ids)))
        assert start in packed.cu_seqlens[slot].tolist() and end in packed.cu_seqlens[slot].tolist()
        assert packed.rewards[index] == item.receipt.reward
        seen_tokens += len(ids)
    padding = packed.segment_ids == -1
    assert int((~padding).sum()) == seen_tokens
    assert (packed.input_ids[padding] == pad).all() and (packed.loss_mask[padding] == 0).all()
    for slot, members in enumerate(packed.bins):
        offsets = packed.cu_seqlens[slot]
        assert offsets.dtype == np.int32 and offsets[0] == 0
        assert np.diff(offsets).tolist() == [int(packed.input_lengths[m]) for m in members]
        assert offsets[-1] <= max_tokens


@settings(max_examples=40, deadline=None)
@given(lengths=st.lists(st.integers(1, 50), max_size=30), capacity=st.integers(50, 120))
def test_first_fit_decreasing_never_overfills_and_uses_each_row_once(lengths: list[int], capacity: int) -> None:
    bins = first_fit_decreasing(lengths, capacity)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= capacity for b in bins)
    # first fit: a bin's first row did not fit into any earlier bin (whose room only shrank since)
    for k, members in enumerate(bins):
        assert all(lengths[members[0]] > capacity - sum(lengths[i] for i in earlier) for earlier in bins[:k])


@pytest.mark.anyio
async def test_collate_and_pack_pulled_rows_from_a_real_server(redis_url: str) -> None:
    ids = [f"batch-{i}" for i in range(4)]
    staged = {s.rollout_id: s for s in await stage_rollouts(redis_url, ids, calls=3, n_tokens=6)}
    published = EventCounter(len(ids))
    async with aioredis.Redis.from_url(redis_url) as client:
        for index, rollout_id in enumerate(ids):
            await finished(client, rollout_id, reward=float(index))
    async with running_assembler(redis_url, before_ack=published, block_ms=50):
        with anyio.fail_after(20):
            await published.reached.wait()
    async with RolloutReader.from_url(redis_url) as reader:
        pulled = sorted(await pull_until(reader, len(ids)), key=lambda p: p.rollout_id)
        batch = collate(pulled, pad_to_multiple_of=8)
        packed = pack(pulled, max_tokens=40)
        await reader.ack(batch.ack_ids)
        assert reader.statistics().held == 0
    for index, rollout_id in enumerate(batch.rollout_ids):
        expected = staged[rollout_id]
        n = len(expected.token_ids)
        assert batch.input_ids[index, :n].tolist() == expected.token_ids
        assert batch.loss_mask[index, :n].tolist() == expected.token_mask
        assert batch.generation_logprobs[index, :n].tolist() == pytest.approx(expected.logprobs, abs=1e-6)
        assert batch.rewards[index] == float(ids.index(rollout_id))
    assert sorted(packed.rollout_ids) == sorted(ids)
    assert int(packed.input_lengths.sum()) == int(batch.input_lengths.sum())
    # The rows were written straight into the batch: the same values as each row's own fresh arrays.
    by_id = {p.rollout_id: p for p in pulled}
    for index, rollout_id in enumerate(batch.rollout_ids):
        row = by_id[rollout_id].row
        assert row is not None
        fresh = row.as_numpy()
        n = len(fresh.token_ids)
        assert np.array_equal(batch.input_ids[index, :n], fresh.token_ids)
        assert np.array_equal(batch.loss_mask[index, :n], fresh.token_mask)
        assert np.array_equal(batch.generation_logprobs[index, :n], fresh.logprobs)
        with pytest.raises(ValueError, match="1-D targets"):
            row.write_numpy(fresh.token_ids[:-1], fresh.token_mask, fresh.logprobs)


@pytest.mark.parametrize("build", [collate, lambda items: pack(items, max_tokens=16)], ids=["collate", "pack"])
def test_a_weight_version_beyond_int64_is_a_precise_typed_error(build: Any) -> None:
    """The contract allows any u64 weight version; the batch's ``weight_versions`` column is int64 (what torch
    tensors take). A version from 2**63 up cannot be held: a typed error naming the rollout and the value, never a
    bare numpy overflow and never a wrapped negative version."""
    fits = verified_pulled("fits", lengths=(3,), weight_versions=(2**63 - 1,), reward=0.5)
    assert build([fits]).weight_versions.tolist() == [[2**63 - 1, 2**63 - 1]]
    huge = verified_pulled("huge", lengths=(3, 2), weight_versions=(5, 2**63), reward=0.5)
    with pytest.raises(BatchInputError, match=r"rollout 'huge'.*9223372036854775808.*int64"):
        build([fits, huge])
