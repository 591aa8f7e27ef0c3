"""Resource-limit suite: maxmemory reached under concurrency, and oversized records.

- ``maxmemory`` reached while 64 tasks stage and record ledger rows: failed stages come back ``ok=False``
  naming the out-of-memory error, ledger writes raise ``StagingConnectionError`` naming it, nothing is
  evicted, every record acknowledged before (and during) the pressure is intact, no batch is half
  written, and everything succeeds once memory is available again, without duplicate entries.
- Records over ``max_record_bytes`` are refused before any write (no key, no ``calls`` entry), mixed
  concurrently with records that fit; a source with a smaller limit refuses to return a stored record.
"""

from __future__ import annotations

import anyio
import pytest
import redis

from sink.contract.records import StagedCallRecord
from sink.errors import CodecError, StagingConnectionError
from sink.keys import calls_stream, record_key
from sink.ledger.redis import RedisCaptureLedger
from sink.server import DurableServer
from sink.store.sink import AsyncRedisStagingSink
from sink.store.source import AsyncRedisStagingSource
from tests.helpers.reliability import audit_keyspace, commit_of, record_measurement
from tests.helpers.staging import make_record

pytestmark = pytest.mark.anyio

NS = "stg"
STAGE_BOUND_S = 15.0


@pytest.mark.slow  # the fast tier's out-of-memory stage: tests/test_sink.py
async def test_out_of_memory_under_concurrency_fails_cleanly_and_evicts_nothing(
    redis_url: str, durable_server: DurableServer
) -> None:
    before = [make_record(f"oom-pre{i % 4}", f"c{i}", n_tokens=64) for i in range(100)]
    pressure = [make_record(f"oom{t % 8}", f"t{t}-{i}", n_tokens=4096) for t in range(64) for i in range(4)]
    acked: set[str] = set()
    ledgered: set[str] = set()
    stage_errors: list[str] = []
    ledger_errors: list[str] = []
    async with (
        AsyncRedisStagingSink.from_url(redis_url) as sink,
        RedisCaptureLedger.from_url(redis_url) as ledger,
    ):
        assert all([(await sink.stage(record)).ok for record in before])
        with redis.Redis.from_url(redis_url) as client:
            used = int(client.info("memory")["used_memory"])
            client.config_set("maxmemory", str(used + 1_000_000))  # room for a few dozen pressure records

        async def stager(task: int) -> None:
            for record in pressure[task * 4 : task * 4 + 4]:
                with anyio.fail_after(STAGE_BOUND_S):
                    result = await sink.stage(record)
                if not result.ok:
                    assert result.error is not None
                    stage_errors.append(result.error)
                    continue
                acked.add(record.staging_key)
                try:
                    with anyio.fail_after(STAGE_BOUND_S):
                        await ledger.record(commit_of(record))
                except StagingConnectionError as exc:
                    ledger_errors.append(str(exc))
                else:
                    ledgered.add(record.staging_key)

        async with anyio.create_task_group() as group:
            for task in range(64):
                group.start_soon(stager, task)

        assert stage_errors, "maxmemory was never reached"
        assert acked, "nothing fit below maxmemory"
        assert all("OutOfMemoryError" in error or "OOM" in error for error in stage_errors), stage_errors[:3]
        assert all("OOM" in error or "OutOfMemory" in error for error in ledger_errors), ledger_errors[:3]
        with redis.Redis.from_url(redis_url) as client:
            assert int(client.info("stats")["evicted_keys"]) == 0
            audit = audit_keyspace([client])  # no batch half-written under OOM
            audit.assert_consistent()
        async with AsyncRedisStagingSource.from_url(redis_url) as source:
            keys = [r.staging_key for r in before] + sorted(acked)
            by_key = {r.staging_key: r for r in before + pressure}
            fetched = await source.fetch(keys)  # every earlier and every acknowledged record verifies
        assert [s.digest for s in fetched] == [by_key[key].digest for key in keys]
        assert audit.all_record_keys() == set(keys)
        assert ledgered <= audit.ledger_keys()

        with redis.Redis.from_url(redis_url) as client:
            client.config_set("maxmemory", "0")
        for record in pressure:  # the gate's retries, now that memory is available
            assert (await sink.stage(record)).ok
            await ledger.record(commit_of(record))
    with redis.Redis.from_url(redis_url) as client:
        for rollout in {r.rollout_id for r in pressure}:
            assert client.xlen(calls_stream(NS, rollout)) == sum(1 for r in pressure if r.rollout_id == rollout)
        audit = audit_keyspace([client])
    audit.assert_consistent()
    assert audit.ledger_row_count == len(pressure)
    record_measurement(
        "maxmemory",
        server=durable_server.binary.name,
        stages=len(before) + len(pressure),
        acked_under_pressure=len(acked),
        refused_oom=len(stage_errors),
        ledger_refused_oom=len(ledger_errors),
        evicted=0,
        lost=0,
    )


async def test_oversized_records_are_refused_before_any_write_amid_concurrent_stages(
    redis_url: str, durable_server: DurableServer
) -> None:
    limit = 8192
    small = [make_record(f"big{i % 4}", f"s{i}", n_tokens=64) for i in range(60)]
    large = [make_record(f"big{i % 4}", f"L{i}", n_tokens=2000 + i) for i in range(20)]
    results: dict[str, tuple[bool, str | None]] = {}
    async with AsyncRedisStagingSink.from_url(redis_url, max_record_bytes=limit) as sink:

        async def stage(record: StagedCallRecord) -> None:
            with anyio.fail_after(STAGE_BOUND_S):
                result = await sink.stage(record)
            results[record.staging_key] = (result.ok, result.error)

        async with anyio.create_task_group() as group:
            for record in [r for pair in zip(small, large * 3, strict=True) for r in pair]:
                group.start_soon(stage, record)
        chunk = await sink.stage_generation_prefix(large[0], checkpoint_id="ck", chunk_sequence=0)
        medium = make_record("big0", "medium", n_tokens=300)
        assert (await sink.stage(medium)).ok
    assert all(results[r.staging_key][0] for r in small)
    for record in large:
        ok, error = results[record.staging_key]
        assert not ok and error is not None and f"max_record_bytes={limit}" in error
    assert not chunk.ok and chunk.error is not None and f"max_record_bytes={limit}" in chunk.error
    with redis.Redis.from_url(redis_url) as client:
        assert not any(client.exists(record_key(NS, r.staging_key)) for r in large)
        assert not client.exists(record_key(NS, "big0/L0/cut/ck/0"))
        entries = {e[1][b"key"].decode() for k in range(4) for e in client.xrange(calls_stream(NS, f"big{k}"))}
        audit = audit_keyspace([client])
    assert entries == {r.staging_key for r in small} | {medium.staging_key}
    audit.assert_consistent()
    async with AsyncRedisStagingSource.from_url(redis_url, max_record_bytes=1024) as source:
        with pytest.raises(CodecError, match="max_record_bytes=1024"):
            await source.fetch([medium.staging_key])
    record_measurement(
        "max_record_bytes",
        server=durable_server.binary.name,
        stages=len(results) + 1,
        refused=len(large) + 1,
        written_oversized=0,
    )
