"""The durable Redis sink and source against real servers (Valkey 8 and Redis 7.0)."""

from __future__ import annotations

import inspect
import threading
import time
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import pytest
import redis
import redis.asyncio as aioredis

from sink.contract.codec import encode_record
from sink.contract.packed import PackedSnapshot
from sink.contract.records import StagedCallRecord
from sink.errors import CodecError, StagingConnectionError
from sink.keys import calls_stream, fence_key, record_key
from sink.server import DurableServer
from sink.settings import SinkSettings, SourceSettings
from sink.store import scripts
from sink.store.commit import MAX_BATCH_VALUE_BYTES
from sink.store.memory import MemoryStagingStore
from sink.store.sink import CONFLICT_ERROR, AsyncRedisStagingSink, RedisStagingSink
from sink.store.source import AsyncRedisStagingSource, RedisStagingSource
from tests.helpers.processes import free_port, until
from tests.helpers.staging import make_chain, make_record

pytestmark = pytest.mark.anyio

NS = "stg"


def _client(url: str) -> redis.Redis:
    return redis.Redis.from_url(url)


def _calls_len(url: str, rollout_id: str) -> int:
    with _client(url) as client:
        return int(client.xlen(calls_stream(NS, rollout_id))) if client.exists(calls_stream(NS, rollout_id)) else 0


FETCHES = pytest.mark.parametrize("fetch", ["fetch", "fetch_packed"])


def _dump(snapshot: Any) -> dict[str, Any]:
    """A fetched snapshot's values (a packed one as the model it verifies as)."""
    model = snapshot.to_snapshot() if isinstance(snapshot, PackedSnapshot) else snapshot
    dumped: dict[str, Any] = model.model_dump()
    return dumped


@FETCHES
async def test_stage_then_fetch_returns_the_exact_record(redis_url: str, fetch: str) -> None:
    root, child = make_chain("r1", 2, n_tokens=32)
    async with AsyncRedisStagingSink.from_url(redis_url) as sink:
        results = [await sink.stage(root), await sink.stage(child)]
    assert [r.ok for r in results] == [True, True]
    assert [r.staging_key for r in results] == ["r1/c0", "r1/c1"]
    async with AsyncRedisStagingSource.from_url(redis_url) as source:
        fetched = await getattr(source, fetch)(["r1/c1", "r1/c0", "r1/c1"])
    assert [_dump(s) for s in fetched] == [child.model_dump(), root.model_dump(), child.model_dump()]
    with _client(redis_url) as client:
        entries = client.xrange(calls_stream(NS, "r1"))
    assert [e[1][b"key"] for e in entries] == [b"r1/c0", b"r1/c1"]
    assert entries[0][1][b"digest"].decode() == root.digest
    assert b"token_ids_delta" not in str(entries).encode()  # the calls stream is token-free


async def test_restaging_the_same_record_is_idempotent(redis_url: str) -> None:
    record = make_record("r2", "c1")
    async with AsyncRedisStagingSink.from_url(redis_url) as sink:
        first = await sink.stage(record)
        again = await sink.stage(record.model_copy(deep=True))
        stats = sink.statistics()
    assert first.ok and again.ok and again.staging_key == first.staging_key
    assert _calls_len(redis_url, "r2") == 1
    assert (stats.staged, stats.already_present) == (1, 1)


async def test_a_different_record_under_the_same_key_is_a_conflict_and_writes_nothing(redis_url: str) -> None:
    original = make_record("r3", "c1", weight_version=1)
    other = make_record("r3", "c1", weight_version=2)
    async with AsyncRedisStagingSink.from_url(redis_url) as sink:
        assert (await sink.stage(original)).ok
        conflict = await sink.stage(other)
    assert not conflict.ok and conflict.error == CONFLICT_ERROR
    assert conflict.staging_key == "r3/c1"
    assert _calls_len(redis_url, "r3") == 1
    async with AsyncRedisStagingSource.from_url(redis_url) as source:
        [stored] = await source.fetch(["r3/c1"])
    assert stored.weight_version == 1


async def test_a_non_durable_server_is_refused_naming_the_setting(everysec_server: DurableServer) -> None:
    record = make_record("r4", "c1")
    async with AsyncRedisStagingSink.from_url(everysec_server.url) as sink:
        result = await sink.stage(record)
    assert not result.ok and result.error is not None
    assert "appendfsync" in result.error and "'everysec'" in result.error
    with _client(everysec_server.url) as client:
        assert client.dbsize() == 0
    async with AsyncRedisStagingSink.from_url(everysec_server.url, durability="none") as sink:
        assert (await sink.stage(record)).ok


async def test_an_unverifiable_server_is_refused(redis_url: str) -> None:
    with _client(redis_url) as admin:
        admin.acl_setuser("noconfig", enabled=True, passwords=["+pw"], keys=["*"], commands=["+@all", "-config"])
    url = redis_url.replace("redis://", "redis://noconfig:pw@")
    async with AsyncRedisStagingSink.from_url(url) as sink:
        result = await sink.stage(make_record("r5", "c1"))
    assert not result.ok and result.error is not None and "cannot verify durability" in result.error


async def test_an_unreachable_server_is_a_failed_result_not_an_exception() -> None:
    url = f"redis://127.0.0.1:{free_port()}"
    async with AsyncRedisStagingSink.from_url(url, connect_timeout_s=0.5) as sink:
        result = await sink.stage(make_record("r6", "c1"))
    assert not result.ok and result.error is not None and "Connection" in result.error
    async with AsyncRedisStagingSink.from_url(url, durability="none", connect_timeout_s=0.5) as sink:
        result = await sink.stage(make_record("r6", "c1"))
    assert not result.ok and result.error is not None and "Connection" in result.error


async def test_missing_replicas_fail_within_the_confirm_timeout(redis_url: str) -> None:
    async with AsyncRedisStagingSink.from_url(redis_url, min_replicas=1, confirm_timeout_s=0.2) as sink:
        with anyio.fail_after(5):
            result = await sink.stage(make_record("r7", "c1"))
    assert not result.ok and result.error is not None
    assert "only 0 of 1 required replicas" in result.error


async def test_a_paused_replica_fails_stages_until_it_resumes(fresh_server: DurableServer, tmp_path: Path) -> None:
    with fresh_server.client() as admin:
        admin.config_set("repl-diskless-sync-delay", "0")  # the replica's first sync starts at once, not after 5 s
    with DurableServer(binary=fresh_server.binary, replica_of=("127.0.0.1", fresh_server.port)) as replica:
        with _client(replica.url) as client:
            await until(
                lambda: client.info("replication").get("master_link_status") == "up",
                lambda: f"the replica did not link to its primary: {replica.log_tail()}",
                timeout_s=20,
            )
        async with AsyncRedisStagingSink.from_url(fresh_server.url, min_replicas=1, confirm_timeout_s=0.5) as sink:
            # A healthy replica confirms (on a loaded machine its first sync may take a few 0.5 s windows).

            async def confirmed(call_id: str) -> bool:
                return (await sink.stage(make_record("r8", call_id))).ok

            await until(partial(confirmed, "c1"), "the healthy replica never confirmed a stage")
            replica.pause()
            try:
                with anyio.fail_after(5):
                    stalled = await sink.stage(make_record("r8", "c2"))
            finally:
                replica.resume()
            assert not stalled.ok and stalled.error is not None and "replicas" in stalled.error
            # The resumed replica catches up (a re-stage is idempotent: a few windows on a loaded machine).
            await until(partial(confirmed, "c2"), "the failed stage's retry was never confirmed")
            await until(partial(confirmed, "c3"), "a stage after the resume was never confirmed")
    assert _calls_len(fresh_server.url, "r8") == 3  # the failed stage's retry did not duplicate its entry


async def test_an_oversized_record_is_refused_before_any_write(redis_url: str) -> None:
    async with AsyncRedisStagingSink.from_url(redis_url, max_record_bytes=4096) as sink:
        result = await sink.stage(make_record("r9", "c1", n_tokens=2000))
    assert not result.ok and result.error is not None and "max_record_bytes=4096" in result.error
    with _client(redis_url) as client:
        assert client.dbsize() == 0


async def test_out_of_memory_fails_cleanly_and_evicts_nothing(redis_url: str) -> None:
    async with AsyncRedisStagingSink.from_url(redis_url) as sink:
        assert (await sink.stage(make_record("r10", "c1"))).ok
        with _client(redis_url) as client:
            used = int(client.info("memory")["used_memory"])
            client.config_set("maxmemory", str(used + 10_000))
        result = await sink.stage(make_record("r10", "c2", n_tokens=50_000))
    assert not result.ok and result.error is not None and "OutOfMemoryError" in result.error
    with _client(redis_url) as client:
        client.config_set("maxmemory", "0")
        assert client.exists(record_key(NS, "r10/c1")) == 1
        assert client.exists(record_key(NS, "r10/c2")) == 0
    assert _calls_len(redis_url, "r10") == 1


async def test_a_wrong_key_type_fails_without_writing(redis_url: str) -> None:
    with _client(redis_url) as client:
        client.set(calls_stream(NS, "r11"), "not a stream")
    async with AsyncRedisStagingSink.from_url(redis_url) as sink:
        result = await sink.stage(make_record("r11", "c1"))
    assert not result.ok and result.error is not None and "wrong type" in result.error
    with _client(redis_url) as client:
        assert client.exists(record_key(NS, "r11/c1")) == 0


async def test_stage_rejects_a_wrong_argument_type(redis_url: str) -> None:
    async with AsyncRedisStagingSink.from_url(redis_url) as sink:
        with pytest.raises(TypeError):
            await sink.stage(make_record().model_dump())  # type: ignore[arg-type]


async def test_stage_on_a_closed_sink_raises(redis_url: str) -> None:
    sink = AsyncRedisStagingSink.from_url(redis_url)
    with pytest.raises(RuntimeError, match="not open"):
        await sink.stage(make_record())


async def test_concurrent_stages_are_group_committed(redis_url: str) -> None:
    records = [make_record(f"g{i % 8}", f"c{i}", n_tokens=64) for i in range(200)]
    results: list[Any] = [None] * len(records)
    async with AsyncRedisStagingSink.from_url(redis_url, writer_connections=2) as sink:

        async def stage(i: int) -> None:
            results[i] = await sink.stage(records[i])

        async with anyio.create_task_group() as group:
            for i in range(len(records)):
                group.start_soon(stage, i)
        stats = sink.statistics()
    assert all(r.ok for r in results)
    assert stats.staged == 200
    assert stats.batches < 100, stats  # many records shared one script call and one fsync
    assert sum(_calls_len(redis_url, f"g{k}") for k in range(8)) == 200


async def test_a_cancelled_stage_leaves_all_or_nothing(redis_url: str) -> None:
    records = [make_record("r12", f"c{i}", n_tokens=256) for i in range(50)]
    async with AsyncRedisStagingSink.from_url(redis_url) as sink, anyio.create_task_group() as group:
        for record in records:
            group.start_soon(sink.stage, record)
        await anyio.lowlevel.checkpoint()
        group.cancel_scope.cancel()
    with _client(redis_url) as client:
        stored = {k.decode() for k in client.keys(record_key(NS, "r12/*"))}
        entries = {e[1][b"key"].decode() for e in client.xrange(calls_stream(NS, "r12"))}
    assert {record_key(NS, key) for key in entries} == stored


async def test_generation_prefix_chunks_and_clear(redis_url: str) -> None:
    record = make_record("r13", "c1")
    async with AsyncRedisStagingSink.from_url(redis_url) as sink:
        chunk = await sink.stage_generation_prefix(record, checkpoint_id="ckpt-1", chunk_sequence=0)
        staged = await sink.stage(record)
        assert chunk.staging_key == "r13/c1/cut/ckpt-1/0"
        with pytest.raises(ValueError):
            await sink.stage_generation_prefix(record, checkpoint_id="bad id", chunk_sequence=0)
        async with AsyncRedisStagingSource.from_url(redis_url) as source:
            [a, b] = await source.fetch([chunk.staging_key or "", staged.staging_key or ""])
            assert a.model_dump() == b.model_dump() == record.model_dump()
            assert await sink.clear([chunk.staging_key or "", staged.staging_key or "", "r13/absent"]) == 2
            with pytest.raises(KeyError):
                await source.fetch(["r13/c1"])
    assert _calls_len(redis_url, "r13") == 0


@FETCHES
async def test_fetch_names_every_missing_key(redis_url: str, fetch: str) -> None:
    async with AsyncRedisStagingSink.from_url(redis_url) as sink:
        assert (await sink.stage(make_record("r14", "c1"))).ok
    async with AsyncRedisStagingSource.from_url(redis_url) as source:
        with pytest.raises(KeyError) as caught:
            await getattr(source, fetch)(["r14/c1", "r14/x", "r14/y"])
    assert "r14/x" in str(caught.value) and "r14/y" in str(caught.value)


@FETCHES
async def test_fetch_rejects_corrupt_and_foreign_blobs(redis_url: str, fetch: str) -> None:
    async with AsyncRedisStagingSink.from_url(redis_url) as sink:
        assert (await sink.stage(make_record("r15", "c1"))).ok
    with _client(redis_url) as client:
        blob = client.get(record_key(NS, "r15/c1"))
        assert blob is not None
        client.set(record_key(NS, "r15/copy"), blob)
        client.set(record_key(NS, "r15/bad"), blob[:-3])
    async with AsyncRedisStagingSource.from_url(redis_url) as source:
        with pytest.raises(CodecError, match="belongs to"):
            await getattr(source, fetch)(["r15/copy"])
        with pytest.raises(CodecError, match="r15/bad"):
            await getattr(source, fetch)(["r15/bad"])


async def test_fetch_from_an_unreachable_server_raises_a_connection_error() -> None:
    async with AsyncRedisStagingSource.from_url(f"redis://127.0.0.1:{free_port()}", connect_timeout_s=0.5) as source:
        with pytest.raises(StagingConnectionError):
            await source.fetch(["r/c"])


async def test_acknowledged_records_survive_sigkill(fresh_server: DurableServer) -> None:
    acknowledged: list[StagedCallRecord] = []
    async with AsyncRedisStagingSink.from_url(fresh_server.url) as sink:

        async def stager(task: int) -> None:
            for i in range(10):
                record = make_record(f"crash{task % 16}", f"t{task}-{i}", n_tokens=128)
                if (await sink.stage(record)).ok:
                    acknowledged.append(record)

        async with anyio.create_task_group() as group:
            for task in range(64):
                group.start_soon(stager, task)
        fresh_server.kill()  # right after the last ok=True
    fresh_server.restart()
    assert len(acknowledged) == 640
    async with AsyncRedisStagingSource.from_url(fresh_server.url) as source:
        fetched = await source.fetch([r.staging_key for r in acknowledged])
    assert [f.digest for f in fetched] == [r.digest for r in acknowledged]
    assert sum(_calls_len(fresh_server.url, f"crash{k}") for k in range(16)) == 640


# --- the synchronous facades, and the contract shared with the in-memory store ---------------


def _check_sync_contract(sink: Any, source: Any) -> None:
    record = make_record("s1", "c1", weight_version=1)
    assert sink.stage(record).ok
    assert sink.stage(record).ok
    conflict = sink.stage(make_record("s1", "c1", weight_version=2))
    assert not conflict.ok and conflict.error == CONFLICT_ERROR
    [snapshot] = source.fetch(["s1/c1"])
    assert snapshot.model_dump() == record.model_dump()
    with pytest.raises(KeyError):
        source.fetch(["s1/c1", "s1/nope"])
    assert sink.clear(["s1/c1"]) == 1
    with pytest.raises(KeyError):
        source.fetch(["s1/c1"])


def test_sync_contract_on_the_memory_store() -> None:
    store = MemoryStagingStore()
    _check_sync_contract(store, store)


def test_sync_contract_on_redis(redis_url: str) -> None:
    with RedisStagingSink.from_url(redis_url) as sink, RedisStagingSource.from_url(redis_url) as source:
        _check_sync_contract(sink, source)
        record = make_record("s2", "c1")
        assert sink.stage(record).ok
        [packed] = source.fetch_packed(["s2/c1"])
        assert _dump(packed) == record.model_dump()


def test_sync_facade_is_thread_safe(redis_url: str) -> None:
    errors: list[BaseException] = []
    with RedisStagingSink.from_url(redis_url) as sink:

        def worker(thread: int) -> None:
            try:
                for i in range(20):
                    assert sink.stage(make_record(f"th{thread}", f"c{i}")).ok
            except (AssertionError, RuntimeError) as exc:  # collected and asserted below
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert sink.statistics().staged == 160
    assert errors == []
    with pytest.raises(RuntimeError, match="closed"):
        sink.stage(make_record())


async def test_a_record_changed_after_validation_is_validated_again(redis_url: str) -> None:
    record = make_record("r16", "c1")
    record.weight_version = 99  # reassigned after validation: the digest no longer matches
    async with AsyncRedisStagingSink.from_url(redis_url) as sink:
        result = await sink.stage(record)
        assert not result.ok and result.error is not None and "digest does not match" in result.error
        constructed = StagedCallRecord.model_construct(**make_record("r16", "c2").model_dump())
        assert (await sink.stage(constructed)).ok  # valid contents: accepted after validation
    with _client(redis_url) as client:
        assert client.exists(record_key(NS, "r16/c1")) == 0
    async with AsyncRedisStagingSource.from_url(redis_url) as source:
        [fetched] = await source.fetch(["r16/c2"])
    assert fetched.digest == constructed.digest


async def test_from_url_takes_settings_or_setting_fields(redis_url: str) -> None:
    sink_settings = SinkSettings(max_record_bytes=4096)
    async with AsyncRedisStagingSink.from_url(redis_url, sink_settings) as sink:
        assert sink.settings is sink_settings
        assert (await sink.stage(make_record("fu1", "c1"))).ok
    async with AsyncRedisStagingSource.from_url(redis_url, SourceSettings(max_record_bytes=4096)) as source:
        assert [s.staging_key for s in await source.fetch(["fu1/c1"])] == ["fu1/c1"]
    with pytest.raises(TypeError, match="either settings or setting fields"):
        AsyncRedisStagingSink.from_url(redis_url, sink_settings, durability="none")
    with pytest.raises(TypeError, match="either settings or setting fields"):
        RedisStagingSource.from_url(redis_url, SourceSettings(), max_record_bytes=4096)


def test_every_script_has_its_status_codes_filled_in() -> None:
    sources = [value.source for value in vars(scripts).values() if isinstance(value, scripts.ServerScript)]
    assert len(sources) == 19  # the GRPO group scripts: record, seal, due, take and close (gather and check removed)
    assert all("$" not in source for source in sources)
    # ... and every Lua script of the package lives in the store's scripts folder (re-exported by its package).
    home = Path(scripts.__file__).resolve().parent
    assert home.parts[-2:] == ("store", "scripts")
    elsewhere = [p for p in home.parents[1].rglob("*.py") if p.parent != home and "redis.call(" in p.read_text()]
    assert elsewhere == []
    assert f"status[i] = {scripts.StageStatus.WRONG_TYPE}" in scripts.STAGE_SCRIPT.source


async def test_stage_and_clear_reload_their_scripts_after_a_script_flush(redis_url: str) -> None:
    async with AsyncRedisStagingSink.from_url(redis_url) as sink:
        assert (await sink.stage(make_record("sf1", "c1"))).ok
        with _client(redis_url) as client:
            client.script_flush()
        assert (await sink.stage(make_record("sf1", "c2"))).ok  # pipelined EVALSHA: load, then send again
        with _client(redis_url) as client:
            client.script_flush()
        assert await sink.clear(["sf1/c1", "sf1/c2"]) == 2  # EVALSHA falls back to EVAL
    assert _calls_len(redis_url, "sf1") == 0


async def test_a_positive_generation_log_prob_is_staged_and_read_back_exactly(redis_url: str) -> None:
    """Accepted by design: contract §3.3 sets no upper bound on generation log-probs, so a NeMo Gym producer may
    stage one (engines round log-softmax in low precision and report values like ``+1e-7``); refusing here
    would refuse wire-valid records. The value travels unchanged (its float32 pattern is in the digest)."""
    base = make_record("r-pos", "c1", n_tokens=4, carry=1)
    log_probs = [0.0, 1e-7, 0.25, -0.5]
    fields = base.model_dump(include=set(inspect.signature(StagedCallRecord.from_components).parameters))
    record = StagedCallRecord.from_components(**{**fields, "generation_log_probs_delta": log_probs})
    async with AsyncRedisStagingSink.from_url(redis_url, namespace=NS) as sink:
        result = await sink.stage(record)
    assert result.ok and result.staging_key is not None, result.error
    async with AsyncRedisStagingSource.from_url(redis_url, namespace=NS) as source:
        (fetched,) = await source.fetch([result.staging_key])
    assert fetched.generation_log_probs_delta == record.generation_log_probs_delta
    assert fetched.generation_log_probs_delta[1] > 0 and fetched.digest == record.digest


# --- the staging script (real servers) ------------------------------------------------------------------


async def _incoming_keys(client: aioredis.Redis) -> list[bytes]:
    return [key async for key in client.scan_iter(match=f"{NS}:*:incoming:*")]


async def test_a_record_reaches_the_server_as_a_plain_value_never_through_the_script(redis_url: str) -> None:
    """The server's cost of a stage must not grow with the record beyond a SET's: the blob arrives in a plain
    ``SET`` (of an incoming key, in the stage's transaction), the script gets keys and small arguments only, and
    the record is moved into place whole, with no expiry, leaving no incoming key behind."""
    record = make_record("wire", "c0", n_tokens=32_768)
    blob = encode_record(record)
    async with aioredis.Redis.from_url(redis_url) as client:
        async with AsyncRedisStagingSink.from_url(redis_url) as sink, client.monitor() as monitor:
            assert (await sink.stage(record)).ok
            seen: list[str] = []
            with anyio.fail_after(10):  # up to the stage script's call (on the calls stream), its last but EXEC
                while not seen or not (seen[-1].upper().startswith(("FCALL", "EVALSHA")) and ":calls" in seen[-1]):
                    seen.append((await monitor.next_command())["command"])
        names = [command.split(" ", 1)[0].upper() for command in seen]
        assert len(seen[-1]) < 4_096, f"the script call carries {len(seen[-1])} bytes"
        assert any(name == "SET" and len(command) >= len(blob) for name, command in zip(names, seen, strict=True))
        assert names.index("MULTI") < names.index("SET")
        assert await client.get(record_key(NS, record.staging_key)) == blob
        assert await client.ttl(record_key(NS, record.staging_key)) == -1  # the incoming key's expiry is gone
        assert await _incoming_keys(client) == []


async def test_no_stage_outcome_leaves_an_incoming_key(redis_url: str) -> None:
    """Written, same, repaired, conflicting, retired and refused (wrong type) stages, and many records of one slot
    in one transaction (the same key twice among them): every incoming key is moved in or deleted."""
    original = make_record("left", "c0", weight_version=1)
    async with AsyncRedisStagingSink.from_url(redis_url) as sink, aioredis.Redis.from_url(redis_url) as client:
        outcomes = [await sink.stage(original), await sink.stage(original)]
        await client.set(record_key(NS, original.staging_key), encode_record(original)[:-4])  # corrupt: repaired
        outcomes += [await sink.stage(original), await sink.stage(make_record("left", "c0", weight_version=2))]
        await client.set(fence_key(NS, "fenced"), "1")
        await client.set(calls_stream(NS, "typed"), "not a stream")
        outcomes += [await sink.stage(make_record("fenced", "c0")), await sink.stage(make_record("typed", "c0"))]
        assert [r.ok for r in outcomes] == [True, True, True, False, False, False], [r.error for r in outcomes]
        many = [make_record("many", f"c{i % 5}", n_tokens=16) for i in range(10)]
        async with anyio.create_task_group() as group:
            for record in many:
                group.start_soon(sink.stage, record)
        assert sink.statistics().staged == 1 + 5
        assert await _incoming_keys(client) == []
        assert await client.get(record_key(NS, original.staging_key)) == encode_record(original)
        for key in (original.staging_key, *(r.staging_key for r in many)):
            assert await client.ttl(record_key(NS, key)) == -1


@pytest.mark.anyio
async def test_an_identical_restage_leaves_the_record_as_it_is(redis_url: str) -> None:
    """A re-stage's blob arrives as an incoming value and is deleted again; the record itself is not moved again
    (no ``RENAME``: a rewrite on every retry would cost a record's write each time)."""
    root, child = make_chain("quiet", 2)

    async def moves(client: aioredis.Redis) -> int:
        return int((await client.info("commandstats")).get("cmdstat_rename", {}).get("calls", 0))

    async with AsyncRedisStagingSink.from_url(redis_url) as sink, aioredis.Redis.from_url(redis_url) as client:
        start = await moves(client)  # the session server's count so far
        assert all([(await sink.stage(root)).ok, (await sink.stage(child)).ok])
        before = await moves(client)
        assert before == start + 2  # each new record was moved into place once
        with anyio.fail_after(10):
            assert (await sink.stage(child)).ok
        assert await moves(client) == before, "an identical re-stage wrote the record again"
        assert sink.statistics().already_present == 1


@pytest.mark.anyio
async def test_a_script_error_reply_is_reported_with_its_cause(redis_url: str) -> None:
    """A refused write names its cause. (The mutant ``explain_refusal(...) or describe_redis_error(reply)``
    -> ``and`` is killed by ``test_acl_no_user_code.py::test_roles_stage_only_after_setup...``.)"""
    async with AsyncRedisStagingSink.from_url(redis_url) as sink, aioredis.Redis.from_url(redis_url) as client:
        await client.config_set("maxmemory", 1)
        try:
            result = await sink.stage(make_record("full", "c0", n_tokens=512))
        finally:
            await client.config_set("maxmemory", 0)
    assert not result.ok and result.error is not None
    assert "OutOfMemoryError" in result.error or "OOM" in result.error, result.error


@pytest.mark.anyio
async def test_a_retry_while_the_replica_is_frozen_is_not_acknowledged(server_binary: Path, tmp_path: Path) -> None:
    """A re-stage of a present record is acknowledged only once a replica has what the stage promises.

    The retrying sink opens (and verifies the replica) before the freeze, so only the re-stage's own transaction
    (its incoming value written and deleted, after the record's write in the replication stream) makes its
    ``WAIT`` cover the record: a re-stage that wrote nothing would leave ``WAIT`` answering 1 at once.
    """
    fast = {"repl-diskless-sync-delay": "0"}
    with (
        DurableServer(binary=server_binary, data_dir=tmp_path / "p", extra_config=fast) as primary,
        DurableServer(
            binary=server_binary, data_dir=tmp_path / "r", replica_of=(primary.host, primary.port)
        ) as replica,
    ):
        with primary.client() as admin:
            deadline = time.monotonic() + 15
            admin.set("probe", "1")  # WAIT counts replicas up to this connection's last write
            while int(admin.execute_command("WAIT", 1, 200)) < 1:
                assert time.monotonic() < deadline, "the replica never acknowledged"
        record = make_record("frozen", "c1")
        settings = SinkSettings(min_replicas=1, confirm_timeout_s=1.0)
        async with (
            AsyncRedisStagingSink.from_url(primary.url, settings) as first,
            AsyncRedisStagingSink.from_url(primary.url, settings) as retrying,
        ):

            async def confirmed(sink: AsyncRedisStagingSink, rollout_id: str) -> bool:
                return (await sink.stage(make_record(rollout_id, "c0"))).ok

            # Both sinks' connections are open and confirmed (a few windows on a loaded machine) before the pause.
            await until(partial(confirmed, first, "frozen"), "the replica never confirmed the first sink's stage")
            await until(partial(confirmed, retrying, "other"), "the replica never confirmed the second sink's stage")
            replica.pause()
            try:
                assert not (await first.stage(record)).ok  # written, not confirmed
                retried = await retrying.stage(record)
            finally:
                replica.resume()
    assert not retried.ok and retried.error is not None and "replicas" in retried.error, retried


async def _batches_of(redis_url: str, records: list[StagedCallRecord]) -> int:
    """How many transactions one writer sends *records* in when all but the first are queued behind it: the server's
    writes are paused while the first is sent, the rest are queued, then the writes resume."""
    first, rest = records[0], records[1:]
    async with (
        aioredis.Redis.from_url(redis_url) as admin,
        AsyncRedisStagingSink.from_url(redis_url, namespace=NS, writer_connections=1) as sink,
    ):
        results: list[bool] = []

        async def stage(record: StagedCallRecord) -> None:
            results.append((await sink.stage(record)).ok)

        await admin.client_pause(60_000, all=False)  # writes only
        try:
            async with anyio.create_task_group() as group:
                group.start_soon(stage, first)
                await until(lambda: sink.statistics().batches == 1, "the writer did not take the first record")
                for record in rest:
                    group.start_soon(stage, record)
                await until(lambda: sink.statistics().queued == len(rest), "the other records were not queued")
                await admin.client_unpause()
        finally:
            await admin.client_unpause()
        assert results == [True] * len(records)
        return sink.statistics().batches - 1


async def test_large_records_are_sent_a_few_per_transaction(redis_url: str) -> None:
    # Each blob is over half of MAX_BATCH_VALUE_BYTES: two reach it, so a transaction carries at most two. One
    # transaction of six (what was queued) would cost the server more per record than a plain SET does.
    records = [make_record("big", f"c{i}", n_tokens=65_536) for i in range(7)]
    size = len(encode_record(records[0]))
    assert MAX_BATCH_VALUE_BYTES / 2 < size < MAX_BATCH_VALUE_BYTES
    assert await _batches_of(redis_url, records) == 3
    async with AsyncRedisStagingSource.from_url(redis_url, namespace=NS) as source:
        fetched = await source.fetch_packed([record.staging_key for record in records])
    assert [_dump(snapshot) for snapshot in fetched] == [record.model_dump() for record in records]


async def test_small_records_queued_together_share_one_transaction(redis_url: str) -> None:
    records = [make_record("small", f"c{i}", n_tokens=2048) for i in range(7)]
    assert await _batches_of(redis_url, records) == 1
