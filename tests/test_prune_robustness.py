"""One bad entry never stops a prune pass, and ``prune --interval-s`` is a service like the others.

A rollout whose state cannot be read (a Gym ``touched_ms`` that is not a millisecond count) and a key name that
is not UTF-8 are left exactly as they are and listed in the report; the pass goes on with every other rollout.
As a service, ``staging-sink prune --interval-s`` rides out a server it cannot reach while it opens and between
passes (up to ``--max-outage-s``, then exit 3) and stops at once (exit 1) on a refusal. Real Valkey 8 / Redis 7.0
servers; each outage is a killed server, and every wait is on a printed line.
"""

from __future__ import annotations

import logging
import signal

import anyio
import pytest
import redis
import redis.asyncio as aioredis

from sink.keys import calls_stream, gym_keys
from sink.ops.prune import prune_namespace
from sink.server import DurableServer
from sink.settings import PruneSettings
from sink.store.connection import Topology
from tests.helpers.commands import staging_sink
from tests.helpers.e2e import stage_rollouts
from tests.helpers.prune import key_state, next_millisecond

_BAD_KEY = b"stg:{\xff}:calls"


async def _prune_both_ways(url: str) -> tuple[dict[str, object], dict[str, object]]:
    """A dry run, then a pass, an hour after everything written so far: their JSON reports."""
    settings = PruneSettings(abandon_after_s=600)
    async with aioredis.Redis.from_url(url) as client:
        topology = Topology.borrow(client, settings)
        now_s = await next_millisecond() + 3600
        dry = await prune_namespace(topology, settings, dry_run=True, now_s=now_s)
        applied = await prune_namespace(topology, settings, now_s=now_s)
    return dry.as_dict(), applied.as_dict()


@pytest.mark.anyio
async def test_a_rollout_with_a_malformed_gym_state_is_left_alone_and_the_pass_goes_on(
    redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="sink.ops.prune")
    await stage_rollouts(redis_url, ["a-stale", "z-stale"], calls=1)
    state = gym_keys("stg", "m-bad").state
    async with aioredis.Redis.from_url(redis_url) as client:
        await client.hset(state, mapping={"state": "open", "touched_ms": "yesterday"})
        before = await key_state(client, "stg:gym:{m-bad}*")
        dry, applied = await _prune_both_ways(redis_url)
        after = await key_state(client, "stg:gym:{m-bad}*")
    reason = "its Gym state's touched_ms is not a millisecond count: 'yesterday'"
    for report in (dry, applied):
        assert report["abandoned"] == ["a-stale", "z-stale"], report  # the rollouts on both sides of it
        assert report["skipped"] == {"m-bad": reason}, report
        assert report["rollouts_seen"] == 3
    assert after == before == {state: ("hash", -1, 2)}
    logged = [record.getMessage() for record in caplog.records if record.name == "sink.ops.prune"]
    assert logged == [f"prune: m-bad left alone: {reason}"] * 2  # the dry run's and the pass's


@pytest.mark.anyio
async def test_a_key_name_that_is_not_utf8_is_left_alone_and_the_pass_goes_on(redis_url: str) -> None:
    await stage_rollouts(redis_url, ["stale"], calls=1)
    async with aioredis.Redis.from_url(redis_url) as client:
        await client.xadd(_BAD_KEY, {"n": "1"})
        dry, applied = await _prune_both_ways(redis_url)
        assert await client.xlen(_BAD_KEY) == 1
        assert await client.exists(calls_stream("stg", "stale")) == 0
    for report in (dry, applied):
        assert report["abandoned"] == ["stale"], report
        assert list(report["skipped"]) == [repr(_BAD_KEY)], report  # type: ignore[call-overload]
        assert "key name is not UTF-8" in report["skipped"][repr(_BAD_KEY)], report  # type: ignore[index]


def _prune(url: str, *args: str) -> tuple[str, ...]:
    return ("prune", "--redis-url", url, "--json", "--interval-s", "0.2", "--abandon-after-s", "0.001", *args)


_READY = r"^prune on .* every 0\.2 s; Ctrl-C stops it"
_PASS = r'"dry_run": false'


def test_the_prune_service_rides_out_an_outage_between_passes(fresh_server: DurableServer) -> None:
    url = fresh_server.url
    with staging_sink(*_prune(url, "--max-outage-s", "600")) as cmd:
        cmd.wait_for(_READY)
        cmd.wait_for(_PASS, "stdout")
        fresh_server.kill()
        cmd.wait_for(r"prune: server unreachable while running.*retrying")
        passes_before = len(cmd.lines("stdout"))
        fresh_server.restart()
        anyio.run(lambda: stage_rollouts(url, ["after-restart"], calls=1))
        cmd.wait_for(r'"abandoned": \["after-restart"\]', "stdout")  # passes go on, and do their work
        assert len(cmd.lines("stdout")) > passes_before
        # Said on stderr once a pass succeeded, which may be after that pass printed its report on stdout.
        cmd.wait_for(r"prune: the server is reachable again")
        cmd.process.send_signal(signal.SIGINT)
        assert cmd.wait(timeout_s=60) == 0, cmd.lines("stderr")


def test_the_prune_service_rides_out_an_outage_while_it_opens(fresh_server: DurableServer) -> None:
    url = fresh_server.url
    fresh_server.kill()  # down before the service connects at all
    with staging_sink(*_prune(url, "--max-outage-s", "600")) as cmd:
        cmd.wait_for(r"prune: server unreachable while opening.*retrying")
        assert cmd.lines("stdout") == []
        fresh_server.restart()
        cmd.wait_for(_READY)
        cmd.wait_for(_PASS, "stdout")
        cmd.process.send_signal(signal.SIGINT)
        assert cmd.wait(timeout_s=60) == 0, cmd.lines("stderr")


def test_the_prune_service_gives_up_only_after_the_configured_outage(fresh_server: DurableServer) -> None:
    url = fresh_server.url
    with staging_sink(*_prune(url, "--max-outage-s", "1")) as cmd:
        cmd.wait_for(_PASS, "stdout")
        fresh_server.kill()
        code = cmd.wait(timeout_s=120)
    stderr = cmd.lines("stderr")
    assert code == 3, stderr
    assert any("retrying" in line for line in stderr), stderr  # it waited first
    assert any("max_outage_s=1" in line for line in stderr), stderr


def test_the_prune_service_stops_at_once_when_the_server_refuses(redis_url: str) -> None:
    with redis.Redis.from_url(redis_url) as client:
        # May connect and ask the cluster mode, may not SCAN: every pass is refused (NOPERM).
        client.acl_setuser("noscan", enabled=True, passwords=["+pw"], keys=["*"], commands=["+ping", "+info", "+hello"])
    refused_url = redis_url.replace("redis://", "redis://noscan:pw@", 1)
    with staging_sink(*_prune(refused_url, "--max-outage-s", "600")) as cmd:
        code = cmd.wait(timeout_s=120)  # far below the limit: it waited for nothing
    stderr = cmd.lines("stderr")
    assert code == 1, stderr
    errors = [line for line in stderr if line.startswith("staging-sink: error:")]
    assert len(errors) == 1 and "no permissions" in errors[0], stderr
    assert not any("retrying in" in line or "Traceback" in line for line in stderr), stderr


def test_max_outage_without_an_interval_is_a_usage_error(redis_url: str) -> None:
    with staging_sink("prune", "--redis-url", redis_url, "--max-outage-s", "5") as cmd:
        code = cmd.wait(timeout_s=60)
    assert code == 2, cmd.lines("stderr")
    assert any("--max-outage-s needs --interval-s" in line for line in cmd.lines("stderr")), cmd.lines("stderr")
