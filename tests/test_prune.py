"""Bounded state: retention after ack, abandonment, dead-letter trimming, idle consumers,
``staging-sink prune [--dry-run]``; namespace-only."""

from __future__ import annotations

import json

import anyio
import pytest
import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster

from sink.keys import calls_stream, dead_letter_stream, done_stream, fence_key, ledger_stream, receipt_key
from sink.ops.prune import prune_namespace
from sink.rollout.assembler import finished
from sink.settings import PruneSettings
from sink.store.connection import Topology
from sink.store.pipeline_counters import pipeline_counters
from sink.trainer.reader.rollout_reader import RolloutReader
from sink_cli.common import EXIT_OK
from sink_cli.main import main
from sink_tools.cluster import LocalCluster
from tests.helpers.e2e import pull_until, running_assembler, stage_rollouts
from tests.helpers.processes import until
from tests.helpers.prune import next_millisecond
from tests.helpers.replies import raw_entries


async def _keys(client: aioredis.Redis, pattern: str = "*") -> dict[str, int]:
    """Every key matching *pattern* and its TTL (-1: none)."""
    names = [key.decode() if isinstance(key, bytes) else str(key) for key in await client.keys(pattern)]
    return {name: int(await client.ttl(name)) for name in names}


def _abandoned_count() -> float:
    return sum(value for name, _labels, value in pipeline_counters().counters() if name.endswith("abandoned"))


@pytest.mark.anyio
async def test_ack_gives_the_receipt_and_fence_their_retention(redis_url: str) -> None:
    await stage_rollouts(redis_url, ["r1"], calls=2)
    async with aioredis.Redis.from_url(redis_url) as client:
        await finished(client, "r1", reward=1.0)
        async with running_assembler(redis_url, block_ms=50), RolloutReader.from_url(redis_url, retention_s=30) as r:
            await pull_until(r, 1)
            await r.ack(["r1"])
        left = await _keys(client, "stg:{r1}:*")
    assert set(left) == {receipt_key("stg", "r1"), fence_key("stg", "r1")}
    assert all(0 < ttl <= 30 for ttl in left.values()), left


@pytest.mark.anyio
async def test_prune_abandons_only_stale_unfinished_rollouts_and_only_in_its_namespace(redis_url: str) -> None:
    await stage_rollouts(redis_url, ["old", "waiting"], calls=2)
    async with aioredis.Redis.from_url(redis_url) as client:
        await client.set("ns2:{old}:fence", "1")  # another namespace: never touched
        await finished(client, "waiting", reward=1.0)
        async with running_assembler(redis_url, block_ms=50):

            async def receipted() -> bool:
                return bool(await client.exists(receipt_key("stg", "waiting")))

            await until(receipted, "the assembler stored no receipt for 'waiting'")
        # The age line falls between "old" and "fresh": ages are counted to a time the test fixes, not to how
        # long the test took (it used to sleep past abandon_after_s and hope "fresh" stayed younger).
        line_s = await next_millisecond()
        await next_millisecond()
        await stage_rollouts(redis_url, ["fresh"], calls=1)
        settings = PruneSettings(abandon_after_s=1.0, retention_s=60)
        now_s = line_s + settings.abandon_after_s
        before = await _keys(client)
        topology = Topology.borrow(client, settings)
        dry = await prune_namespace(topology, settings, dry_run=True, now_s=now_s)
        assert dry.abandoned == ["old"]
        assert await _keys(client) == before  # the dry run changed nothing
        counted = _abandoned_count()
        report = await prune_namespace(topology, settings, now_s=now_s)
        assert report.abandoned == ["old"]  # "waiting" has a receipt (the trainer's), "fresh" is recent
        assert _abandoned_count() == counted + 1
        old = await _keys(client, "stg:{old}:*")
        assert list(old) == [fence_key("stg", "old")] and 0 < old[fence_key("stg", "old")] <= 60
        assert await client.exists(calls_stream("stg", "fresh"), ledger_stream("stg", "waiting")) == 2
        dead = raw_entries(await client.xrange(dead_letter_stream("stg", "abandoned")))
        assert [fields[b"rollout_id"] for _id, fields in dead] == [b"old"]
        assert await client.ttl("ns2:{old}:fence") == -1
        again = await prune_namespace(topology, settings, now_s=now_s)
        assert again.abandoned == [] and again.retained == []  # idempotent
        await topology.aclose()


@pytest.mark.anyio
async def test_prune_sets_retention_trims_dead_letters_and_removes_idle_consumers(redis_url: str) -> None:
    async with aioredis.Redis.from_url(redis_url) as client:
        await client.set(fence_key("stg", "retired"), "1")  # e.g. `retire --force`: a fence with no TTL
        await client.set(receipt_key("stg", "acked-before-crash"), "{}")
        dead = dead_letter_stream("stg", "receipts-0")
        for index in range(30):
            await client.xadd(dead, {"n": str(index)})
        done = done_stream("stg", 0)
        await client.xgroup_create(done, "assemblers", id="0", mkstream=True)
        await client.xgroup_createconsumer(done, "assemblers", "gone-1")
        settings = PruneSettings(dead_letter_max_entries=10, consumer_idle_max_s=0.01, retention_s=100)

        async def idle_past_the_limit() -> bool:  # the server's clock, as prune reads it
            return all(int(c["idle"]) > 10 for c in await client.xinfo_consumers(done, "assemblers"))

        await until(idle_past_the_limit, "gone-1 never idled 10 ms")
        topology = Topology.borrow(client, settings)
        report = await prune_namespace(topology, settings)
        await topology.aclose()
        assert sorted(report.retained) == ["acked-before-crash", "retired"]
        assert 0 < await client.ttl(fence_key("stg", "retired")) <= 100
        assert report.dead_letters_trimmed == {dead: 20} and await client.xlen(dead) == 10
        assert report.consumers_removed == [f"{done} assemblers gone-1"]
        assert await client.xinfo_consumers(done, "assemblers") == []


def test_prune_command_dry_run_and_json(redis_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    async def fence() -> None:
        async with aioredis.Redis.from_url(redis_url) as client:
            await client.set(fence_key("stg", "retired"), "1")

    anyio.run(fence)
    assert main(["prune", "--redis-url", redis_url, "--dry-run", "--json"]) == EXIT_OK
    report = json.loads(capsys.readouterr().out)
    assert report["dry_run"] is True and report["retained"] == ["retired"]
    assert main(["prune", "--redis-url", redis_url]) == EXIT_OK
    assert "set retention on 1" in capsys.readouterr().out
    assert main(["prune", "--redis-url", redis_url]) == EXIT_OK
    assert "set retention on 0" in capsys.readouterr().out


@pytest.mark.anyio
async def test_prune_on_a_cluster_abandons_across_primaries(cluster: LocalCluster) -> None:
    ids = [f"prune-c-{index}" for index in range(6)]  # spread over the primaries' slots
    await stage_rollouts(cluster.url, ids, calls=1, cluster=True)
    settings = PruneSettings(abandon_after_s=1.0, retention_s=60, cluster=True)
    now_s = await next_millisecond() + settings.abandon_after_s  # every rollout staged before the age line
    async with RedisCluster.from_url(cluster.url) as client:
        topology = Topology.borrow(client, settings)
        await topology.initialize()
        assert len({topology.node_for_key(calls_stream("stg", rid)) for rid in ids}) > 1
        dry = await prune_namespace(topology, settings, dry_run=True, now_s=now_s)
        assert set(ids) <= set(dry.abandoned)
        report = await prune_namespace(topology, settings, now_s=now_s)
        await topology.aclose()
        assert set(ids) <= set(report.abandoned)
        for rid in ids:
            assert await client.exists(calls_stream("stg", rid), ledger_stream("stg", rid)) == 0
            assert 0 < await client.ttl(fence_key("stg", rid)) <= 60
