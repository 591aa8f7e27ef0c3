"""The trainer reader's additions against real servers: group tags, staleness skips, the synchronous reader."""

from __future__ import annotations

import threading

import anyio
import pydantic
import pytest
import redis.asyncio as aioredis

from sink.contract.skip_codes import SkipCode
from sink.errors import CodecError
from sink.keys import done_stream, receipts_stream
from sink.rollout.assembler import finished
from sink.rollout.done_event import GroupTag, parse_done_event
from sink.settings import DEFAULT_SHARDS, ReaderSettings
from sink.trainer.reader.rollout_reader import RolloutReader
from sink.trainer.reader.sync_reader import SyncRolloutReader
from tests.helpers.e2e import pull_until, stage_rollouts
from tests.helpers.trainer import publish, publish_staged


@pytest.mark.anyio
async def test_group_travels_from_finished_to_the_pulled_rollout(redis_url: str) -> None:
    await publish(redis_url, ["g-a", "g-b", "solo"], groups={"g-a": ("prompt-1", 2), "g-b": ("prompt-1", 2)})
    async with RolloutReader.from_url(redis_url) as reader:
        pulled = {p.rollout_id: p for p in await pull_until(reader, 3)}
        await reader.ack(pulled)
    assert pulled["g-a"].group == GroupTag("prompt-1", 2) == pulled["g-b"].group
    assert pulled["solo"].group is None
    # The receipt itself is the seed's model, untouched: no group field.
    assert "group" not in pulled["g-a"].receipt.model_dump_json()


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("group_id", "group_size", "error"),
    [
        ("g", None, ValueError),
        (None, 2, ValueError),
        ("g", 0, ValueError),
        ("bad id!", 2, ValueError),
        (3, 2, TypeError),
    ],
)
async def test_finished_refuses_a_bad_group_and_writes_nothing(
    redis_url: str, group_id: object, group_size: object, error: type[Exception]
) -> None:
    async with aioredis.Redis.from_url(redis_url) as client:
        with pytest.raises(error):
            await finished(client, "r1", reward=1.0, group_id=group_id, group_size=group_size)  # type: ignore[arg-type]
        assert await client.exists(*(done_stream("stg", shard) for shard in range(DEFAULT_SHARDS))) == 0


def test_a_malformed_group_field_makes_a_malformed_done_event() -> None:
    fields = {"rollout_id": "r1", "reward": "1.0", "group_id": "g", "group_size": "x"}
    with pytest.raises(CodecError, match="group_size"):
        parse_done_event(fields)
    assert parse_done_event({**fields, "group_size": "3"}).group == GroupTag("g", 3)
    assert parse_done_event({"rollout_id": "r1", "reward": "null"}).group is None


@pytest.mark.anyio
async def test_stale_rollouts_are_acked_and_reported_with_a_reason_code(redis_url: str) -> None:
    staged = await stage_rollouts(redis_url, ["old", "fresh"], calls=2)
    assert all(r.weight_version == 0 for s in staged for r in s.records)
    await publish_staged(redis_url, ["old", "fresh"])
    async with RolloutReader.from_url(redis_url, max_weight_lag=2) as reader:
        reader.set_weight_version(3)  # version 0 is 3 behind: stale
        pulled = await pull_until(reader, 2)
        assert {p.skip_code for p in pulled} == {SkipCode.STALE_WEIGHTS}
        assert all("max_weight_lag=2" in (p.skip_reason or "") for p in pulled)
        stats = reader.statistics()
        assert stats.skipped == 2 and stats.trainable == 0 and stats.held == 0
        assert dict(stats.skipped_by_code) == {SkipCode.STALE_WEIGHTS: 2}
        # Acknowledged by the reader: acking them again is accepted and changes nothing.
        await reader.ack([p.rollout_id for p in pulled])
        assert await reader.pending() == 0
        with pytest.raises(ValueError, match=r"not an integer in \[0, 2\*\*64\)"):
            reader.set_weight_version(-1)
    async with aioredis.Redis.from_url(redis_url) as client:
        assert [await client.xlen(receipts_stream("stg", shard)) for shard in range(DEFAULT_SHARDS)] == [
            0
        ] * DEFAULT_SHARDS


@pytest.mark.anyio
async def test_within_the_lag_rollouts_stay_trainable(redis_url: str) -> None:
    await publish(redis_url, ["ok-1"])
    async with RolloutReader.from_url(redis_url, max_weight_lag=2) as reader:
        reader.set_weight_version(2)
        (item,) = await pull_until(reader, 1)
        assert item.trainable and reader.statistics().skipped_by_code == ()
        await reader.ack([item.rollout_id])


@pytest.mark.anyio
async def test_the_sync_reader_pulls_heartbeats_and_acks_from_threads(redis_url: str) -> None:
    ids = [f"sync-{i}" for i in range(6)]
    staged = await publish(redis_url, ids)

    def train() -> tuple[list[str], int, int]:
        pulled: list[str] = []
        errors: list[BaseException] = []
        with SyncRolloutReader.from_url(redis_url, consumer_name="sync-rank") as reader:
            assert reader.consumer_name == "sync-rank"

            def beat() -> None:
                try:
                    for _ in range(20):
                        reader.heartbeat()
                except Exception as exc:  # noqa: BLE001 - reported below, on the test's thread
                    errors.append(exc)

            beater = threading.Thread(target=beat)
            beater.start()
            while len(pulled) < len(ids):
                for item in reader.pull(4, block_ms=200):
                    assert item.row is not None
                    assert list(item.row.token_ids) == staged[item.rollout_id].token_ids
                    pulled.append(item.rollout_id)
            beater.join()
            held = reader.statistics().held
            reader.ack(pulled)
            stats = reader.statistics()
            assert "SyncRolloutReader" in repr(reader)
            with pytest.raises(TypeError):
                reader.ack("sync-0")
        assert not errors
        with pytest.raises(RuntimeError, match="closed"):
            reader.pull(1)
        return pulled, held, stats.acked

    pulled, held, acked = await anyio.to_thread.run_sync(train)
    assert sorted(pulled) == sorted(ids) and held == len(ids) and acked == len(ids)


def test_a_thread_beside_a_pulling_loop_waits_only_for_the_call_in_progress(redis_url: str) -> None:
    """Calls from several threads take turns in order (a DataLoader worker waiting for receipts pulls in
    a loop, and its acknowledging thread waited seconds behind it). Counted in pulls, not in time: a heartbeat
    waits for the pull in progress and, at most, one its loop had asked for already."""
    with SyncRolloutReader.from_url(redis_url, consumer_name="turns") as reader:
        stop = threading.Event()
        pulls = [0]

        def loop() -> None:
            while not stop.is_set():
                reader.pull(1, block_ms=50)  # nothing to read: each pull holds the reader for 50 ms
                pulls[0] += 1

        puller = threading.Thread(target=loop)
        puller.start()
        try:
            waited: list[int] = []
            for _ in range(20):
                before = pulls[0]
                reader.heartbeat()
                waited.append(pulls[0] - before)
        finally:
            stop.set()
            puller.join()
    assert max(waited) <= 2, waited


@pytest.mark.parametrize(
    "fields",
    [
        {"max_weight_lag": -1},
        {"group_timeout_s": 0},
        {"group_timeout_policy": "forever"},
        {"group_failure_policy": "ignore"},
    ],
)
def test_trainer_settings_are_validated(fields: dict[str, object]) -> None:
    with pytest.raises(pydantic.ValidationError):
        ReaderSettings.model_validate(fields)
