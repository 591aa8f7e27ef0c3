"""Self-healing services: missing consumer groups are recreated, unrecoverable failures end
the service, and the cluster mode is read from the server (a contradicting flag is one line, exit 2)."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from typing import Any

import anyio
import pytest
import redis.asyncio as aioredis
from redis.exceptions import NoPermissionError

from sink.errors import ClusterModeMismatchError, UnrecoverableServiceError
from sink.keys import done_stream, receipt_key, receipts_stream
from sink.rollout.assembler import Assembler, finished
from sink.store.cluster_mode import resolve_cluster_mode
from sink.store.sink import AsyncRedisStagingSink
from sink.trainer.reader.rollout_reader import RolloutReader
from sink_cli.common import EXIT_OK, EXIT_USAGE
from sink_cli.main import main
from sink_tools.cluster import LocalCluster
from tests.helpers.e2e import pull_until, running_assembler, stage_rollouts
from tests.helpers.processes import until

SHARDS = 2
FAST: dict[str, Any] = {"block_ms": 50, "done_shards": SHARDS, "receipt_shards": SHARDS, "reconnect_backoff_s": 0.05}
HEALED = "was missing on"


async def _wait_for_receipt(client: aioredis.Redis, rollout_id: str, *, timeout_s: float = 20.0) -> None:
    async def stored() -> bool:
        return bool(await client.exists(receipt_key("stg", rollout_id)))

    await until(stored, f"no receipt for {rollout_id} after {timeout_s} s", timeout_s=timeout_s)


async def _drop_groups(client: aioredis.Redis, streams: list[str]) -> None:
    """What a flush or an older AOF does to a group: the stream (and its groups) are gone."""
    await client.delete(*streams)


def _healed_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [record.getMessage() for record in caplog.records if HEALED in record.getMessage()]


@pytest.mark.anyio
async def test_assembler_recreates_its_group_after_a_flush_once_and_keeps_working(
    redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    done = [done_stream("stg", k) for k in range(SHARDS)]
    await stage_rollouts(redis_url, ["r-before"], calls=2)
    async with aioredis.Redis.from_url(redis_url) as client, running_assembler(redis_url, **FAST) as assembler:
        await finished(client, "r-before", reward=1.0, shards=SHARDS)
        await _wait_for_receipt(client, "r-before")
        await client.flushall()  # the session server is ours: every stream and group is gone
        consumer = assembler._consumer  # the shard loops meet NOGROUP on the empty server and recreate the groups
        await until(lambda: consumer.groups_recreated >= SHARDS, lambda: f"recreated {consumer.groups_recreated}")
        await stage_rollouts(redis_url, ["r-after"], calls=2)
        await finished(client, "r-after", reward=1.0, shards=SHARDS)
        await _wait_for_receipt(client, "r-after")
        recreated = assembler._consumer.groups_recreated
    lines = _healed_lines(caplog)
    assert recreated == SHARDS
    assert len(lines) == 1, lines  # said once, naming every stream it recreated
    assert all(stream in lines[0] for stream in done)
    assert not [r for r in caplog.records if "NOGROUP" in r.getMessage()]  # no retry line at all


@pytest.mark.anyio
async def test_reader_recreates_its_missing_group_and_pulls(redis_url: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    await stage_rollouts(redis_url, ["r1"], calls=2)
    async with (
        aioredis.Redis.from_url(redis_url) as client,
        RolloutReader.from_url(redis_url, receipt_shards=SHARDS, consumer_name="rank-0") as reader,
    ):
        # The trainers' group vanishes before anything is published (a restore from an older AOF).
        await _drop_groups(client, [receipts_stream("stg", k) for k in range(SHARDS)])
        async with running_assembler(redis_url, **FAST):
            await finished(client, "r1", reward=1.0, shards=SHARDS)
            pulled = await pull_until(reader, 1)
        assert [rollout.rollout_id for rollout in pulled] == ["r1"]
        assert pulled[0].row is not None
        await reader.ack(["r1"])
    assert len(_healed_lines(caplog)) == 1


@pytest.mark.anyio
async def test_assembler_stops_on_what_it_cannot_recover(redis_url: str) -> None:
    async with aioredis.Redis.from_url(redis_url) as client, Assembler.from_url(redis_url, **FAST) as assembler:
        await client.delete(done_stream("stg", 0))
        await client.set(done_stream("stg", 0), "not a stream")  # WRONGTYPE: waiting cannot fix it
        with anyio.fail_after(10), pytest.raises(ExceptionGroup) as caught:
            await assembler.run()
    fatal = caught.value.subgroup(UnrecoverableServiceError)
    assert fatal is not None and caught.value.split(UnrecoverableServiceError)[1] is None  # nothing else failed
    assert caught.group_contains(UnrecoverableServiceError, match="WRONGTYPE", depth=None)


def test_assembler_command_exits_non_zero_with_one_line(redis_url: str) -> None:
    async def poison() -> None:
        async with aioredis.Redis.from_url(redis_url) as client:
            await client.set(done_stream("stg", 0), "not a stream")

    anyio.run(poison)
    result = subprocess.run(
        [sys.executable, "-m", "sink_cli", "assembler", "--redis-url", redis_url, "--shards", "1"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("staging-sink: error:")]
    assert len(errors) == 1 and "WRONGTYPE" in errors[0], result.stderr


def test_resolve_cluster_mode_rules() -> None:
    assert resolve_cluster_mode(None, True, "s") is True
    assert resolve_cluster_mode(None, False, "s") is False
    assert resolve_cluster_mode(False, False, "s") is False
    with pytest.raises(ClusterModeMismatchError, match="standalone server"):
        resolve_cluster_mode(True, False, "s")
    with pytest.raises(ClusterModeMismatchError, match="Redis Cluster node"):
        resolve_cluster_mode(False, True, "s")


def test_cluster_flag_against_a_standalone_server_is_one_line(
    redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    for command in (["stats"], ["inspect", "r1"], ["verify", "r1"], ["retire", "r1", "--force"]):
        assert main([*command, "--redis-url", redis_url, "--cluster"]) == EXIT_USAGE
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "standalone server" in err and "drop --cluster" in err, err
    assert main(["stats", "--redis-url", redis_url]) == EXIT_OK  # detected: standalone


@pytest.mark.anyio
async def test_library_cluster_flag_against_a_standalone_server_is_refused(redis_url: str) -> None:
    with pytest.raises(ClusterModeMismatchError, match="standalone"):
        async with Assembler.from_url(redis_url, cluster=True):
            pass
    with pytest.raises(ClusterModeMismatchError, match="standalone"):
        async with AsyncRedisStagingSink.from_url(redis_url, cluster=True):
            pass


def test_cluster_is_detected_and_a_contradiction_refused(
    cluster: LocalCluster, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["stats", "--redis-url", cluster.url, "--namespace", "heal-det", "--json"]) == EXIT_OK
    snapshot = json.loads(capsys.readouterr().out)
    assert snapshot["server"]["primaries"] == 3  # detected: cluster mode, every primary (without --cluster)
    assert main(["stats", "--redis-url", cluster.url, "--no-cluster"]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Redis Cluster node" in err, err

    async def library_refuses() -> None:
        with pytest.raises(ClusterModeMismatchError, match="Redis Cluster node"):
            async with RolloutReader.from_url(cluster.url, cluster=False, namespace="heal-det"):
                pass

    anyio.run(library_refuses)


@pytest.mark.anyio
async def test_a_user_denied_info_and_cluster_info_still_opens_a_reader(redis_url: str) -> None:
    async with aioredis.Redis.from_url(redis_url) as admin:
        await admin.acl_setuser(
            "heal-probe", enabled=True, passwords=["+pw"], keys=["*"], commands=["+@all", "-info", "-cluster"]
        )
        try:
            url = redis_url.replace("redis://", "redis://heal-probe:pw@", 1)
            async with RolloutReader.from_url(url, receipt_shards=SHARDS) as reader:
                assert await reader.pending() == 0
            with pytest.raises(NoPermissionError):
                async with aioredis.Redis.from_url(url) as limited:
                    await limited.info("cluster")  # the probe really was denied
        finally:
            await admin.acl_deluser("heal-probe")
