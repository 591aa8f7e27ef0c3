"""Replication and failover suite: a paused replica under min_replicas=1, a killed cluster primary.

- Primary + replica, ``min_replicas=1``: SIGSTOP the replica while 32 tasks stage. Stages fail within
  ``confirm_timeout_s`` (plus queueing behind one batch, plus slack) with an error naming replicas; none
  that started and ended inside the pause is acknowledged; all succeed once it resumes, and the retries
  add no duplicate ``calls`` entries. Every acknowledged record is on the replica.
- Local 3+3 cluster: SIGKILL a primary while 48 tasks stage across all slots. Stages fail cleanly
  (``ok=False`` with a precise error, no exception, no hang) until the replica is promoted, then succeed;
  every acknowledged record is fetched back verified. With ``min_replicas=1`` the same holds once the
  killed node has rejoined as a replica, and no acknowledged record can be lost at all.
"""

from __future__ import annotations

import random
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import pytest
import redis

from sink.contract.records import StagedCallRecord
from sink.keys import calls_stream, record_key
from sink.server import DurableServer, find_server_binary
from sink.settings import SinkSettings
from sink.store.sink import AsyncRedisStagingSink
from sink.store.source import AsyncRedisStagingSource
from sink_tools.cluster import LocalCluster
from tests.helpers.processes import wait_for
from tests.helpers.reliability import audit_keyspace, record_measurement
from tests.helpers.staging import make_record

pytestmark = pytest.mark.anyio

CONFIRM_TIMEOUT_S = 0.5
STAGE_BOUND_S = 20.0
RECOVERY_BOUND_S = 30.0
TASKS = 32
_FAST_SYNC = {"repl-diskless-sync-delay": "0"}
"""A replica's first full sync starts at once instead of after the default 5 s delay."""


def _wait_link_up(primary: DurableServer, replica: DurableServer, timeout_s: float = RECOVERY_BOUND_S) -> None:
    """Wait until the replica is linked *and* acknowledges writes (``WAIT 1`` answers 1)."""
    deadline = time.monotonic() + timeout_s
    with replica.client() as client:
        wait_for(
            lambda: client.info("replication").get("master_link_status") == "up",
            lambda: f"the replica did not connect to its primary: {replica.log_tail()}",
            timeout_s=timeout_s,
        )
    with primary.client() as client:

        def acknowledged() -> bool:  # WAIT itself blocks up to 500 ms for the replica's acknowledgement
            client.set("replication-probe", "1")
            acked = int(client.execute_command("WAIT", 1, 500))
            client.delete("replication-probe")
            return acked >= 1

        wait_for(acknowledged, "the replica does not acknowledge writes", timeout_s=max(deadline - time.monotonic(), 0))


@pytest.fixture(params=["valkey-server", "redis-server"], ids=["valkey", "redis"])
def primary_and_replica(
    request: pytest.FixtureRequest, tmp_path: Path
) -> Iterator[tuple[DurableServer, DurableServer]]:
    binary = find_server_binary(str(request.param))
    with (
        DurableServer(binary=binary, data_dir=tmp_path / "primary", extra_config=_FAST_SYNC) as primary,
        DurableServer(binary=binary, data_dir=tmp_path / "replica", replica_of=(primary.host, primary.port)) as replica,
    ):
        _wait_link_up(primary, replica)
        yield primary, replica
        replica.resume()


@dataclass
class Attempt:
    key: str
    started: float
    ended: float
    ok: bool
    error: str | None


@dataclass
class PauseRun:
    records: dict[str, StagedCallRecord] = field(default_factory=dict)
    attempts: list[Attempt] = field(default_factory=list)
    paused_at: float = 0.0
    resumed_at: float = 0.0


@pytest.mark.redis
async def test_a_paused_replica_fails_concurrent_stages_within_the_deadline_then_recovers(
    primary_and_replica: tuple[DurableServer, DurableServer],
) -> None:
    primary, replica = primary_and_replica
    rng = random.Random(5)
    run = PauseRun()
    pause_after = rng.randrange(20, 120)
    stop = anyio.Event()
    pause_now = anyio.Event()
    failed_while_frozen = anyio.Event()  # every stager saw a stage fail while the replica was frozen
    recovered = anyio.Event()  # a stage begun after the resume was acknowledged
    acked = 0
    frozen_failures: set[int] = set()
    async with AsyncRedisStagingSink.from_url(
        primary.url, min_replicas=1, confirm_timeout_s=CONFIRM_TIMEOUT_S, writer_connections=4
    ) as sink:

        async def stager(task: int) -> None:
            nonlocal acked
            index = 0
            while not stop.is_set():
                record = make_record(f"rep-{task % 8}", f"t{task}-{index}", n_tokens=64)
                index += 1
                run.records[record.staging_key] = record
                started = time.monotonic()
                with anyio.fail_after(STAGE_BOUND_S):
                    result = await sink.stage(record)
                run.attempts.append(Attempt(record.staging_key, started, time.monotonic(), result.ok, result.error))
                acked += result.ok
                if acked >= pause_after:
                    pause_now.set()
                if not result.ok and run.paused_at and not run.resumed_at:
                    frozen_failures.add(task)
                    if len(frozen_failures) == TASKS:
                        failed_while_frozen.set()
                if result.ok and run.resumed_at and started > run.resumed_at:
                    recovered.set()

        async def pauser() -> None:
            await pause_now.wait()
            replica.pause()
            run.paused_at = time.monotonic()
            # The replica stays frozen until every stager's stage failed: a stage fails within its own deadline,
            # it never waits for the replica to come back (the per-stage bound is STAGE_BOUND_S).
            with anyio.fail_after(STAGE_BOUND_S):
                await failed_while_frozen.wait()
            replica.resume()
            run.resumed_at = time.monotonic()
            with anyio.fail_after(RECOVERY_BOUND_S):
                await recovered.wait()
            stop.set()

        async with anyio.create_task_group() as group:
            group.start_soon(pauser)
            for task in range(TASKS):
                group.start_soon(stager, task)

        failed = [a for a in run.attempts if not a.ok]
        assert failed, "no stage failed while the replica was paused"
        assert all(a.error is not None and "required replicas acknowledged" in a.error for a in failed), failed[:3]
        slowest = max(a.ended - a.started for a in failed)  # a measurement: wall time depends on the machine's load
        inside = [a for a in run.attempts if a.ok and a.started > run.paused_at and a.ended < run.resumed_at]
        assert inside == [], f"acknowledged while the replica was frozen: {inside[:3]}"
        assert any(a.ok and a.started > run.resumed_at for a in run.attempts), "nothing succeeded after resume"

        retries = 0
        with anyio.fail_after(RECOVERY_BOUND_S):
            for attempt in failed:
                while not (await sink.stage(run.records[attempt.key])).ok:
                    retries += 1
                    await anyio.sleep(0.05)

    with primary.client() as client:
        audit = audit_keyspace([client])
        for rollout in {r.rollout_id for r in run.records.values()}:
            expected = sum(1 for key in run.records if key.startswith(rollout + "/"))
            assert client.xlen(calls_stream("stg", rollout)) == expected
    audit.assert_consistent()
    assert audit.all_record_keys() == set(run.records)
    with replica.client() as client:  # min_replicas=1: every acknowledged record reached the replica
        missing = [key for key in run.records if not client.exists(record_key("stg", key))]
    assert missing == []
    record_measurement(
        "replica_pause",
        server=primary.binary.name,
        stages=len(run.attempts),
        failed_during_pause=len(failed),
        slowest_failure_s=round(slowest, 3),
        retried_after_resume=len(failed),
        retry_failures=retries,
        lost=0,
        duplicates=0,
    )


@pytest.mark.redis
@pytest.mark.parametrize(
    "binary_name",
    [
        pytest.param("valkey-server", id="valkey"),
        pytest.param("redis-server", id="redis"),
    ],
)
async def test_a_retry_during_the_pause_is_not_acknowledged(binary_name: str, tmp_path: Path) -> None:
    """A gate retrying a failed stage from another process while the replica is still frozen."""
    binary = find_server_binary(binary_name)
    with (
        DurableServer(binary=binary, data_dir=tmp_path / "p", extra_config=_FAST_SYNC) as primary,
        DurableServer(binary=binary, data_dir=tmp_path / "r", replica_of=(primary.host, primary.port)) as replica,
    ):
        _wait_link_up(primary, replica)
        settings = SinkSettings(min_replicas=1, confirm_timeout_s=CONFIRM_TIMEOUT_S)
        record = make_record("retry-pause", "c1")
        async with AsyncRedisStagingSink.from_url(primary.url, settings) as first:
            assert (await first.stage(make_record("retry-pause", "c0"))).ok
            replica.pause()
            try:
                assert not (await first.stage(record)).ok
                async with AsyncRedisStagingSink.from_url(primary.url, settings) as second:
                    with anyio.fail_after(STAGE_BOUND_S):
                        retried = await second.stage(record)
            finally:
                replica.resume()
    assert not retried.ok, "acknowledged with min_replicas=1 although the only replica was frozen"
    assert retried.error is not None and "replicas" in retried.error


@pytest.mark.redis
async def test_replica_errors_name_replicas_even_when_command_timeout_is_shorter(
    primary_and_replica: tuple[DurableServer, DurableServer],
) -> None:
    primary, replica = primary_and_replica
    # The command timeout is shorter than the confirmation's, with room for a busy machine's fsync and reply.
    async with AsyncRedisStagingSink.from_url(
        primary.url, min_replicas=1, confirm_timeout_s=3.0, command_timeout_s=2.0
    ) as sink:
        replica.pause()
        try:
            with anyio.fail_after(STAGE_BOUND_S):
                result = await sink.stage(make_record("short-timeout", "c1"))
        finally:
            replica.resume()
    assert not result.ok and result.error is not None and "replicas" in result.error, result.error


# --- cluster failover ---------------------------------------------------------------------------------

_CLEAN_CLUSTER_ERROR = re.compile(
    r"ConnectionError|TimeoutError|cluster topology changed|ClusterDownError|TryAgainError|MovedError|"
    r"cannot route the write|required replicas acknowledged|interrupted before it was confirmed|"
    r"cannot verify durability|ReadOnlyError|READONLY|"
    # The killed node, restarted (heal_after_kill), answers LOADING until its data is loaded: an outage (the
    # stage fails and is tried again), met on a busy machine.
    r"BusyLoadingError"
)


@dataclass
class FailoverRun:
    records: dict[str, StagedCallRecord] = field(default_factory=dict)
    acked: set[str] = field(default_factory=set)
    errors: list[str] = field(default_factory=list)
    failed_keys: set[str] = field(default_factory=set)
    killed_at: float = 0.0
    last_recovery_s: float = 0.0


def _wait_for_promotion(cluster: LocalCluster) -> None:
    wait_for(lambda: len(cluster.primaries()) >= 3, "no replica was promoted", timeout_s=RECOVERY_BOUND_S)


def _prepare_cluster(cluster: LocalCluster) -> None:
    for node in cluster.nodes:
        if node.running:
            with node.client() as client:
                client.config_set("repl-diskless-sync-delay", "0")


async def _stage_through_failover(
    cluster: LocalCluster, *, min_replicas: int, seed: int, prefix: str, heal_after_kill: bool
) -> tuple[FailoverRun, DurableServer]:
    await anyio.to_thread.run_sync(cluster.heal)  # start from a healthy cluster whatever ran before
    _prepare_cluster(cluster)
    rng = random.Random(seed)
    run = FailoverRun()
    kill_after = rng.randrange(50, 200)
    victim = rng.choice(cluster.primaries())
    kill_now = anyio.Event()
    killed = anyio.Event()

    async with AsyncRedisStagingSink.from_url(
        cluster.url,
        cluster=True,
        min_replicas=min_replicas,
        confirm_timeout_s=CONFIRM_TIMEOUT_S,
        connect_timeout_s=1.0,
        command_timeout_s=2.0,
    ) as sink:

        async def stager(task: int) -> None:
            for index in range(12):
                record = make_record(f"{prefix}-{task}", f"c{index}", n_tokens=32)
                run.records[record.staging_key] = record
                while True:
                    with anyio.fail_after(STAGE_BOUND_S):
                        result = await sink.stage(record)
                    if result.ok:
                        break
                    assert result.error is not None
                    run.errors.append(result.error)
                    if killed.is_set():
                        run.failed_keys.add(record.staging_key)
                        assert time.monotonic() - run.killed_at < RECOVERY_BOUND_S, "stages did not recover in time"
                    elif not kill_now.is_set():
                        # Before the kill only a replica's confirmation later than CONFIRM_TIMEOUT_S (a busy
                        # machine) may fail a stage; it is staged again like any failed one.
                        assert "required replicas acknowledged" in result.error, f"failure before the kill: {result.error}"
                    await anyio.sleep(0.1)
                run.acked.add(record.staging_key)
                if record.staging_key in run.failed_keys:
                    run.last_recovery_s = max(run.last_recovery_s, time.monotonic() - run.killed_at)
                if len(run.acked) >= kill_after:
                    kill_now.set()
                if killed.is_set():
                    await anyio.sleep(0.02)  # keep staging through the failover at a gentle pace

        async def killer() -> None:
            await kill_now.wait()
            run.killed_at = time.monotonic()
            victim.kill()
            killed.set()
            if heal_after_kill:
                # min_replicas=1: the promoted replica has no replica until the killed node rejoins.
                await anyio.to_thread.run_sync(_wait_for_promotion, cluster)
                await anyio.to_thread.run_sync(cluster.heal)

        with anyio.fail_after(RECOVERY_BOUND_S + 30):
            async with anyio.create_task_group() as group:
                group.start_soon(killer)
                for task in range(48):
                    group.start_soon(stager, task)
    return run, victim


async def _check_failover_run(cluster: LocalCluster, run: FailoverRun, name: str, min_replicas: int) -> None:
    assert run.killed_at > 0, "the primary was never killed"
    assert run.errors, "no stage failed: the kill did not hit a slot in use"
    unclean = [error for error in run.errors if not _CLEAN_CLUSTER_ERROR.search(error)]
    assert unclean == [], unclean[:5]
    assert run.acked == set(run.records)
    keys = sorted(run.acked)
    async with AsyncRedisStagingSource.from_url(cluster.url, cluster=True) as source:
        blobs = await source.fetch_blobs(keys)
        lost = [key for key, blob in zip(keys, blobs, strict=True) if blob is None]
        assert lost == [], f"{len(lost)} acknowledged records lost in the failover: {lost[:5]}"
        fetched = await source.fetch(keys)
    assert [s.digest for s in fetched] == [run.records[key].digest for key in keys]
    clients = [node.client() for node in cluster.primaries()]
    try:
        audit = audit_keyspace(clients)
    finally:
        for client in clients:
            client.close()
    audit.assert_consistent()
    record_measurement(
        name,
        server="valkey-server (3+3 cluster)",
        min_replicas=min_replicas,
        stages=len(run.records),
        failed_attempts=len(run.errors),
        failed_records=len(run.failed_keys),
        recovery_s=round(run.last_recovery_s, 2),
        lost=len(lost),
    )


def _flush_cluster(cluster: LocalCluster) -> None:
    with redis.RedisCluster.from_url(cluster.url) as client:
        client.flushall(target_nodes=redis.RedisCluster.PRIMARIES)


@pytest.mark.timeout(120)  # its own bounds: promotion within 30 s, the run within 60 s
async def test_killing_a_cluster_primary_fails_stages_cleanly_until_promotion(cluster: LocalCluster) -> None:
    try:
        run, _victim = await _stage_through_failover(
            cluster, min_replicas=0, seed=41, prefix="fo0", heal_after_kill=False
        )
        # Checked before healing: the killed node must not be the one that still holds the records.
        await _check_failover_run(cluster, run, "cluster_failover_min_replicas_0", 0)
    finally:
        await anyio.to_thread.run_sync(cluster.heal)
        _flush_cluster(cluster)


@pytest.mark.timeout(120)  # its own bounds: promotion within 30 s, the run within 60 s
async def test_with_min_replicas_no_acknowledged_record_is_lost_in_a_failover(cluster: LocalCluster) -> None:
    try:
        run, _victim = await _stage_through_failover(
            cluster, min_replicas=1, seed=43, prefix="fo1", heal_after_kill=True
        )
        await _check_failover_run(cluster, run, "cluster_failover_min_replicas_1", 1)
    finally:
        await anyio.to_thread.run_sync(cluster.heal)
        _flush_cluster(cluster)
