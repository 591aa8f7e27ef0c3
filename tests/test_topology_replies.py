"""A cluster's topology replies are outages with their real code, and every path rides them out.

Unit level, on real servers: ``MOVED`` (a key asked of a primary that does not serve it), ``ASK`` and
``TRYAGAIN`` (a slot of the local cluster set migrating), ``READONLY`` (a writing script without keys on a
replica), ``CLUSTERDOWN`` (a cluster node that serves no slot) and ``UNBLOCKED`` (a read blocked on a primary that
steps down) translate to :class:`~sink.errors.StagingUnavailableError` with the reply's code; a refusal keeps its
own (``WRONGTYPE``).

Then each path right after a graceful ``CLUSTER FAILOVER`` (the client's slot map still names the old primary,
which answers ``MOVED``): a consumer group's blocked read (not mistaken for a deleted group), the trainer's
``RolloutReader`` and ``GroupReader`` under the services' outage policy, the capture proxy (ledger, gate and
stage) and the NeMo Gym transport. The services themselves (assembler, trainer, prune, metrics) are run across a
failover, a killed primary and a live migration in ``tests/test_topology_changes.py``.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import pytest
import redis
import redis.asyncio as aioredis
import redis.exceptions as redis_errors

from sink.errors import StagingRefusedError, StagingUnavailableError
from sink.gym import RedisTokenSink, RedisTokenSource
from sink.keys import group_keys, receipts_stream
from sink.rollout.done_event import finished
from sink.server import DurableServer
from sink.service import OutagePolicy
from sink.settings import ConnectionSettings, ReaderSettings
from sink.store.connection import Topology, translate_redis_error
from sink.store.healing import SelfHealingGroupConsumer
from sink.store.source import AsyncRedisStagingSource
from sink.store.streams import StreamEntry
from sink.trainer.groups import GroupReader, RolloutGroup
from sink.trainer.reader.rollout_reader import RolloutReader
from sink_tools.cluster import LocalCluster
from tests.helpers.e2e import pull_until, running_assembler
from tests.helpers.gym import make_entry
from tests.helpers.processes import until
from tests.helpers.proxy import RecordingEngine, close_clients, finish, proxy_before, run_agent
from tests.helpers.topology import (
    RolloutFlow,
    begin_migration,
    clear_namespace,
    fail_over,
    fresh_namespace,
    owner_of,
    rollout_ids_on,
    slot_of,
)

# A cluster failover waits on the servers (a manual failover may be asked again on a busy machine): more than the
# default per-test timeout, bounded by the helpers' own deadlines.
pytestmark = [pytest.mark.anyio, pytest.mark.timeout(300)]


def _unavailable(exc: BaseException, code: str) -> None:
    """*exc* (a redis-py error) translates to an outage carrying *code*, also after pickling."""
    assert isinstance(exc, redis_errors.RedisError)
    translated = translate_redis_error(exc, "run a command")
    assert type(translated) is StagingUnavailableError, translated
    assert translated.code == code, translated
    copy = pickle.loads(pickle.dumps(translated))
    assert type(copy) is StagingUnavailableError and copy.code == code and str(copy) == str(translated)


def _caught(kind: type[redis_errors.RedisError], call: Callable[[], object]) -> redis_errors.RedisError:
    with pytest.raises(kind) as caught:
        call()
    return caught.value


def _key_on(cluster: LocalCluster, node: DurableServer, name: str) -> str:
    """A key ``topo-replies:{...}:<name>`` whose slot *node* serves."""
    (tag,) = rollout_ids_on(cluster, node, f"replies-{name}", 1)
    return f"topo-replies:{{{tag}}}:{name}"


async def test_each_topology_reply_is_an_outage_with_its_reply_code(cluster: LocalCluster, tmp_path: Path) -> None:
    await anyio.to_thread.run_sync(cluster.heal)
    source, target = cluster.primaries()[:2]
    kept = _key_on(cluster, source, "kept")
    missing = kept.replace(":kept", ":missing")  # the same hash tag: the same slot
    slot = slot_of(kept)
    with source.client() as on_source, target.client() as on_target:
        on_source.set(kept, "x")
        _unavailable(_caught(redis_errors.MovedError, lambda: on_target.get(kept)), "MOVED")
        begin_migration(source, target, [slot])
        try:
            _unavailable(_caught(redis_errors.AskError, lambda: on_source.get(missing)), "ASK")
            _unavailable(_caught(redis_errors.TryAgainError, lambda: on_source.mget(kept, missing)), "TRYAGAIN")
        finally:
            for client in (on_target, on_source):
                client.execute_command("CLUSTER", "SETSLOT", slot, "STABLE")
        on_source.set(kept, "a string")
        refused = translate_redis_error(_caught(redis_errors.ResponseError, lambda: on_source.lpush(kept, "y")), "x")
        assert type(refused) is StagingRefusedError and refused.code == "WRONGTYPE"  # a refusal keeps its code
        on_source.delete(kept)
    with cluster.replicas()[0].client() as replica:
        script = "return redis.call('SET', ARGV[1], 'x')"  # no keys: the replica runs it, and refuses the write
        _unavailable(_caught(redis_errors.ReadOnlyError, lambda: replica.eval(script, 0, kept)), "READONLY")
    with DurableServer(data_dir=tmp_path / "lone", cluster_enabled=True) as lone, lone.client() as client:
        _unavailable(_caught(redis_errors.ClusterDownError, lambda: client.get("k")), "CLUSTERDOWN")  # no slots


async def _read_when_redirects_settle(consumer: SelfHealingGroupConsumer) -> list[StreamEntry]:
    entries: list[StreamEntry] = []
    redirects: list[str] = []

    async def served() -> bool:
        try:
            entries[:] = await consumer.read_new([0], count=10, block_ms=None)
        except StagingUnavailableError as exc:
            if exc.code != "MOVED":
                raise
            redirects.append(str(exc))
            return False
        return True

    await until(served, lambda: f"the read was still redirected after 30 s: {redirects[-1:]}", timeout_s=30)
    return entries


async def test_a_read_blocked_on_a_primary_that_steps_down_is_an_outage_not_a_lost_group(
    cluster: LocalCluster,
) -> None:
    await anyio.to_thread.run_sync(cluster.heal)
    victim = cluster.primaries()[0]
    stream = _key_on(cluster, victim, "done")
    topology = Topology.from_url(cluster.url, ConnectionSettings(cluster=True))
    consumer = SelfHealingGroupConsumer(
        topology,
        namespace="topo-replies",
        role="done",
        streams=[stream],
        group="g",
        consumer="c",
        claim_idle_ms=60_000,
        max_deliveries=5,
    )
    try:
        await consumer.prepare()
        failure: list[BaseException] = []

        async def blocked_read() -> None:
            try:
                # Blocked longer than any failover takes (a busy machine may ask for it more than once): the step-down
                # ends this read, never its own timeout.
                await consumer.read_new([0], count=10, block_ms=60_000)
            except Exception as exc:  # noqa: BLE001 (checked below: the test's subject)
                failure.append(exc)

        async with anyio.create_task_group() as group:
            group.start_soon(blocked_read)
            with victim.client() as client:
                await until(
                    lambda: int(client.info("clients")["blocked_clients"]) >= 1,
                    "the read never blocked on the victim",
                    timeout_s=60,
                )
            await anyio.to_thread.run_sync(fail_over, cluster, victim)
        assert len(failure) == 1 and type(failure[0]) is StagingUnavailableError, failure
        assert failure[0].code in ("UNBLOCKED", "MOVED"), failure[0]
        assert consumer.groups_recreated == 0  # the stream and its group are intact: nothing to recreate
        async with aioredis.RedisCluster.from_url(cluster.url) as client:
            await client.xadd(stream, {"n": "1"})
        # The slot map was reloaded; a node asked right after the failover may still hand out the old map (the new
        # configuration reaches the other nodes by gossip, slower on a busy machine), so, as a service does, the
        # read is sent again while it is redirected.
        entries = await _read_when_redirects_settle(consumer)
        assert [entry.fields for entry in entries] == [{"n": "1"}]
        assert consumer.groups_recreated == 0
    finally:
        await topology.aclose()
        await anyio.to_thread.run_sync(clear_namespace, cluster, "topo-replies")


def _group_on(cluster: LocalCluster, node: DurableServer, namespace: str) -> str:
    """A group id whose record (``ns:{grp:<id>}:*``) lives on *node*."""
    ids = (f"g-{n}" for n in range(10_000))
    return next(g for g in ids if owner_of(cluster, slot_of(group_keys(namespace, g)[0])).port == node.port)


async def test_the_reader_and_the_group_reader_ride_out_a_failover(cluster: LocalCluster) -> None:
    namespace = "topo-groups"
    async with fresh_namespace(cluster, namespace), RolloutFlow(cluster.url, namespace) as flow:
        victim = owner_of(cluster, slot_of(receipts_stream(namespace, 0)))
        members = rollout_ids_on(cluster, victim, "member", 4)
        group_id = _group_on(cluster, victim, namespace)
        fields: dict[str, Any] = {"cluster": True, "namespace": namespace}
        settings = ReaderSettings(**fields, reconnect_backoff_s=0.05, reconnect_backoff_max_s=0.5)
        lines: list[str] = []
        outage = OutagePolicy(settings, "group reader", report=lines.append)

        async def publish(rollout_ids: list[str], group: str) -> None:
            await flow.stage_all(rollout_ids)
            for rollout_id in rollout_ids:
                await finished(flow.client, rollout_id, reward=1.0, group_id=group, group_size=2, namespace=namespace)

        async def pull_group(reader: GroupReader) -> RolloutGroup:
            groups: list[RolloutGroup] = []
            with anyio.fail_after(60):
                while not groups:
                    groups += await outage.call(partial(reader.pull_groups, 8, block_ms=100), "running")
            await outage.call(partial(reader.ack_groups, groups), "running")
            return groups[0]

        async with (
            running_assembler(cluster.url, block_ms=50, **fields),
            RolloutReader.from_url(cluster.url, settings) as rollout_reader,
        ):
            reader = GroupReader(rollout_reader)
            await publish(members[:2], "before")
            assert sorted((await pull_group(reader)).rollout_ids) == members[:2]
            await anyio.to_thread.run_sync(fail_over, cluster, victim)
            # Nothing published on the other shards: the read of the stepped-down primary's shard answers first.
            assert await outage.call(partial(reader.pull_groups, 8, block_ms=100), "running") == []
            assert any("MOVED" in line or "Moved" in line for line in lines), lines
            await publish(members[2:], group_id)
            after = await pull_group(reader)
        assert after.complete and sorted(after.rollout_ids) == members[2:] and not after.failed
        assert rollout_reader.statistics().double_deliveries == 0


async def test_the_capture_proxy_rides_out_a_failover(cluster: LocalCluster) -> None:
    namespace = "topo-proxy"
    async with fresh_namespace(cluster, namespace):
        victim = cluster.primaries()[0]
        (rollout_id,) = rollout_ids_on(cluster, victim, "proxied", 1)
        engine = RecordingEngine()
        with proxy_before(engine, cluster.url, cluster=True, namespace=namespace) as (url, _app):

            def fail_over_before_the_third_call(turn: int) -> None:
                if turn == 2:  # the ledger, the staged prefix and the stage: all on the stepped-down primary's slot
                    fail_over(cluster, victim)

            try:
                _, last_id = await anyio.to_thread.run_sync(
                    partial(run_agent, [url], rollout_id, 4, before_turn=fail_over_before_the_third_call)
                )
            finally:
                close_clients()
            await anyio.to_thread.run_sync(finish, url, rollout_id, 1.0, last_id)  # the gate announces it
        settings = ReaderSettings(cluster=True, namespace=namespace)
        async with (
            running_assembler(cluster.url, block_ms=50, cluster=True, namespace=namespace),
            RolloutReader.from_url(cluster.url, settings) as reader,
        ):
            (pulled,) = await pull_until(reader, 1, timeout_s=60)
        assert pulled.trainable, (pulled.skip_code, pulled.skip_reason)  # every call captured: none lost
        assert pulled.row is not None and len(pulled.row.model_call_ids) == 4


async def test_the_gym_transport_rides_out_a_failover(cluster: LocalCluster) -> None:
    namespace = "topo-gym"
    async with fresh_namespace(cluster, namespace):
        victim = cluster.primaries()[0]
        (rollout_id,) = rollout_ids_on(cluster, victim, "gym", 1)
        sink = RedisTokenSink(redis_url=cluster.url, namespace=namespace, cluster=True)
        source = RedisTokenSource(redis_url=cluster.url, namespace=namespace, cluster=True)
        try:
            await sink.put(make_entry(rollout_id, "c1"))
            await anyio.to_thread.run_sync(fail_over, cluster, victim)
            await sink.put(make_entry(rollout_id, "c2"))  # the old primary answers MOVED: written on the new one
            snapshot = await source.freeze(rollout_id)
            assert [entry.model_call_id for entry in snapshot.entries] == ["c1", "c2"] and not snapshot.incomplete
            assert await source.drop(rollout_id, snapshot_id=snapshot.snapshot_id, version=snapshot.version)
        finally:
            await sink.close()
            await source.close()


@pytest.mark.redis
def test_a_plain_server_replica_refusing_a_write_is_an_outage_too(tmp_path: Path) -> None:
    """``READONLY`` from a standalone replica (a primary demoted by an operator or Sentinel) is the same outage."""
    with (
        DurableServer(data_dir=tmp_path / "primary") as primary,
        DurableServer(data_dir=tmp_path / "replica", replica_of=(primary.host, primary.port)) as replica,
        redis.Redis(host=replica.host, port=replica.port) as client,
    ):
        _unavailable(_caught(redis_errors.ReadOnlyError, lambda: client.set("k", "v")), "READONLY")


async def test_a_cluster_fetch_that_fails_on_one_node_raises_one_typed_error(cluster: LocalCluster) -> None:
    # A fetch reads each slot with its own MGET, concurrently. One node paused past the command timeout: the caller
    # gets one StagingUnavailableError, as from a single server, not an ExceptionGroup of redis-py errors.
    await anyio.to_thread.run_sync(cluster.heal)
    answering, paused = cluster.primaries()[:2]
    keys = [f"{rollout_id}/c1" for rollout_id in rollout_ids_on(cluster, answering, "fetch-ok", 1)]
    keys += [f"{rollout_id}/c1" for rollout_id in rollout_ids_on(cluster, paused, "fetch-paused", 1)]
    async with AsyncRedisStagingSource.from_url(cluster.url, cluster=True, command_timeout_s=0.5) as source:
        paused.pause()
        try:
            with pytest.raises(StagingUnavailableError) as caught:
                await source.fetch(keys)
        finally:
            paused.resume()
    assert "Timeout reading from" in str(caught.value), caught.value
