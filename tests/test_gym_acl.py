"""The NeMo Gym transport's ACL roles on a real server: gym_sink writes, gym_source freezes and drops, and
neither can do the other's job (nor any other role's); the read-only ops role sees the rollouts in
``inspect`` and ``stats``.

Role by role, each forbidden action is tried for real as that user: neither Gym role reaches a key of the RL
path (the RL retire fence above all: the Gym tombstone is a key of its own), the sink cannot change a frozen
rollout or read any entry, and the source cannot write what the sink owns."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, cast

import anyio
import pytest
import redis

from sink.errors import CaptureWriteError, RolloutRetiredError
from sink.gym import RedisTokenSink, RedisTokenSource
from sink.keys import (
    calls_stream,
    claim_key,
    dead_letter_stream,
    done_stream,
    fence_key,
    group_keys,
    gym_keys,
    ledger_ids_key,
    ledger_stream,
    ledger_text_key,
    receipt_key,
    receipts_stream,
    record_key,
    weight_version_key,
)
from sink.ledger.redis import RedisCaptureLedger
from sink.store.scripts import GYM_SCRIPT
from sink.store.sink import AsyncRedisStagingSink
from sink_cli.common import EXIT_OK
from sink_cli.main import main
from tests.helpers.acl import AclServer, is_acl_denial, start_acl_server
from tests.helpers.gym import make_entry
from tests.helpers.staging import make_record

NS = "stg"
GYM_ROLES = ("gym_sink", "gym_source")


@pytest.fixture(scope="module")
def gym_acl_server(server_binary: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[AclServer]:
    server = start_acl_server(server_binary, tmp_path_factory.mktemp("gym-acl"))
    with server:
        yield server


@pytest.fixture
def roles(gym_acl_server: AclServer) -> AclServer:
    with gym_acl_server.client() as admin:
        admin.flushall()
    return gym_acl_server


@asynccontextmanager
async def gym_roles(server: AclServer) -> AsyncIterator[tuple[RedisTokenSink, RedisTokenSource]]:
    """The transport as its deployment runs it: the sink as ``gym_sink``, the source as ``gym_source``."""
    sink = RedisTokenSink(redis_url=server.role_url("gym_sink"), namespace=NS)
    source = RedisTokenSource(redis_url=server.role_url("gym_source"), namespace=NS)
    try:
        yield sink, source
    finally:
        await sink.close()
        await source.close()


def _attempt(server: AclServer, role: str, *command: Any) -> bool:
    """Run *command* as *role*: ``True`` if the server ran it (even into an error of its own), ``False`` if the
    ACL refused it."""
    with server.role_client(role) as client:
        try:
            cast(Any, client).execute_command(*command)
        except redis.ResponseError as exc:
            return not is_acl_denial(exc)
    return True


def _assert_refused(server: AclServer, role: str, *command: Any) -> None:
    assert not _attempt(server, role, *command), f"{role} may run {command!r}"


def _rl_keys(rollout_id: str) -> list[str]:
    """Every kind of key of the RL path, for *rollout_id* where the key is per rollout."""
    return [
        record_key(NS, f"{rollout_id}/c0"),
        calls_stream(NS, rollout_id),
        ledger_stream(NS, rollout_id),
        ledger_ids_key(NS, rollout_id),
        ledger_text_key(NS, rollout_id),
        fence_key(NS, rollout_id),
        receipt_key(NS, rollout_id),
        claim_key(NS, rollout_id),
        done_stream(NS, 0),
        receipts_stream(NS, 0),
        dead_letter_stream(NS, "assembler"),
        weight_version_key(NS),
        *group_keys(NS, rollout_id),
    ]


async def _stage_rl(server: AclServer, rollout_id: str) -> bool:
    async with AsyncRedisStagingSink.from_url(server.role_url("worker"), namespace=NS) as sink:
        return (await sink.stage(make_record(rollout_id, "c0", n_tokens=11))).ok


@pytest.mark.parametrize("role", GYM_ROLES)
def test_a_gym_role_reaches_no_key_of_the_rl_path(roles: AclServer, role: str) -> None:
    """Not even to look: EXISTS and TYPE included, and not through the function library either (FCALL checks
    its keys against the user's patterns before the function runs)."""
    for key in _rl_keys("rl-1"):
        for command in (
            ("EXISTS", key),
            ("TYPE", key),
            ("GET", key),
            ("SET", key, "x", "EX", 1),
            ("DEL", key),
            ("PEXPIRE", key, 1),
            ("FCALL", GYM_SCRIPT.function_name, 1, key, 0, "0"),
        ):
            _assert_refused(roles, role, *command)


@pytest.mark.anyio
async def test_the_gym_roles_cannot_lift_or_set_an_rl_fence(roles: AclServer) -> None:
    """The issue's attack: ``SET stg:{rl-1}:fence x EX 1`` lifted a retired RL rollout's fence after a second,
    and a SET on a live RL rollout's fence made its stages refused."""
    async with RedisCaptureLedger.from_url(roles.role_url("gate"), namespace=NS) as gate:
        await gate.retire(["rl-retired"])  # fenced (it has no ledger rows: retire fences it all the same)
    assert await _stage_rl(roles, "rl-live")
    with roles.client() as admin:
        admin.pexpire(fence_key(NS, "rl-retired"), 86_400_000)
        fence_before = admin.get(fence_key(NS, "rl-retired"))
    for role in GYM_ROLES:
        for rollout_id in ("rl-retired", "rl-live"):
            _assert_refused(roles, role, "SET", fence_key(NS, rollout_id), "x", "EX", 1)
            _assert_refused(roles, role, "DEL", fence_key(NS, rollout_id))
    with roles.client() as admin:
        assert admin.get(fence_key(NS, "rl-retired")) == fence_before
        assert admin.pttl(fence_key(NS, "rl-retired")) > 80_000_000
        assert not admin.exists(fence_key(NS, "rl-live"))
    assert await _stage_rl(roles, "rl-live")  # the live RL rollout still stages


@pytest.mark.anyio
async def test_the_gym_tombstone_and_the_rl_fence_are_distinct(roles: AclServer) -> None:
    """Dropping a Gym rollout does not fence the RL rollout of the same id, and retiring an RL rollout does not
    tombstone the Gym rollout of the same id: two transports, two key families."""
    async with gym_roles(roles) as (sink, source):
        await sink.put(make_entry("shared", "c1"))
        snapshot = await source.freeze("shared")
        assert await source.drop("shared", snapshot_id=snapshot.snapshot_id, version=snapshot.version)
        with roles.client() as admin:
            assert not admin.exists(fence_key(NS, "shared"))
        assert await _stage_rl(roles, "shared")
        with pytest.raises(RolloutRetiredError):
            await sink.put(make_entry("shared", "c2"))  # the Gym tombstone still holds

        async with RedisCaptureLedger.from_url(roles.role_url("gate"), namespace=NS) as gate:
            await gate.retire(["rl-retired"])
        await sink.put(make_entry("rl-retired", "c1"))
        snapshot = await source.freeze("rl-retired")
        assert [e.model_call_id for e in snapshot.entries] == ["c1"]
        assert await source.drop("rl-retired", snapshot_id=snapshot.snapshot_id, version=snapshot.version)
    with roles.client() as admin:
        assert admin.exists(fence_key(NS, "rl-retired"))  # the RL fence is the gate's, untouched by the drop


def _gym_write_attempts(keys: tuple[str, ...], blob: bytes) -> list[tuple[Any, ...]]:
    """Every raw write a role could try on a rollout's Gym keys: fields of every hash, members of every set,
    strings, TTLs, renames and copies between the keys."""
    attempts: list[tuple[Any, ...]] = []
    for key in keys:
        for field in ("c1", "c-dup", "version", "frozen", "incomplete", "snapshot_id", "seen"):
            attempts += [("HSET", key, field, blob), ("HSETNX", key, field, blob), ("HDEL", key, field)]
        attempts += [
            ("HSET", key, "frozen", "0"),
            ("HSET", key, "incomplete", "0"),
            ("HINCRBY", key, "version", -1),
            ("HINCRBY", key, "version", 1),
            ("SADD", key, "c9"),
            ("SREM", key, "c1"),
            ("SET", key, "x"),
            ("PEXPIRE", key, 1),
            ("PERSIST", key),
            ("UNLINK", key),
            ("DEL", key),
        ]
        attempts += [("RENAME", key, other) for other in keys if other != key]
        attempts += [("COPY", key, other, "REPLACE") for other in keys if other != key]
    return attempts


@pytest.mark.anyio
async def test_the_sink_cannot_change_a_frozen_rollout(roles: AclServer) -> None:
    """The issue's attack: gym_sink HSET an entry straight into a frozen rollout, and the next freeze returned
    it under the same snapshot_id and version. Every raw write gym_sink might try on every key of a frozen
    rollout: whatever the server lets it run, a snapshot identity never covers other content (and an identity
    that changed no longer drops)."""
    keys = gym_keys(NS, "frozen-1")
    async with gym_roles(roles) as (sink, source):
        await sink.begin_call("frozen-1", "c1")
        await sink.put(make_entry("frozen-1", "c1"))
        with roles.client() as admin:
            blob = admin.hget(keys.entries, "c1")
        assert isinstance(blob, bytes)
        before = await source.freeze("frozen-1")
        assert [e.model_call_id for e in before.entries] == ["c1"] and not before.incomplete
        for attempt in _gym_write_attempts(tuple(keys), blob):
            _attempt(roles, "gym_sink", *attempt)
            after = await source.freeze("frozen-1")
            if (after.snapshot_id, after.version) == (before.snapshot_id, before.version):
                assert after == before, f"gym_sink changed the frozen snapshot with {attempt[:3]!r}"
            else:
                assert not await source.drop("frozen-1", snapshot_id=before.snapshot_id, version=before.version)
                before = after
        assert [e.model_call_id for e in before.entries] == ["c1"]
        assert await source.drop("frozen-1", snapshot_id=before.snapshot_id, version=before.version)
        with pytest.raises(RolloutRetiredError):
            await sink.put(make_entry("frozen-1", "c2"))


@pytest.mark.anyio
async def test_the_sink_reads_no_entry(roles: AclServer) -> None:
    """Writing entries is the sink's job, reading them back is not: not an open rollout's, not a frozen one's."""
    async with gym_roles(roles) as (sink, source):
        await sink.put(make_entry("open-1", "c1"))
        await sink.put(make_entry("frozen-2", "c1"))
        await source.freeze("frozen-2")
    for key in (gym_keys(NS, "open-1").entries, gym_keys(NS, "frozen-2").snapshot, gym_keys(NS, "frozen-2").entries):
        commands: list[tuple[Any, ...]] = [

            ("HGET", key, "c1"),
            ("HMGET", key, "c1"),
            ("HVALS", key),
            ("HGETALL", key),
            ("HSCAN", key, 0),
            ("HRANDFIELD", key, 1, "WITHVALUES"),
            ("DUMP", key),
        ]
        for command in commands:
            _assert_refused(roles, "gym_sink", *command)


@pytest.mark.anyio
async def test_the_source_cannot_write_what_the_sink_owns_or_lift_a_tombstone(roles: AclServer) -> None:
    """The source freezes and drops through the script; it cannot forge an entry, an intent, a digest or the
    open state of a rollout, rewrite a frozen snapshot's entries, or lift a tombstone before its retention."""
    async with gym_roles(roles) as (sink, source):
        await sink.begin_call("open-2", "c1")
        await sink.put(make_entry("open-2", "c1"))
        await sink.put(make_entry("frozen-3", "c1"))
        await source.freeze("frozen-3")
        dropped = await source.freeze("dropped-1")
        assert await source.drop("dropped-1", snapshot_id=dropped.snapshot_id, version=dropped.version)
    open_keys, frozen = gym_keys(NS, "open-2"), gym_keys(NS, "frozen-3")
    tombstone = gym_keys(NS, "dropped-1").tombstone
    commands: list[tuple[Any, ...]] = [
        ("HSET", open_keys.entries, "c2", "forged"),
        ("HSETNX", open_keys.entries, "c2", "forged"),
        ("SADD", open_keys.intents, "c2"),
        ("HSET", open_keys.digests, "c2", "d"),
        ("HSET", open_keys.state, "incomplete", "0"),
        ("HINCRBY", open_keys.state, "version", 1),
        ("HSET", frozen.snapshot, "c2", "forged"),
        ("HSETNX", frozen.snapshot, "c2", "forged"),
        ("HDEL", frozen.snapshot, "c1"),
        ("HSET", frozen.entries, "c2", "forged"),
        ("RENAME", frozen.snapshot, frozen.entries),  # a snapshot back to where the sink writes
        ("DEL", tombstone),
        ("UNLINK", tombstone),
        ("PEXPIRE", tombstone, 1),
        ("PERSIST", tombstone),
    ]
    for command in commands:
        _assert_refused(roles, "gym_source", *command)


@pytest.mark.anyio
async def test_each_gym_role_does_its_own_job_only(roles: AclServer) -> None:
    gym_acl_server = roles
    sink = RedisTokenSink(redis_url=gym_acl_server.role_url("gym_sink"), namespace="stg")
    source = RedisTokenSource(redis_url=gym_acl_server.role_url("gym_source"), namespace="stg")
    sink_as_source = RedisTokenSource(redis_url=gym_acl_server.role_url("gym_sink"), namespace="stg")
    worker = RedisTokenSink(redis_url=gym_acl_server.role_url("worker"), namespace="stg")
    try:
        await sink.begin_call("acl-1", "c1")
        await sink.put(make_entry("acl-1", "c1"))
        await sink.mark_incomplete("acl-1", "c2")
        with pytest.raises(CaptureWriteError):
            await sink_as_source.freeze("acl-1")  # the sink role may not read entries back
        with pytest.raises(CaptureWriteError):
            await worker.put(make_entry("acl-1", "c3"))  # the staging worker has no gym keys
        snapshot = await source.freeze("acl-1")
        assert snapshot.incomplete and [e.model_call_id for e in snapshot.entries] == ["c1"]
        assert await source.drop("acl-1", snapshot_id=snapshot.snapshot_id, version=snapshot.version)
    finally:
        for transport in (sink, source, sink_as_source, worker):
            await transport.close()


async def _seed_ops_rollouts(gym_acl_server: AclServer) -> tuple[Any, Any]:
    """An open rollout (one intent without its entry), a frozen one and a dropped one; their snapshots."""
    sink = RedisTokenSink(redis_url=gym_acl_server.role_url("gym_sink"), namespace="stg")
    source = RedisTokenSource(redis_url=gym_acl_server.role_url("gym_source"), namespace="stg")
    try:
        for call_id in ("c1", "c2"):
            await sink.begin_call("ops-open", call_id)
        await sink.put(make_entry("ops-open", "c1"))  # c2 announced, never put
        await sink.put(make_entry("ops-frozen", "c1"))
        frozen = await source.freeze("ops-frozen")
        await sink.put(make_entry("ops-dropped", "c1"))
        dropped = await source.freeze("ops-dropped")
        assert await source.drop("ops-dropped", snapshot_id=dropped.snapshot_id, version=dropped.version)
    finally:
        await sink.close()
        await source.close()
    return frozen, dropped


def test_inspect_and_stats_show_gym_rollouts_to_the_ops_role(
    roles: AclServer, capsys: pytest.CaptureFixture[str]
) -> None:
    ops_url = roles.role_url("ops")
    frozen, dropped = anyio.run(_seed_ops_rollouts, roles)
    assert main(["inspect", "ops-open", "--redis-url", ops_url, "--json"]) == EXIT_OK
    gym = json.loads(capsys.readouterr().out)["gym"]
    assert gym["frozen"] is False and gym["incomplete"] is False and gym["entries"] == 1
    assert list(gym["digests"]) == ["c1"] and gym["intents_without_entry"] == ["c2"]
    assert main(["inspect", "ops-frozen", "--redis-url", ops_url, "--json"]) == EXIT_OK
    gym = json.loads(capsys.readouterr().out)["gym"]
    assert gym["frozen"] is True and gym["snapshot_id"] == frozen.snapshot_id and gym["version"] == frozen.version
    assert main(["inspect", "ops-dropped", "--redis-url", ops_url]) == EXIT_OK
    assert f"dropped (snapshot {dropped.snapshot_id}:{dropped.version})" in capsys.readouterr().out
    assert main(["stats", "--redis-url", ops_url, "--json"]) == EXIT_OK
    totals = json.loads(capsys.readouterr().out)["gym_rollouts"]
    assert totals == {"rollouts": 2, "frozen": 1, "incomplete": 0, "entries": 2}
    assert main(["stats", "--redis-url", ops_url]) == EXIT_OK
    assert "2 held (1 frozen, 0 incomplete), 2 entries" in capsys.readouterr().out
