"""Every service rides out an outage up to its limit in every phase, and stops at once on a refusal.

A server that cannot be reached (:class:`~sink.errors.StagingUnavailableError`) is waited for, with backoff,
for up to ``max_outage_s`` while a service opens, runs or closes; a server that answers with an error
(:class:`~sink.errors.StagingRefusedError`, carrying the reply code) stops the service at once. Real Valkey 8 /
Redis 7.0 servers; the outages are a killed server, and every wait is on a condition (a printed line, a log
record), never a sleep.
"""

from __future__ import annotations

import logging
import pickle
import signal
import time

import anyio
import pytest
import redis
import redis.asyncio as aioredis

from sink.errors import StagingConnectionError, StagingRefusedError, StagingUnavailableError
from sink.keys import claim_key, done_stream, receipts_stream
from sink.rollout.assembler import ASSEMBLER_GROUP, Assembler
from sink.server import DurableServer
from sink.settings import AssemblerSettings
from sink.store.connection import map_redis_errors
from tests.helpers.commands import staging_sink
from tests.helpers.processes import until
from tests.helpers.trainer import publish

READY = r"^trainer \S+ on .*Ctrl-C stops it"


def _trainer(url: str, *args: str) -> tuple[str, ...]:
    return ("trainer", "--redis-url", url, "--shards", "1", *args)


@pytest.mark.anyio
async def test_a_translated_error_says_whether_the_server_is_down_or_refusing(fresh_server: DurableServer) -> None:
    async with aioredis.Redis.from_url(fresh_server.url, socket_connect_timeout=1) as client:
        await client.set("stg:plain", "x")
        with pytest.raises(StagingRefusedError) as refused, map_redis_errors("push to a string"):
            await client.lpush("stg:plain", "y")
        assert refused.value.code == "WRONGTYPE" and "WRONGTYPE" in str(refused.value)
        assert isinstance(refused.value, StagingConnectionError)  # the common base still catches both
        copy = pickle.loads(pickle.dumps(refused.value))
        assert type(copy) is StagingRefusedError and copy.code == "WRONGTYPE" and str(copy) == str(refused.value)
        fresh_server.kill()
        with pytest.raises(StagingUnavailableError) as down, map_redis_errors("ping a dead server"):
            await client.ping()
        assert not isinstance(down.value, StagingRefusedError)


def _assert_one_line_error(code: int, stderr: list[str], reply_code: str) -> None:
    assert code == 1, stderr
    errors = [line for line in stderr if line.startswith("staging-sink: error:")]
    assert len(errors) == 1 and reply_code in errors[0], stderr
    assert not any("retrying in" in line or "Traceback" in line for line in stderr), stderr


def test_the_trainer_command_exits_at_once_after_a_wrongtype_reply(redis_url: str) -> None:
    with staging_sink(*_trainer(redis_url, "--timeout-s", "600", "--max-outage-s", "600")) as cmd:
        cmd.wait_for(READY)
        with redis.Redis.from_url(redis_url) as client:
            # Something else wrote the namespace: the receipts stream is now a string, in one command (SET
            # replaces a key of any type), so the blocked read and the group's recreation both meet WRONGTYPE.
            client.set(receipts_stream("stg", 0), "not a stream")
        code = cmd.wait(timeout_s=120)  # far below both limits: it waited for neither
    _assert_one_line_error(code, cmd.lines("stderr"), "WRONGTYPE")


def test_the_trainer_command_exits_at_once_after_a_wrongtype_reply_while_claiming(redis_url: str) -> None:
    anyio.run(lambda: publish(redis_url, ["typed"], receipt_shards=1, calls=1))
    with redis.Redis.from_url(redis_url) as client:
        client.lpush(claim_key("stg", "typed"), "not a claim")  # the claim script's GET: WRONGTYPE
    with staging_sink(
        *_trainer(redis_url, "--max-rollouts", "1", "--timeout-s", "600", "--max-outage-s", "600")
    ) as cmd:
        code = cmd.wait(timeout_s=120)
    _assert_one_line_error(code, cmd.lines("stderr"), "WRONGTYPE")


def test_the_trainer_command_rides_out_an_outage_while_it_opens(fresh_server: DurableServer) -> None:
    url = fresh_server.url
    fresh_server.kill()  # down before the trainer connects at all
    with staging_sink(*_trainer(url, "--max-rollouts", "1", "--timeout-s", "600", "--max-outage-s", "600")) as cmd:
        cmd.wait_for(r"unreachable while opening.*retrying")
        assert not any(line.startswith("trainer ") and "Ctrl-C" in line for line in cmd.lines("stderr"))
        fresh_server.restart()
        anyio.run(lambda: publish(url, ["late"], receipt_shards=1, calls=1))
        assert cmd.wait(timeout_s=120) == 0, cmd.lines("stderr")
        assert any("verified" in line and "late" in line for line in cmd.lines("stdout")), cmd.lines("stdout")
        assert any("reachable again" in line for line in cmd.lines("stderr")), cmd.lines("stderr")


def test_the_trainer_command_gives_up_while_opening_only_after_the_configured_outage(
    fresh_server: DurableServer,
) -> None:
    url = fresh_server.url
    fresh_server.kill()
    started = time.monotonic()
    with staging_sink(*_trainer(url, "--max-outage-s", "2")) as cmd:
        code = cmd.wait(timeout_s=120)
    elapsed = time.monotonic() - started
    stderr = cmd.lines("stderr")
    assert code == 3, stderr
    assert elapsed >= 2.0, (elapsed, stderr)  # the outage began after `started`: never given up before the limit
    assert any("max_outage_s=2" in line for line in stderr), stderr


def _records_matching(caplog: pytest.LogCaptureFixture, text: str) -> list[logging.LogRecord]:
    return [record for record in caplog.records if text in record.getMessage()]


@pytest.mark.anyio
async def test_the_assembler_rides_out_an_outage_while_it_opens(
    fresh_server: DurableServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    settings = AssemblerSettings(done_shards=1, block_ms=50, reconnect_backoff_s=0.05, connect_timeout_s=0.5)
    fresh_server.kill()
    with anyio.fail_after(60):
        async with anyio.create_task_group() as group:
            opened = anyio.Event()

            async def open_and_stop() -> None:
                async with Assembler.from_url(fresh_server.url, settings) as assembler:
                    opened.set()
                    assembler.stop()
                    await assembler.run()

            group.start_soon(open_and_stop)
            await until(
                lambda: bool(_records_matching(caplog, "unreachable while opening")), "no outage logged while opening"
            )
            assert not opened.is_set()
            fresh_server.restart()
    assert opened.is_set()


@pytest.mark.anyio
async def test_the_assembler_rides_out_an_outage_while_it_closes(
    fresh_server: DurableServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    settings = AssemblerSettings(
        done_shards=1, block_ms=50, reconnect_backoff_s=0.05, connect_timeout_s=0.5, consumer_name="closing"
    )
    stream = done_stream("stg", 0)
    async with Assembler.from_url(fresh_server.url, settings) as assembler:
        with anyio.fail_after(60):
            async with anyio.create_task_group() as group:
                group.start_soon(assembler.run)
                async with aioredis.Redis.from_url(fresh_server.url) as client:

                    async def read_once() -> bool:  # the shard loop has read once: its consumer exists
                        return bool(await client.xinfo_consumers(stream, ASSEMBLER_GROUP))

                    await until(read_once, "the assembler's shard loop never read")
                fresh_server.kill()
                await until(
                    lambda: bool(_records_matching(caplog, "unreachable while running")),
                    "no outage logged while running",
                )
                assembler.stop()  # closing now: retiring the consumer name needs the server
                await until(
                    lambda: bool(_records_matching(caplog, "unreachable while closing")),
                    "no outage logged while closing",
                )
                fresh_server.restart()
    async with aioredis.Redis.from_url(fresh_server.url) as client:
        assert await client.xinfo_consumers(stream, ASSEMBLER_GROUP) == []  # retired once the server was back


@pytest.mark.slow  # the 5 s run waits out its timeout inside the outage; the fast tier has the other phases
def test_the_trainer_command_rides_out_an_outage_while_it_closes(fresh_server: DurableServer) -> None:
    url = fresh_server.url
    with staging_sink(*_trainer(url, "--timeout-s", "5", "--max-outage-s", "600", "--consumer-name", "closer")) as cmd:
        cmd.wait_for(READY)
        fresh_server.kill()  # down from here on: the 5 s run ends inside the outage, then it closes
        cmd.wait_for(r"unreachable while closing.*retrying")
        fresh_server.restart()
        assert cmd.wait(timeout_s=120) == 0, cmd.lines("stderr")
    with redis.Redis.from_url(url) as client:
        consumers = client.xinfo_consumers(receipts_stream("stg", 0), "trainers")
    assert [c["name"] for c in consumers] == [], consumers  # retired once the server was back


def test_the_metrics_exporter_waits_for_the_server_while_it_opens(fresh_server: DurableServer) -> None:
    url = fresh_server.url
    fresh_server.kill()  # down before the exporter asks the server's cluster mode
    with staging_sink("metrics", "--redis-url", url, "--port", "0", "--interval-s", "0.2") as cmd:
        cmd.wait_for(r"metrics: server unreachable while opening.*retrying")
        assert cmd.process.poll() is None  # it waits (it never gives up while it runs, nor while it opens)
        fresh_server.restart()
        cmd.wait_for(r"^metrics at http://\S+ \(Redis gauges from .*Ctrl-C stops it", "stdout")
        cmd.process.send_signal(signal.SIGINT)
        assert cmd.wait(timeout_s=60) == 0, cmd.lines("stderr")
