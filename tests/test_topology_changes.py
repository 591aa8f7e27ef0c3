"""The services ride out a cluster's topology changes while rollouts flow.

On the local 3-primary, 3-replica Valkey cluster, with ``staging-sink assembler``, ``trainer``, ``prune
--interval-s`` and ``metrics`` running as users run them (``--cluster``), rollouts are staged (sink and ledger)
and finished before, during and after each change:

- a graceful ``CLUSTER FAILOVER`` on a replica (the old primary stays up and answers ``MOVED``, and a read
  blocked on it is ``UNBLOCKED``);
- a primary killed (SIGKILL) once its replica caught up, and the replica promoted (the stager then waits for a
  replica again: ``min_replicas=1``; see :func:`tests.helpers.topology.kill_and_promote` for what a kill inside
  the replication lag may lose);
- a live migration of the slots holding in-flight rollouts (``SETSLOT IMPORTING``/``MIGRATING``, every key
  ``MIGRATE`` d, the services meeting ``ASK`` until ``SETSLOT NODE``).

In each: every finished rollout is verified by the trainer exactly once, none is skipped, no service exits (each
exits 0 on SIGTERM at the end), and the services' own lines show the topology reply they rode out. Every wait is
on a condition with a generous deadline.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import anyio
import httpx
import pytest
import redis

from sink.keys import done_stream, receipts_stream
from sink_tools.cluster import LocalCluster
from tests.helpers.topology import (
    RolloutFlow,
    Services,
    begin_migration,
    end_migration,
    fail_over,
    fresh_namespace,
    kill_and_promote,
    move_keys,
    owner_of,
    rollout_ids_on,
    running_services,
    settle_migration,
    shared_slots,
    slot_of,
    slot_of_rollout,
)

pytestmark = [pytest.mark.anyio, pytest.mark.slow, pytest.mark.timeout(420)]


def _check_outcome(services: Services, flow: RolloutFlow, changed_by: list[str]) -> None:
    """Exactly once, nothing skipped, every service still up; each of *changed_by* logged the reply it rode out."""
    services.assert_running()
    verified = services.verified()
    assert {rollout_id: verified[rollout_id] for rollout_id in flow.finished_ids} == dict.fromkeys(
        flow.finished_ids, 1
    ), "a finished rollout was not verified exactly once"
    assert set(verified) == set(flow.finished_ids)
    assert services.skipped() == []
    for name in changed_by:
        assert services.topology_lines(name), f"{name} met no topology reply: {services.commands[name].lines('stderr')}"
    codes = services.stop()
    assert codes == dict.fromkeys(codes, 0), {name: services.commands[name].lines("stderr")[-10:] for name in codes}


async def _flowing_through(
    services: Services, flow: RolloutFlow, change: Callable[[], Awaitable[None]], enough_after: int = 6
) -> None:
    """Rollouts staged and finished one after another while *change* runs, until *enough_after* more finished
    after it; a service that exits meanwhile fails the test at once."""
    stop, stopped = anyio.Event(), anyio.Event()
    async with anyio.create_task_group() as group:
        group.start_soon(services.watch)
        group.start_soon(flow.keep_flowing, "during", stop, stopped)
        await change()
        finished_at_change = len(flow.finished_ids)
        await services.until(lambda: len(flow.finished_ids) >= finished_at_change + enough_after, "the flow stalled")
        stop.set()
        await stopped.wait()
        group.cancel_scope.cancel()


def _scrape_shows_collection_up(services: Services, namespace: str) -> bool:
    """Whether the metrics exporter's latest scrape says its last collection of the Redis gauges succeeded."""
    line = services.commands["metrics"].wait_for(r"^metrics at http://\S+", "stdout")
    url = line.split()[2]
    try:
        body = httpx.get(url, timeout=5).text
    except httpx.HTTPError:
        return False
    return f'staging_sink_collection_up{{namespace="{namespace}"}} 1.0' in body


async def test_the_services_ride_out_a_graceful_failover(cluster: LocalCluster) -> None:
    namespace = "topo-failover"
    async with fresh_namespace(cluster, namespace):
        with running_services(cluster.url, namespace) as services:
            async with RolloutFlow(cluster.url, namespace) as flow:
                before = [f"before-{n}" for n in range(8)]
                await flow.complete(before)
                await services.until_verified(before)  # every service is up and working
                # The primary of done shard 0: the assembler's read is blocked on it when it steps down.
                victim = owner_of(cluster, slot_of(done_stream(namespace, 0)))
                in_flight = rollout_ids_on(cluster, victim, "inflight", 6)
                await flow.stage_all(in_flight)  # staged, not finished yet: in flight across the failover

                async def change() -> None:
                    await anyio.to_thread.run_sync(fail_over, cluster, victim)
                    await flow.finish_all(in_flight)

                await _flowing_through(services, flow, change)
                await services.until_verified(flow.finished_ids)
            await services.until(lambda: _scrape_shows_collection_up(services, namespace), "metrics never recovered")
            _check_outcome(services, flow, ["assembler"])


async def test_the_services_ride_out_a_killed_primary(cluster: LocalCluster) -> None:
    namespace = "topo-kill"
    async with fresh_namespace(cluster, namespace):
        with running_services(cluster.url, namespace) as services:
            # min_replicas=1: a record is acknowledged only once on a replica; the promoted primary has none until
            # the killed node rejoins, and stages wait for it.
            async with RolloutFlow(cluster.url, namespace, min_replicas=1) as flow:
                before = [f"before-{n}" for n in range(8)]
                await flow.complete(before)
                await services.until_verified(before)
                # A primary of a done shard, not the node the services were pointed at.
                owners = [owner_of(cluster, slot_of(done_stream(namespace, shard))) for shard in range(4)]
                victim = next(node for node in owners if node.port != cluster.nodes[0].port)
                in_flight = rollout_ids_on(cluster, victim, "inflight", 6)
                await flow.stage_all(in_flight)

                async def change() -> None:
                    await anyio.to_thread.run_sync(kill_and_promote, cluster, victim)
                    # The promoted primary has no replica until the killed node rejoins as one.
                    await anyio.to_thread.run_sync(cluster.heal)
                    await flow.finish_all(in_flight)

                await _flowing_through(services, flow, change)
                await services.until_verified(flow.finished_ids)
            await services.until(lambda: _scrape_shows_collection_up(services, namespace), "metrics never recovered")
            _check_outcome(services, flow, [])


async def test_the_services_ride_out_a_live_slot_migration(cluster: LocalCluster) -> None:
    namespace = "topo-migration"
    async with fresh_namespace(cluster, namespace):
        # The trainer starts once the slots are migrating, so receipts of rollouts in them are waiting for it.
        with running_services(cluster.url, namespace, ["assembler", "prune", "metrics"]) as services:
            async with RolloutFlow(cluster.url, namespace) as flow:
                source = owner_of(cluster, slot_of_rollout("before-0"))
                target = next(node for node in cluster.primaries() if node.port != source.port)
                avoid = shared_slots(namespace)
                receipted = rollout_ids_on(cluster, source, "receipted", 4, avoid=avoid)
                avoid |= {slot_of_rollout(rollout_id) for rollout_id in receipted}
                in_flight = rollout_ids_on(cluster, source, "inflight", 4, avoid=avoid)
                await flow.complete(receipted)
                await flow.stage_all(in_flight)
                await services.until(lambda: _published(cluster.url, namespace) >= set(receipted), "no receipts")
                slots = sorted({slot_of_rollout(rollout_id) for rollout_id in [*receipted, *in_flight]})

                migrating = False

                async def change() -> None:
                    nonlocal migrating
                    migrating = True
                    await anyio.to_thread.run_sync(begin_migration, source, target, slots)
                    assert await anyio.to_thread.run_sync(move_keys, source, target, slots) > 0
                    # Every key is on the target, the source still owns the slots: every access meets ASK.
                    services.start("trainer")
                    await flow.finish_all(in_flight)
                    names = ("trainer", "assembler", "prune")
                    await services.until(
                        lambda: all(services.topology_lines(name) for name in names),
                        lambda: f"a service did not meet the migration: { {n: services.commands[n].lines('stderr')[-5:] for n in names} }",
                    )
                    await anyio.to_thread.run_sync(end_migration, cluster, source, target, slots)
                    migrating = False

                try:
                    await _flowing_through(services, flow, change)
                finally:
                    if migrating:  # the shared cluster must not keep slots half migrated
                        await anyio.to_thread.run_sync(settle_migration, cluster, source, target, slots)
                await services.until_verified(flow.finished_ids)
            await services.until(lambda: _scrape_shows_collection_up(services, namespace), "metrics never recovered")
            _check_outcome(services, flow, ["trainer", "assembler", "prune"])


def _published(url: str, namespace: str) -> set[str]:
    """Rollout ids of every receipt entry in the namespace's receipts streams."""
    found: set[str] = set()
    with redis.RedisCluster.from_url(url) as client:
        for shard in range(4):
            for _entry_id, fields in client.xrange(receipts_stream(namespace, shard)):
                found.add(fields[b"rollout_id"].decode())
    return found
