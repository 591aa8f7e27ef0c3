"""One ``ack`` of k rollouts costs round trips that do not grow with k: one pipeline per node and step
(:mod:`sink.store.batch`), on one server (Valkey 8, Redis 7.0) and across a cluster's primaries; and
``staging-sink bench ack`` reports them."""

from __future__ import annotations

import json

import anyio
import pytest
import redis
import redis.exceptions as redis_errors
from redis.asyncio.cluster import RedisCluster

from sink.errors import NotDurableError
from sink.keys import ledger_stream
from sink.rollout.done_event import finished
from sink.settings import DEFAULT_SHARDS, ConnectionSettings
from sink.store.batch import BatchCall, run_batch
from sink.store.connection import Topology
from sink.trainer.reader.rollout_reader import RolloutReader
from sink_cli.main import main
from sink_tools.bench.ack import AckFigures, count_round_trips, format_report, run_ack_benchmark
from sink_tools.cluster import LocalCluster
from tests.helpers.e2e import pull_until, running_assembler, stage_rollouts

# The steps of one ack that go through the batch runner: lease touch, ledger retire, clear staged, claim
# release, retention EXPIREs. The XACK+XDEL of the receipts add one MULTI per receipts stream touched.
BATCHED_STEPS = 5


def test_bench_ack_reports_round_trips_and_time(redis_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "ack", "--redis-url", redis_url, "--rollouts", "3", "--calls", "2", "--repeats", "1", "--json"]
    assert main(argv) == 0
    figures = AckFigures(**json.loads(capsys.readouterr().out))
    assert figures.rollouts == 3 and figures.round_trips > 0 and figures.ack_ms > 0
    assert "3 rollouts" in format_report(figures)


def test_ack_round_trips_do_not_grow_with_the_rollouts(redis_url: str) -> None:
    few = anyio.run(lambda: run_ack_benchmark(redis_url, rollouts=2, calls=1, repeats=1, namespace="ack-few"))
    many = anyio.run(lambda: run_ack_benchmark(redis_url, rollouts=40, calls=2, repeats=1, namespace="ack-many"))
    # One pipeline per step on the one node, then a MULTI per receipts stream: 40 rollouts cost no more than
    # 2 do but for the receipts streams they touch (about 3 sends per rollout before batching).
    assert many.round_trips <= BATCHED_STEPS + DEFAULT_SHARDS < many.rollouts
    assert many.round_trips <= few.round_trips + DEFAULT_SHARDS


async def _clear(cluster: LocalCluster) -> None:
    async with RedisCluster.from_url(cluster.url) as client:  # the cluster is shared by the session
        await client.flushall(target_nodes=RedisCluster.PRIMARIES)


@pytest.mark.anyio
async def test_a_batch_sends_one_pipeline_per_primary_and_keeps_the_order(cluster: LocalCluster) -> None:
    await _clear(cluster)
    topology = Topology.from_url(cluster.url, ConnectionSettings(cluster=True))
    try:
        keys = [f"batch:{{k{i}}}" for i in range(60)]
        await topology.initialize()
        nodes = {id(topology.node_for_key(key)) for key in keys}
        assert len(nodes) == 3  # the keys span every primary
        warm_up = [BatchCall([key], ["PING"]) for key in keys]  # connections open before counting
        await run_batch(topology, [*warm_up, BatchCall([keys[7]], ["SET", keys[7], "s"])])
        writes = [BatchCall([key], ["SET", key, str(i)]) for i, key in enumerate(keys)]
        writes[7] = BatchCall([keys[7]], ["LPUSH", keys[7], "x"])  # refused: keys[7] holds a string
        with count_round_trips() as sends:
            replies = await run_batch(topology, writes, durability="fsync", timeout_s=5.0, action="write")
        assert sends.count == 3  # one pipeline per primary, each ending with its durable confirmation
        assert isinstance(replies[7], redis_errors.ResponseError) and "WRONGTYPE" in str(replies[7])
        assert all(reply is True for index, reply in enumerate(replies) if index != 7)
        with count_round_trips() as sends:
            values = await run_batch(topology, [BatchCall([key], ["GET", key]) for key in keys])
        assert sends.count == 3
        assert values == [str(i).encode() if i != 7 else b"s" for i in range(60)]
    finally:
        await topology.aclose()
        await _clear(cluster)


@pytest.mark.anyio
async def test_a_batch_on_a_cluster_with_one_non_durable_primary_is_refused(cluster: LocalCluster) -> None:
    await _clear(cluster)
    victim = cluster.primaries()[0]
    topology = Topology.from_url(cluster.url, ConnectionSettings(cluster=True))
    try:
        with victim.client() as connection:
            connection.config_set("appendfsync", "everysec")
        keys = [f"batch:{{k{i}}}" for i in range(30)]
        calls = [BatchCall([key], ["SET", key, "1"]) for key in keys]
        with pytest.raises(NotDurableError, match=f"could not write durably: server .*:{victim.port} is not durable"):
            await run_batch(topology, calls, durability="fsync", timeout_s=5.0, action="write")
    finally:
        with victim.client() as connection:
            connection.config_set("appendfsync", "always")
        await topology.aclose()
        await _clear(cluster)


@pytest.mark.anyio
async def test_acknowledging_rollouts_across_a_cluster_costs_round_trips_per_node_not_per_rollout(
    cluster: LocalCluster,
) -> None:
    await _clear(cluster)
    warm_up, ids = [f"acw-{i}" for i in range(12)], [f"acl-{i}" for i in range(24)]
    try:
        await stage_rollouts(cluster.url, [*warm_up, *ids], calls=1, cluster=True)
        async with RedisCluster.from_url(cluster.url) as client:
            for rollout_id in [*warm_up, *ids]:
                await finished(client, rollout_id, reward=1.0)
        async with RolloutReader.from_url(cluster.url, cluster=True, consumer_name="rank-0") as reader:
            async with running_assembler(cluster.url, cluster=True, block_ms=50):
                await pull_until(reader, len(warm_up) + len(ids))
            await reader.ack(warm_up)  # every node's connections open, the script mode known
            with count_round_trips() as sends:
                outcome = await reader.ack(ids)
        assert sorted(outcome.removed) == sorted(ids)
        # At most one pipeline per primary and batched step, and one MULTI per receipts stream; before
        # batching, about 3 sends per rollout.
        assert sends.count <= BATCHED_STEPS * 3 + DEFAULT_SHARDS < 3 * len(ids)
        with redis.RedisCluster.from_url(cluster.url) as check:
            assert not any(check.exists(ledger_stream("stg", rollout_id)) for rollout_id in ids)
    finally:
        await _clear(cluster)
