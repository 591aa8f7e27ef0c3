"""Crash suite: SIGKILL the server while 64 tasks stage and record ledger rows, restart, audit.

Each round opens a sink and a ledger on a durable server, lets 64 tasks stage records (recording one
ledger row after each ``ok=True``, as a gate does), and SIGKILLs the server from a concurrent task after a
seeded random number of acknowledged stages. The server is restarted from the same directory and
checked against everything acknowledged in *all* rounds so far:

- every acknowledged record is fetched back through the source (digest re-verified);
- every acknowledged ledger row is in its rollout's manifest;
- the keyspace (SCAN) has no record without its ``calls`` entry, no entry without its record, no
  duplicated entry, and no ledger row without its record;
- stages in flight at the kill returned ``ok=False`` naming a connection error, within a bound.

The ten- and sixteen-round loops are in the slow tier (``slow``). A shorter loop would be flaky: in about a third
of the rounds only ledger writes are in flight at the kill, and the loop asserts that some stage was. The fast
tier's crashes are the two below.

A kill inside one large group-commit batch: every result is ``ok=True`` (and stored) or ``ok=False``.
A last test kills the server while the assembler is mid-batch: after the restart every finished rollout
is assembled and pulled exactly once, with its exact tokens.
"""

from __future__ import annotations

import random
import re
import time
from dataclasses import dataclass, field

import anyio
import pytest
import redis.asyncio as aioredis

from sink.contract.records import StagedCallRecord
from sink.errors import StagingConnectionError
from sink.ledger.redis import RedisCaptureLedger
from sink.rollout.assembler import finished
from sink.server import DurableServer
from sink.store.sink import AsyncRedisStagingSink
from sink.store.source import AsyncRedisStagingSource
from sink.trainer.reader.rollout_reader import RolloutReader
from tests.helpers.e2e import EventCounter, pull_until, running_assembler, stage_rollouts
from tests.helpers.reliability import audit_keyspace, commit_of, record_measurement
from tests.helpers.staging import make_record

pytestmark = pytest.mark.anyio

TASKS = 64
ROLLOUTS_PER_ROUND = 16
STAGES_PER_TASK = 40
STAGE_BOUND_S = 15.0
"""No single stage or ledger write may take longer than this (a hang fails the test)."""
_CONNECTION_ERROR = re.compile(r"ConnectionError|TimeoutError|Connection closed|Error 111|interrupted")


@dataclass
class CrashTally:
    """Everything acknowledged across rounds, and what the in-flight operations reported."""

    acked: dict[str, StagedCallRecord] = field(default_factory=dict)
    ledgered: set[str] = field(default_factory=set)
    stage_errors: list[str] = field(default_factory=list)
    ledger_errors: list[str] = field(default_factory=list)
    slowest_failure_s: float = 0.0


async def _crash_round(server: DurableServer, rng: random.Random, round_index: int, tally: CrashTally) -> None:
    kill_after = rng.randrange(1, 500)
    extra_delay_s = rng.random() * 0.01
    acked_this_round = 0
    kill_now = anyio.Event()
    killed = anyio.Event()
    sizes = [rng.choice((8, 64, 512)) for _ in range(TASKS)]

    async with (
        AsyncRedisStagingSink.from_url(server.url, connect_timeout_s=2, command_timeout_s=5) as sink,
        RedisCaptureLedger.from_url(server.url, connect_timeout_s=2, command_timeout_s=5) as ledger,
    ):

        async def stager(task: int) -> None:
            nonlocal acked_this_round
            for index in range(STAGES_PER_TASK):
                if killed.is_set():
                    return
                record = make_record(
                    f"k{round_index}-{task % ROLLOUTS_PER_ROUND}", f"t{task}-{index}", n_tokens=sizes[task]
                )
                started = time.monotonic()
                with anyio.fail_after(STAGE_BOUND_S):
                    result = await sink.stage(record)
                if not result.ok:
                    assert result.error is not None
                    tally.stage_errors.append(result.error)
                    tally.slowest_failure_s = max(tally.slowest_failure_s, time.monotonic() - started)
                    return
                tally.acked[record.staging_key] = record
                acked_this_round += 1
                if acked_this_round >= kill_after:
                    kill_now.set()
                try:
                    with anyio.fail_after(STAGE_BOUND_S):
                        await ledger.record(commit_of(record))
                except StagingConnectionError as exc:
                    tally.ledger_errors.append(str(exc))
                    return
                tally.ledgered.add(record.staging_key)

        async def killer() -> None:
            await kill_now.wait()
            await anyio.sleep(extra_delay_s)
            server.kill()
            killed.set()

        async with anyio.create_task_group() as group:
            group.start_soon(killer)
            for task in range(TASKS):
                group.start_soon(stager, task)
    assert killed.is_set(), f"round {round_index}: the kill threshold {kill_after} was never reached"


async def _verify_after_restart(server: DurableServer, tally: CrashTally) -> int:
    """Check every invariant on the restarted server; returns how many acknowledged records are missing."""
    keys = list(tally.acked)
    async with AsyncRedisStagingSource.from_url(server.url) as source:
        blobs = await source.fetch_blobs(keys)
        lost = [key for key, blob in zip(keys, blobs, strict=True) if blob is None]
        assert lost == [], f"{len(lost)} acknowledged records lost, e.g. {lost[:5]}"
        fetched = await source.fetch(keys)  # decodes and re-verifies every digest
    assert [snapshot.digest for snapshot in fetched] == [tally.acked[key].digest for key in keys]
    with server.client() as client:
        audit = audit_keyspace([client])
    audit.assert_consistent()
    assert set(keys) <= audit.all_record_keys()
    missing_rows = tally.ledgered - audit.ledger_keys()
    assert not missing_rows, f"acknowledged ledger rows lost: {sorted(missing_rows)[:5]}"
    assert audit.ledger_keys() <= set(keys) | audit.all_record_keys()
    return len(lost)


async def _run_crash_rounds(server: DurableServer, rounds: int, seed: int, name: str) -> None:
    rng = random.Random(seed)
    tally = CrashTally()
    for round_index in range(rounds):
        await _crash_round(server, rng, round_index, tally)
        server.restart()
        await _verify_after_restart(server, tally)
    # Stages and ledger writes cut by the kill failed cleanly, naming the connection problem.
    assert tally.stage_errors, "no stage was in flight at any kill: the test did not exercise the crash"
    unexpected = [error for error in tally.stage_errors + tally.ledger_errors if not _CONNECTION_ERROR.search(error)]
    assert unexpected == [], unexpected[:5]
    record_measurement(
        name,
        server=server.binary.name,
        rounds=rounds,
        acked_records=len(tally.acked),
        acked_ledger_rows=len(tally.ledgered),
        failed_in_flight=len(tally.stage_errors) + len(tally.ledger_errors),
        slowest_failure_s=round(tally.slowest_failure_s, 3),
        lost=0,
    )


@pytest.mark.slow
async def test_sigkill_during_concurrent_staging_loses_nothing_acknowledged(fresh_server: DurableServer) -> None:
    await _run_crash_rounds(fresh_server, rounds=10, seed=20240611, name="crash_sigkill")


@pytest.mark.slow
async def test_sigkill_many_rounds_loses_nothing_acknowledged(fresh_server: DurableServer) -> None:
    await _run_crash_rounds(fresh_server, rounds=16, seed=7, name="crash_sigkill_slow")


async def test_a_stage_racing_the_kill_is_never_acknowledged_without_persistence(fresh_server: DurableServer) -> None:
    """Kill in the middle of one big batch: each result is ok=True (and present) or ok=False, never in between."""
    records = [make_record("race", f"c{i}", n_tokens=2048) for i in range(400)]
    results: dict[str, bool] = {}
    first_ack = anyio.Event()
    async with AsyncRedisStagingSink.from_url(fresh_server.url, writer_connections=2, max_batch_records=32) as sink:

        async def stage(record: StagedCallRecord) -> None:
            with anyio.fail_after(STAGE_BOUND_S):
                results[record.staging_key] = ok = (await sink.stage(record)).ok
            if ok:
                first_ack.set()

        async def kill_soon() -> None:
            await first_ack.wait()
            await anyio.sleep(random.Random(3).random() * 0.02)
            fresh_server.kill()

        async with anyio.create_task_group() as group:
            for record in records:
                group.start_soon(stage, record)
            group.start_soon(kill_soon)
    fresh_server.restart()
    acked = [key for key, ok in results.items() if ok]
    assert len(results) == len(records)
    with fresh_server.client() as client:
        audit = audit_keyspace([client])
    audit.assert_consistent()
    assert set(acked) <= audit.all_record_keys()
    async with AsyncRedisStagingSource.from_url(fresh_server.url) as source:
        stored = sorted(audit.all_record_keys())
        assert [s.staging_key for s in await source.fetch(stored)] == stored  # whatever is stored verifies
    record_measurement(
        "crash_mid_batch",
        server=fresh_server.binary.name,
        acked_records=len(acked),
        failed_in_flight=len(records) - len(acked),
        stored_unacknowledged=len(audit.all_record_keys()) - len(acked),
        lost=0,
    )


async def test_sigkill_during_assembly_loses_no_finished_rollout(fresh_server: DurableServer) -> None:
    """Server killed while the assembler is mid-batch: after restart every finished rollout is trained once."""
    url = fresh_server.url
    ids = [f"asm-{i}" for i in range(24)]
    staged = {s.rollout_id: s for s in await stage_rollouts(url, ids, calls=3, n_tokens=16)}
    async with aioredis.Redis.from_url(url) as client:
        for rollout_id in ids:
            await finished(client, rollout_id, reward=1.0)
    counter = EventCounter(random.Random(17).randrange(1, 12))
    settings = {"block_ms": 50, "claim_idle_ms": 300, "reconnect_backoff_s": 0.1, "command_timeout_s": 2.0}
    with anyio.fail_after(60):
        async with running_assembler(url, before_ack=counter, consumer_name="asm-0", **settings) as assembler:
            await counter.reached.wait()
            fresh_server.kill()
            await anyio.to_thread.run_sync(fresh_server.restart)
            async with RolloutReader.from_url(url, consumer_name="rank-0") as reader:
                pulled = await pull_until(reader, len(ids), timeout_s=40)
    assert sorted(item.rollout_id for item in pulled) == sorted(ids)
    for item in pulled:
        assert item.trainable and item.row is not None, item
        assert item.row.token_ids == tuple(staged[item.rollout_id].token_ids)
    record_measurement(
        "crash_during_assembly",
        server=fresh_server.binary.name,
        rollouts=len(ids),
        events_before_kill=counter.target,
        assembler_failures=assembler.statistics().failures,
        lost=0,
    )
