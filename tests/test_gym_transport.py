"""The NeMo Gym transport (``sink.gym``) against real servers: every semantic of Gym's TokenSink/TokenSource.

Each contract test runs twice per server: with one user for everything, and as a deployment runs it, the sink
as the ``gym_sink`` ACL user and the source as ``gym_source`` (a server loading the ACL ``staging-sink acl``
renders): the restricted roles do the whole job."""

from __future__ import annotations

import asyncio
import dataclasses
import math
import struct
import sys
import time
import types
import zlib
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import msgpack
import pytest
import redis

from sink.errors import (
    CaptureWriteError,
    CodecError,
    GymInputError,
    RolloutFrozenError,
    RolloutRetiredError,
    TokenEntryConflictError,
)
from sink.gym import LocalTokenCaptureSnapshot, LocalTokenEntry, RedisTokenSink, RedisTokenSource, entry_types
from sink.keys import gym_keys
from sink.ops.access.render import ADMIN_ROLE
from sink.server import DurableServer
from sink.store.pipeline_counters import pipeline_counters
from tests.helpers.acl import AclServer, start_acl_server
from tests.helpers.gym import make_entry
from tests.helpers.processes import until
from tests.helpers.servers import reset_durable_server

pytestmark = pytest.mark.anyio

NS = "gymt"


@dataclass(frozen=True, slots=True)
class Urls:
    """Where the sink and the source log in, and an admin URL the test reads and plants keys with."""

    sink: str
    source: str
    admin: str

    @classmethod
    def single(cls, url: str) -> Urls:
        return cls(url, url, url)


@pytest.fixture(scope="module")
def role_server(server_binary: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[AclServer]:
    with start_acl_server(server_binary, tmp_path_factory.mktemp("gym-roles"), namespace=NS) as server:
        yield server


@pytest.fixture(params=["one-user", "gym-roles"])
def urls(request: pytest.FixtureRequest, server_binary: Path) -> Urls:
    if request.param == "one-user":
        return Urls.single(request.getfixturevalue("redis_url"))
    server: AclServer = request.getfixturevalue("role_server")
    reset_durable_server(server)
    return Urls(server.role_url("gym_sink"), server.role_url("gym_source"), server.role_url(ADMIN_ROLE))


@asynccontextmanager
async def transport(urls: Urls, **settings: Any) -> AsyncIterator[tuple[RedisTokenSink, RedisTokenSource]]:
    sink = RedisTokenSink(redis_url=urls.sink, namespace=NS, **settings)
    source = RedisTokenSource(redis_url=urls.source, namespace=NS, **settings)
    try:
        yield sink, source
    finally:
        await sink.close()
        await source.close()


def _wait_until_expired(url: str, key: str) -> None:
    """Block until the server expired *key* (a condition, with a deadline)."""
    deadline = time.monotonic() + 10
    with redis.Redis.from_url(url) as client:
        assert client.pttl(key) in (-2, *range(51))  # expiring within 50 ms (0: in this millisecond), or expired
        while client.exists(key):
            assert time.monotonic() < deadline, f"{key} did not expire"
            time.sleep(0.005)


def _gym_count(operation: str, result: str) -> float:
    return sum(
        value
        for name, labels, value in pipeline_counters().counters()
        if name == "staging_sink_gym_operations"
        and labels == {"namespace": NS, "operation": operation, "result": result}
    )


def _key_count(url: str) -> int:
    with redis.Redis.from_url(url) as client:
        return len(list(client.scan_iter(match=f"{NS}:*")))


async def test_put_then_freeze_returns_the_entry_exactly(urls: Urls) -> None:
    entry = make_entry("task-1", "c1", n_tokens=300, extra_field={"b": [1, 2.5], "a": None})
    wide = make_entry("task-1", "c2", generation_log_probs=[0.1] * 16, routed_experts=[[1, 2], [3, 4]])
    big_ids = make_entry("task-1", "c3", prompt_token_ids=[2**40, 7])
    async with transport(urls) as (sink, source):
        for e in (entry, wide, big_ids):
            await sink.put(e)
        snapshot = await source.freeze("task-1")
    assert isinstance(snapshot, LocalTokenCaptureSnapshot)
    assert snapshot.rollout_id == "task-1"
    assert not snapshot.incomplete
    by_id = {e.model_call_id: e for e in snapshot.entries}
    assert set(by_id) == {"c1", "c2", "c3"}
    for e in (entry, wide, big_ids):
        got = by_id[e.model_call_id]
        assert isinstance(got, LocalTokenEntry)
        assert got.model_dump(mode="json") == e.model_dump(mode="json")
    assert by_id["c2"].generation_log_probs == [0.1] * 16  # not float32-exact: stored as float64


async def test_identical_put_is_a_no_op(urls: Urls) -> None:
    entry = make_entry("t-2", "c1")
    async with transport(urls) as (sink, source):
        await sink.put(entry)
        await sink.put(make_entry("t-2", "c1"))  # an equal payload, another object
        snapshot = await source.freeze("t-2")
    async with transport(urls) as (sink, source):
        await sink.put(make_entry("t-2b", "c1"))
        reference = await source.freeze("t-2b")
    assert len(snapshot.entries) == 1 and not snapshot.incomplete
    assert snapshot.version == reference.version  # the identical put changed nothing


@pytest.mark.parametrize(
    "change",
    [{"seed": 1}, {"created_at": 2.0}, {"extra": "x"}, {"model": "other"}],
    ids=["tokens", "created_at", "extra-field", "model"],
)
async def test_other_payload_under_a_known_call_id_raises_and_marks_incomplete(
    urls: Urls, change: dict[str, Any]
) -> None:
    first = make_entry("t-3", "c1")
    conflicts = _gym_count("put", "conflict")
    async with transport(urls) as (sink, source):
        await sink.put(first)
        with pytest.raises(TokenEntryConflictError) as raised:
            await sink.put(make_entry("t-3", "c1", **change))
        assert isinstance(raised.value, ValueError)
        assert _gym_count("put", "conflict") == conflicts + 1  # counted for the metrics exporter
        snapshot = await source.freeze("t-3")
    assert snapshot.incomplete
    assert [e.model_dump(mode="json") for e in snapshot.entries] == [first.model_dump(mode="json")]  # kept


async def test_freeze_is_idempotent_and_a_fence(urls: Urls) -> None:
    async with transport(urls) as (sink, source):
        await sink.put(make_entry("t-4", "c1"))
        first = await source.freeze("t-4")
        again = await source.freeze("t-4")
        assert (again.snapshot_id, again.version) == (first.snapshot_id, first.version)
        assert again == first
        with pytest.raises(RolloutFrozenError) as raised:
            await sink.put(make_entry("t-4", "c2"))
        assert isinstance(raised.value, RuntimeError)
        with pytest.raises(RolloutFrozenError):
            await sink.put(make_entry("t-4", "c1"))  # even an identical payload: the rollout is closed
        with pytest.raises(RolloutFrozenError):
            await sink.begin_call("t-4", "c3")
        third = await source.freeze("t-4")
    assert (third.snapshot_id, third.version, len(third.entries)) == (first.snapshot_id, first.version, 1)


async def test_snapshot_ids_are_unique_per_rollout(urls: Urls) -> None:
    async with transport(urls) as (_sink, source):
        snapshots = [await source.freeze(f"t-5-{i}") for i in range(5)]
    assert len({s.snapshot_id for s in snapshots}) == 5


async def test_unknown_rollout_freezes_empty(urls: Urls) -> None:
    async with transport(urls) as (_sink, source):
        snapshot = await source.freeze("never-seen")
        assert snapshot.entries == () and not snapshot.incomplete
        assert await source.drop("never-seen", snapshot_id=snapshot.snapshot_id, version=snapshot.version)


async def test_mark_incomplete_before_and_after_freeze(urls: Urls) -> None:
    async with transport(urls) as (sink, source):
        await sink.mark_incomplete("t-6")  # a rollout without entries
        assert (await source.freeze("t-6")).incomplete

        await sink.put(make_entry("t-7", "c1"))
        frozen = await source.freeze("t-7")
        assert not frozen.incomplete
        await sink.mark_incomplete("t-7", "c2")
        marked = await source.freeze("t-7")
        assert marked.incomplete and marked.snapshot_id == frozen.snapshot_id and marked.version != frozen.version
        # the stale identity no longer drops, and nothing was deleted
        assert not await source.drop("t-7", snapshot_id=frozen.snapshot_id, version=frozen.version)
        assert len((await source.freeze("t-7")).entries) == 1
        assert await source.drop("t-7", snapshot_id=marked.snapshot_id, version=marked.version)


async def test_begin_call_without_entry_makes_the_snapshot_incomplete(urls: Urls) -> None:
    async with transport(urls) as (sink, source):
        await sink.begin_call("t-8", "c1")
        await sink.put(make_entry("t-8", "c1"))
        await sink.begin_call("t-8", "c2")  # dispatched, its entry never arrives
        lost = await source.freeze("t-8")

        await sink.begin_call("t-9", "c1")
        await sink.put(make_entry("t-9", "c1"))
        complete = await source.freeze("t-9")
        await sink.put(make_entry("t-10", "c1"))
        without_intent = await source.freeze("t-10")
    assert lost.incomplete and len(lost.entries) == 1
    assert not complete.incomplete
    assert complete.version == without_intent.version  # begin_call does not change the version


async def test_drop_only_for_the_exact_frozen_snapshot(urls: Urls) -> None:
    async with transport(urls) as (sink, source):
        await sink.put(make_entry("t-11", "c1"))
        assert not await source.drop("t-11", snapshot_id="nope", version=1)  # not frozen
        snapshot = await source.freeze("t-11")
        assert not await source.drop("t-11", snapshot_id="other", version=snapshot.version)
        assert not await source.drop("t-11", snapshot_id=snapshot.snapshot_id, version=snapshot.version + 1)
        assert (await source.freeze("t-11")) == snapshot  # nothing was deleted
        assert await source.drop("t-11", snapshot_id=snapshot.snapshot_id, version=snapshot.version)
        assert await source.drop("t-11", snapshot_id=snapshot.snapshot_id, version=snapshot.version)  # repeated
        assert not await source.drop("t-11", snapshot_id=snapshot.snapshot_id, version=snapshot.version - 1)
    keys = gym_keys(NS, "t-11")
    with redis.Redis.from_url(urls.admin) as client:
        assert client.exists(*keys[:-1]) == 0
        assert 0 < client.pttl(keys.tombstone) <= 86_400_000


async def test_drop_of_a_never_frozen_rollout_is_refused_not_an_error(urls: Urls) -> None:
    """Gym's own store returns ``False`` for a never-frozen rollout's drop, whatever identity it is given (its
    contract test passes ``snapshot_id=""``, ``version=0``); nothing is deleted."""
    async with transport(urls) as (sink, source):
        await sink.put(make_entry("t-nf", "c1"))
        for snapshot_id, version in (("", 0), ("", 1), ("s", 0), ("s", -1), ("", 2**70)):
            assert await source.drop("t-nf", snapshot_id=snapshot_id, version=version) is False
            assert await source.drop("never-seen-2", snapshot_id=snapshot_id, version=version) is False
        snapshot = await source.freeze("t-nf")
        assert [e.model_call_id for e in snapshot.entries] == ["c1"]  # nothing was deleted
        assert await source.drop("t-nf", snapshot_id="", version=snapshot.version) is False  # frozen: still refused
        assert await source.drop("t-nf", snapshot_id=snapshot.snapshot_id, version=snapshot.version)
        assert await source.drop("t-nf", snapshot_id="", version=0) is False  # dropped: another identity


@pytest.mark.parametrize(
    "identity",
    [{"snapshot_id": None, "version": 0}, {"snapshot_id": b"s", "version": 0}, {"snapshot_id": "s", "version": "1"}]
    + [{"snapshot_id": "s", "version": v} for v in (None, 1.0, True)],
    ids=["id-None", "id-bytes", "version-str", "version-None", "version-float", "version-bool"],
)
async def test_a_drop_identity_of_the_wrong_type_is_a_typed_error(urls: Urls, identity: dict[str, Any]) -> None:
    async with transport(urls) as (sink, source):
        await sink.put(make_entry("t-dt", "c1"))
        snapshot = await source.freeze("t-dt")
        with pytest.raises(GymInputError) as raised:
            await source.drop("t-dt", **identity)
        assert isinstance(raised.value, ValueError)
        assert await source.freeze("t-dt") == snapshot  # nothing was deleted


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf], ids=["nan", "inf", "-inf"])
async def test_non_finite_log_probs_are_refused_and_nothing_is_written(urls: Urls, value: float) -> None:
    """As the RL path refuses a record with a non-finite log-prob (and the proxy an engine answer with one)."""
    entry = make_entry("t-nan", "c1", n_tokens=4, generation_log_probs=[-0.5, value, -0.25, -1.0])
    async with transport(urls) as (sink, _source):
        with pytest.raises(GymInputError, match="generation_log_probs.*finite"):
            await sink.put(entry)
    assert _key_count(urls.admin) == 0


async def test_tombstone_refuses_every_later_call(urls: Urls) -> None:
    async with transport(urls) as (sink, source):
        await sink.put(make_entry("t-12", "c1"))
        snapshot = await source.freeze("t-12")
        assert await source.drop("t-12", snapshot_id=snapshot.snapshot_id, version=snapshot.version)
        for call in (
            sink.put(make_entry("t-12", "c2")),
            sink.put(make_entry("t-12", "c1")),
            sink.mark_incomplete("t-12"),
            sink.begin_call("t-12", "c3"),
            source.freeze("t-12"),
        ):
            with pytest.raises(RolloutRetiredError):
                await call


async def test_tombstone_retention_ends_and_frees_the_id(urls: Urls) -> None:
    async with transport(urls, tombstone_retention_s=0.05) as (sink, source):
        snapshot = await source.freeze("t-13")
        assert await source.drop("t-13", snapshot_id=snapshot.snapshot_id, version=snapshot.version)
        await anyio.to_thread.run_sync(_wait_until_expired, urls.admin, gym_keys(NS, "t-13").tombstone)
        await sink.put(make_entry("t-13", "c1"))
        fresh = await source.freeze("t-13")
    assert len(fresh.entries) == 1 and fresh.snapshot_id != snapshot.snapshot_id


@pytest.mark.parametrize("rollout_id", ["", "-lead", ".lead", "a/b", "a{b}", "a b", "é", "x" * 513, 7, None])
async def test_invalid_rollout_ids_are_refused_and_nothing_is_written(urls: Urls, rollout_id: Any) -> None:
    async with transport(urls) as (sink, source):
        with pytest.raises(ValueError):
            await sink.put(
                LocalTokenEntry.model_construct(**{**make_entry("ok", "c1").__dict__, "rollout_id": rollout_id})
            )
        for call in (
            lambda: sink.mark_incomplete(rollout_id),
            lambda: sink.begin_call(rollout_id, "c1"),
            lambda: source.freeze(rollout_id),
            lambda: source.drop(rollout_id, snapshot_id="s", version=1),
        ):
            with pytest.raises(ValueError):
                await call()
    assert _key_count(urls.admin) == 0


async def test_invalid_entries_are_refused(urls: Urls) -> None:
    good = make_entry("t-14", "c1").__dict__
    async with transport(urls) as (sink, _source):
        bad: list[dict[str, Any]] = [
            {"model_call_id": ""},
            {"generation_log_probs": [0.5]},  # length differs from the ids
            {"generation_token_ids": [-1] * 16},
            {"token_item_index": 3},
            {"schema_version": 2},  # newer than this transport reads
        ]
        for change in bad:
            with pytest.raises(ValueError):
                await sink.put(LocalTokenEntry.model_construct(**{**good, **change}))
        with pytest.raises(TypeError):
            await sink.put({"rollout_id": "t-14"})
    async with transport(urls, max_record_bytes=4096) as (sink, _source):
        with pytest.raises(ValueError, match="max_record_bytes"):
            await sink.put(make_entry("t-14", "c1", n_tokens=1024))
    assert _key_count(urls.admin) == 0


async def test_a_newer_stored_record_fails_the_read(urls: Urls) -> None:
    async with transport(urls) as (sink, source):
        await sink.put(make_entry("t-15", "c1"))
        keys = gym_keys(NS, "t-15")
        with redis.Redis.from_url(urls.admin) as client:
            blob = client.hget(keys.entries, "c1")
            assert isinstance(blob, bytes)
            body = msgpack.unpackb(blob[6:], raw=False)
            body["f"]["schema_version"] = 2
            newer = msgpack.packb(body, use_bin_type=True)
            client.hset(keys.entries, "c2", struct.pack(">2sI", b"GE", zlib.crc32(newer)) + newer)
            client.hset(keys.digests, "c2", "d")
        with pytest.raises(CodecError, match="schema_version 2"):
            await source.freeze("t-15")
        with redis.Redis.from_url(urls.admin) as client:
            client.hset(keys.snapshot, "c2", blob[:-1])  # a corrupt blob fails loudly too (frozen: in the snapshot)
        with pytest.raises(CodecError):
            await source.freeze("t-15")


async def test_a_key_of_the_wrong_type_fails_and_writes_nothing(urls: Urls) -> None:
    with redis.Redis.from_url(urls.admin) as client:
        client.set(gym_keys(NS, "t-16").intents, "not a set")
    async with transport(urls) as (sink, _source):
        with pytest.raises(CaptureWriteError, match="wrong type"):
            await sink.put(make_entry("t-16", "c1"))
    assert _key_count(urls.admin) == 1


async def test_close_is_idempotent_and_final(urls: Urls) -> None:
    sink = RedisTokenSink(redis_url=urls.sink, namespace=NS)
    source = RedisTokenSource(redis_url=urls.source, namespace=NS)
    await sink.close()  # never used
    await source.freeze("t-17")
    await source.close()
    await source.close()
    with pytest.raises(RuntimeError, match="closed"):
        await source.freeze("t-17")
    with pytest.raises(RuntimeError, match="closed"):
        await sink.put(make_entry("t-17", "c1"))


def test_constructor_is_keyword_only_and_checks_settings(redis_url: str) -> None:
    with pytest.raises(TypeError):
        RedisTokenSink(redis_url)  # type: ignore[call-arg]
    with pytest.raises(ValueError):
        RedisTokenSink(redis_url=redis_url, namespace="bad ns")
    with pytest.raises(ValueError):
        RedisTokenSource(redis_url=redis_url, no_such_setting=1)
    assert RedisTokenSink(redis_url=redis_url, namespace="x", min_replicas=0).settings.namespace == "x"


async def test_a_server_that_does_not_fsync_fails_every_write(everysec_server: DurableServer) -> None:
    async with transport(Urls.single(everysec_server.url)) as (sink, source):
        with pytest.raises(CaptureWriteError, match="appendfsync"):
            await sink.put(make_entry("t-18", "c1"))
        with pytest.raises(CaptureWriteError):
            await sink.mark_incomplete("t-18")
        with pytest.raises(CaptureWriteError):
            await source.freeze("t-18")
    with everysec_server.client() as client:
        assert client.dbsize() == 0


async def test_missing_replicas_fail_the_put(urls: Urls) -> None:
    async with transport(urls, min_replicas=1, confirm_timeout_s=0.2) as (sink, _source):
        with pytest.raises(CaptureWriteError, match="replica"):
            await sink.put(make_entry("t-19", "c1"))


async def test_gyms_own_classes_are_returned_when_nemo_gym_is_importable(
    urls: Urls, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stand-in ``nemo_gym.token_id_capture`` module (a second implementation of the two record types):
    the source builds its classes, not the local ones."""

    class GymTokenEntry(LocalTokenEntry):
        pass

    @dataclasses.dataclass(frozen=True)
    class GymSnapshot:
        rollout_id: str
        entries: tuple[Any, ...]
        incomplete: bool
        snapshot_id: str
        version: int

    module = types.ModuleType("nemo_gym.token_id_capture")
    module.TokenEntry = GymTokenEntry  # type: ignore[attr-defined]
    module.TokenCaptureSnapshot = GymSnapshot  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "nemo_gym", types.ModuleType("nemo_gym"))
    monkeypatch.setitem(sys.modules, "nemo_gym.token_id_capture", module)
    entry_types.cache_clear()
    try:
        assert entry_types().from_gym
        async with transport(urls) as (sink, source):
            await sink.put(GymTokenEntry(**make_entry("t-20", "c1").model_dump()))
            snapshot = await source.freeze("t-20")
        assert type(snapshot) is GymSnapshot and type(snapshot.entries[0]) is GymTokenEntry
    finally:
        monkeypatch.undo()
        entry_types.cache_clear()
    assert not entry_types().from_gym


async def test_a_durability_setting_changed_under_an_open_sink_fails_the_next_put(urls: Urls) -> None:
    async with transport(urls) as (sink, _source):
        await sink.put(make_entry("t-21", "c1"))
        with redis.Redis.from_url(urls.admin) as client:
            client.config_set("appendfsync", "everysec")  # checked again in the round trip of every batch
        with pytest.raises(CaptureWriteError, match="appendfsync"):
            await sink.put(make_entry("t-21", "c2"))
        with pytest.raises(CaptureWriteError, match="appendfsync"):
            await sink.mark_incomplete("t-21")  # refused until a fresh check passes


async def test_cancelled_puts_leave_whole_entries_or_none(urls: Urls) -> None:
    async with transport(urls) as (sink, source):
        await sink.put(make_entry("t-22", "c-first"))
        acknowledged: set[str] = set()

        async def put(index: int) -> None:
            await sink.put(make_entry("t-22", f"c{index}", n_tokens=256))
            acknowledged.add(f"c{index}")

        with anyio.move_on_after(0.005):
            async with anyio.create_task_group() as group:
                for index in range(40):
                    group.start_soon(put, index)
        await sink.put(make_entry("t-22", "c-after"))  # the transport still works
        snapshot = await source.freeze("t-22")
    stored = {e.model_call_id: e for e in snapshot.entries}
    assert {"c-first", "c-after"} | acknowledged <= set(stored)
    for call_id, entry in stored.items():  # every stored entry is whole and exactly what was put
        if call_id.startswith("c") and call_id[1:].isdigit():
            expected = make_entry("t-22", call_id, n_tokens=256)
            assert entry.model_dump(mode="json") == expected.model_dump(mode="json")


def test_a_transport_belongs_to_the_loop_of_its_first_call(urls: Urls) -> None:
    sink = RedisTokenSink(redis_url=urls.sink, namespace=NS)  # built outside any loop, as Gym may

    async def use_twice() -> None:
        await sink.put(make_entry("t-23", "c1"))
        await sink.put(make_entry("t-23", "c2"))

    async def other_loop() -> None:
        with pytest.raises(RuntimeError, match="event loop"):
            await sink.put(make_entry("t-23", "c3"))

    async def close() -> None:
        await sink.close()

    runner = asyncio.Runner()
    with runner:
        runner.run(use_twice())
        asyncio.run(other_loop())
        runner.run(close())


async def test_min_replicas_puts_reach_the_replica_and_a_paused_one_fails_them(fresh_server: DurableServer) -> None:
    with fresh_server.client() as admin:
        admin.config_set("repl-diskless-sync-delay", "0")  # the replica's first sync starts at once, not after 5 s
    with DurableServer(binary=fresh_server.binary, replica_of=("127.0.0.1", fresh_server.port)) as replica:
        async with transport(Urls.single(fresh_server.url), min_replicas=1, confirm_timeout_s=0.5) as (sink, _source):

            # A loaded machine may take a few confirmation windows (the same put again is a no-op).
            async def confirmed(call_id: str) -> bool:
                try:
                    await sink.put(make_entry("t-24", call_id))
                except CaptureWriteError:
                    return False
                return True

            await until(partial(confirmed, "c1"), "the healthy replica never confirmed a put")
            await until(partial(confirmed, "c2"), "the healthy replica never confirmed the second put")
            with replica.client() as client:  # WAIT returned: the replica has it already
                assert client.hexists(gym_keys(NS, "t-24")[1], "c2")
            replica.pause()
            try:
                with pytest.raises(CaptureWriteError, match="replica"), anyio.fail_after(10):
                    await sink.put(make_entry("t-24", "c3"))
            finally:
                replica.resume()
