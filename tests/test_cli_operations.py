"""Operator commands that tell the truth: ``stats --check``, ``list``, ``retire``/``delete``
with ``--dry-run`` and ``--force``, ``verify`` of a consumed rollout, consumer idle times, and the CLI paper
cuts (log lines, ``-v`` anywhere, ``--version``, defaults in help, one-line errors, line-delimited JSON,
``tail`` of an unknown rollout). Every command runs against a real server."""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import urllib.request
from functools import partial

import anyio
import pytest
import redis

from sink.keys import dead_letter_stream, fence_key, ledger_stream, receipt_key
from sink.rollout.assembler import finished
from sink.server import DurableServer
from sink.trainer.reader.rollout_reader import RolloutReader
from sink_cli.common import EXIT_FAILURE, EXIT_OK, EXIT_USAGE
from sink_cli.dispatch import build_parser
from sink_cli.main import main
from sink_tools.cluster import LocalCluster
from tests.helpers.commands import staging_sink
from tests.helpers.e2e import pull_until, running_assembler, stage_rollouts
from tests.helpers.processes import until, wait_for

STATES = ("staging", "finished", "receipt_waiting", "claimed", "poisoned", "dead_lettered", "consumed")


def sink_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "sink_cli", *args]


@pytest.fixture
def staged(redis_url: str) -> str:
    anyio.run(partial(stage_rollouts, redis_url, ["r1"], calls=3, n_tokens=8))
    return redis_url


async def _wait_for_receipts(url: str, rollout_ids: list[str]) -> None:
    keys = [receipt_key("stg", rid) for rid in rollout_ids]
    async with redis.asyncio.Redis.from_url(url) as client:

        async def stored() -> bool:
            return bool(await client.exists(*keys) == len(keys))

        await until(stored, f"no receipts for {rollout_ids} after 30 s", timeout_s=30)


async def _lifecycle(url: str) -> None:
    """One rollout in each state: ``s-<state>``."""
    await stage_rollouts(url, [f"s-{state}" for state in STATES], calls=2, n_tokens=8)
    async with redis.asyncio.Redis.from_url(url) as client:
        for rid in ("s-claimed", "s-consumed"):
            await finished(client, rid, reward=1.0)
        async with running_assembler(url):
            await _wait_for_receipts(url, ["s-claimed", "s-consumed"])
        async with RolloutReader.from_url(url, consumer_name="rank-0") as reader:
            pulled = await pull_until(reader, 2)
            assert {rollout.rollout_id for rollout in pulled} == {"s-claimed", "s-consumed"}
            await reader.ack(["s-consumed"])  # s-claimed stays claimed: the reader closes without acking it
        await finished(client, "s-receipt_waiting", reward=1.0)
        await finished(client, "s-poisoned", reward=1.0, declared_response_id="no-such-response")
        async with running_assembler(url):
            await _wait_for_receipts(url, ["s-receipt_waiting", "s-poisoned"])
        await finished(client, "s-finished", reward=1.0)
        await client.xadd(
            dead_letter_stream("stg", "receipts-0"), {"rollout_id": "s-dead_lettered", "dead_reason": "test"}
        )


@pytest.fixture
def lifecycle(redis_url: str) -> str:
    anyio.run(_lifecycle, redis_url)
    return redis_url


# --- stats --check -----------------------------------------------------------------------------------------


def test_stats_check_passes_on_a_healthy_namespace(staged: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["stats", "--redis-url", staged, "--check"]) == EXIT_OK
    assert "check: ok" in capsys.readouterr().out


def test_stats_check_fails_on_a_non_durable_server(
    everysec_server: DurableServer, capsys: pytest.CaptureFixture[str]
) -> None:
    with redis.Redis.from_url(everysec_server.url) as client:
        client.xadd(ledger_stream("stg", "r1"), {"row": "{}"})  # the namespace is not empty
    assert main(["stats", "--redis-url", everysec_server.url]) == EXIT_OK  # without --check: report only
    capsys.readouterr()
    assert main(["stats", "--redis-url", everysec_server.url, "--check"]) == EXIT_FAILURE
    assert "not durable" in capsys.readouterr().out.lower()


def test_stats_check_fails_on_dead_letters(staged: str, capsys: pytest.CaptureFixture[str]) -> None:
    with redis.Redis.from_url(staged) as client:
        client.xadd(dead_letter_stream("stg", "done-0"), {"rollout_id": "r1", "dead_reason": "test"})
    assert main(["stats", "--redis-url", staged, "--check"]) == EXIT_FAILURE
    assert "1 dead letter" in capsys.readouterr().out


def test_stats_check_fails_when_lagging_past_max_lag(staged: str, capsys: pytest.CaptureFixture[str]) -> None:
    async def announce() -> None:
        async with redis.asyncio.Redis.from_url(staged) as client:
            for index in range(3):
                await finished(client, f"late-{index}", reward=0.0)

    anyio.run(announce)
    assert main(["stats", "--redis-url", staged, "--check", "--max-lag", "2"]) == EXIT_FAILURE
    assert "lag" in capsys.readouterr().out
    assert main(["stats", "--redis-url", staged, "--check", "--max-lag", "3"]) == EXIT_OK


def test_stats_on_an_empty_namespace_lists_the_namespaces_found(
    staged: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["stats", "--redis-url", staged, "--namespace", "stgg"]) == EXIT_OK
    err = capsys.readouterr().err
    assert "no keys in namespace 'stgg'" in err and "stg" in err
    # An empty namespace (every fresh deployment) is idle, not broken.
    assert main(["stats", "--redis-url", staged, "--namespace", "stgg", "--check"]) == EXIT_OK
    assert "note: idle: no keys in namespace 'stgg' yet" in capsys.readouterr().out


def test_stats_check_passes_after_routine_abandonment_by_prune(staged: str, capsys: pytest.CaptureFixture[str]) -> None:
    with redis.Redis.from_url(staged) as client:
        client.xadd(dead_letter_stream("stg", "abandoned"), {"rollout_id": "r-old", "reason": "abandoned"})
    assert main(["stats", "--redis-url", staged, "--check"]) == EXIT_OK
    assert "note: handled: 1 entr(ies) in stg:dead:abandoned" in capsys.readouterr().out


def test_dead_letters_list_ack_and_clear(staged: str, capsys: pytest.CaptureFixture[str]) -> None:
    dead = dead_letter_stream("stg", "done-0")
    with redis.Redis.from_url(staged) as client:
        client.xadd(dead, {"rollout_id": "r1", "dead_reason": "poison one"})
        client.xadd(dead_letter_stream("other", "done-0"), {"rollout_id": "x", "dead_reason": "not ours"})
    assert main(["stats", "--redis-url", staged, "--check"]) == EXIT_FAILURE
    assert main(["dead-letters", "list", "--redis-url", staged]) == EXIT_OK
    out = capsys.readouterr().out
    assert "stg:dead:done-0: 1 newest entry" in out and "poison one" in out and "not ours" not in out
    assert main(["dead-letters", "ack", "--redis-url", staged]) == EXIT_OK
    assert main(["stats", "--redis-url", staged, "--check"]) == EXIT_OK  # known and acknowledged
    assert "note: acknowledged: 1 dead letter(s) in stg:dead:done-0" in capsys.readouterr().out
    with redis.Redis.from_url(staged) as client:
        client.xadd(dead, {"rollout_id": "r2", "dead_reason": "poison two"})  # newer than the ack: broken again
    assert main(["stats", "--redis-url", staged, "--check"]) == EXIT_FAILURE
    assert "1 dead letter(s) newer than the last `staging-sink dead-letters ack`" in capsys.readouterr().out
    assert main(["dead-letters", "clear", "--redis-url", staged]) == EXIT_OK
    with redis.Redis.from_url(staged) as client:
        assert not client.exists(dead) and client.exists(dead_letter_stream("other", "done-0"))  # namespace only
    assert main(["stats", "--redis-url", staged, "--check"]) == EXIT_OK


def test_stats_shows_consumer_idle_time(lifecycle: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["stats", "--redis-url", lifecycle, "--json"]) == EXIT_OK
    consumers = json.loads(capsys.readouterr().out)["consumers"]
    rank = [consumer for consumer in consumers if consumer["consumer"] == "rank-0"]
    assert len(rank) == 1 and rank[0]["idle_ms"] >= 0 and rank[0]["pending"] == 1
    assert main(["stats", "--redis-url", lifecycle]) == EXIT_OK
    out = capsys.readouterr().out
    assert "rank-0" in out and "idle" in out


def test_stats_watch_json_is_one_object_per_line(staged: str) -> None:
    with staging_sink("stats", "--redis-url", staged, "--watch", "0.2", "--json") as cmd:
        cmd.wait_for(".", "stdout", count=2)  # two refreshes
        lines = cmd.lines("stdout")[:2]  # complete lines (a later one may be cut by the kill)
    assert all(json.loads(line)["namespace"] == "stg" for line in lines)


# --- rollouts in flight: one meaning for stats and the exporter ---------------------------------------------


def _exported(url: str, series: str) -> float:
    """*series* from the exporter at *url*, once its first collection is in (a generous deadline)."""
    lines: list[str] = []

    def collected() -> bool:
        with urllib.request.urlopen(url, timeout=10) as response:
            lines[:] = response.read().decode().splitlines()
        return 'staging_sink_collection_up{namespace="stg"} 1.0' in lines

    wait_for(collected, f"the exporter at {url} collected nothing in 60 s", timeout_s=60)
    return float(next(line.split()[-1] for line in lines if line.startswith(series + " ")))


def test_stats_and_the_exporter_count_the_same_rollouts_in_flight(
    lifecycle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A rollout in flight has a capture ledger and no receipt yet: s-staging, s-finished (not assembled) and
    s-dead_lettered (staged only); not the rollouts with a receipt (waiting, claimed, poisoned) nor s-consumed."""
    assert main(["stats", "--redis-url", lifecycle, "--json"]) == EXIT_OK
    snapshot = json.loads(capsys.readouterr().out)
    command = sink_command("metrics", "--redis-url", lifecycle, "--port", "0", "--interval-s", "0.2")
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as process:
        try:
            assert process.stdout is not None
            url = next(word for word in process.stdout.readline().split() if word.startswith("http://"))
            in_flight = _exported(url, 'staging_sink_rollouts_in_flight{namespace="stg"}')
            retained = _exported(url, 'staging_sink_receipts_retained{namespace="stg"}')
        finally:
            process.send_signal(signal.SIGINT)
            process.communicate(timeout=30)
    assert snapshot["rollouts_in_flight"] == in_flight == 3
    assert snapshot["receipts_retained"] == retained == 4
    assert main(["stats", "--redis-url", lifecycle]) == EXIT_OK
    assert "3 (a capture ledger, no receipt yet); 4 receipt(s) stored" in capsys.readouterr().out


# --- list ---------------------------------------------------------------------------------------------------


def test_list_shows_rollouts_by_state(lifecycle: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["list", "--redis-url", lifecycle, "--json"]) == EXIT_OK
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert {row["rollout_id"]: row["state"] for row in rows} == {f"s-{state}": state for state in STATES}
    assert main(["list", "--redis-url", lifecycle, "--state", "claimed", "--state", "poisoned"]) == EXIT_OK
    out = capsys.readouterr().out
    assert "s-claimed" in out and "s-poisoned" in out and "s-staging" not in out


def test_list_rejects_an_unknown_state(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["list", "--redis-url", "redis://127.0.0.1:1", "--state", "sleeping"])
    assert exited.value.code == EXIT_USAGE


# --- retire / delete ----------------------------------------------------------------------------------------


def test_retire_refuses_an_unknown_id_without_force(staged: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["retire", "r1", "never-seen", "--redis-url", staged]) == EXIT_FAILURE
    assert "never-seen" in capsys.readouterr().err
    with redis.Redis.from_url(staged) as client:
        assert client.exists(fence_key("stg", "never-seen"), fence_key("stg", "r1")) == 0  # nothing changed
    assert main(["retire", "never-seen", "--redis-url", staged, "--force"]) == EXIT_OK
    assert "never-seen: fenced" in capsys.readouterr().out


def test_retire_dry_run_changes_nothing(staged: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["retire", "r1", "--redis-url", staged, "--dry-run"]) == EXIT_OK
    assert "r1: would retire" in capsys.readouterr().out
    with redis.Redis.from_url(staged) as client:
        assert client.exists(ledger_stream("stg", "r1")) == 1 and client.exists(fence_key("stg", "r1")) == 0


def test_delete_reports_the_fence_it_removed(staged: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["retire", "r1", "--redis-url", staged]) == EXIT_OK
    assert "r1: retired" in capsys.readouterr().out
    assert main(["retire", "r1", "--redis-url", staged]) == EXIT_OK
    assert "r1: already retired" in capsys.readouterr().out
    assert main(["delete", "r1", "--redis-url", staged, "--dry-run"]) == EXIT_OK
    assert "r1: would delete the fence" in capsys.readouterr().out
    assert main(["delete", "r1", "--redis-url", staged, "--json"]) == EXIT_OK
    report = json.loads(capsys.readouterr().out)
    assert report["rollouts"] == [
        {"rollout_id": "r1", "ledger_removed": False, "fence_removed": True, "other_removed": True}
    ]
    with redis.Redis.from_url(staged) as client:  # every key of the rollout went: the id is reusable
        assert client.exists(fence_key("stg", "r1")) == 0
        assert list(client.scan_iter(match="stg:{r1}:*")) == []


# --- verify of a consumed rollout ---------------------------------------------------------------------------


def test_verify_says_consumed_for_an_acked_rollout(lifecycle: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify", "s-consumed", "--redis-url", lifecycle]) == EXIT_OK
    out = capsys.readouterr().out
    assert "consumed s-consumed" in out and "NOT verified" not in out
    assert main(["verify", "s-consumed", "--redis-url", lifecycle, "--json"]) == EXIT_OK
    assert json.loads(capsys.readouterr().out)["consumed"] is True


# --- tail ---------------------------------------------------------------------------------------------------


def test_tail_of_an_unknown_rollout_says_so(redis_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["tail", "nobody", "--redis-url", redis_url, "--timeout-s", "0.2"]) == EXIT_OK
    assert "no such rollout yet" in capsys.readouterr().err


# --- paper cuts ---------------------------------------------------------------------------------------------


def test_verbose_is_accepted_after_the_subcommand() -> None:
    assert build_parser(env={}).parse_args(["stats", "-v"]).verbose is True
    assert build_parser(env={}).parse_args(["-v", "stats"]).verbose is True
    assert build_parser(env={}).parse_args(["stats"]).verbose is False


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out.startswith("staging-sink ")


def test_every_help_shows_the_defaults() -> None:
    parser = build_parser(env={})
    subcommands = next(action for action in parser._actions if isinstance(action, argparse._SubParsersAction))
    commands: dict[str, argparse.ArgumentParser] = {"staging-sink": parser, **subcommands.choices}
    for name, command in commands.items():
        formatter = command._get_formatter()
        for action in command._actions:
            if action.default in (None, False, [], argparse.SUPPRESS) or action.help in (None, argparse.SUPPRESS):
                continue
            assert "default" in formatter._expand_help(action), (name, action.option_strings)


def test_invalid_namespace_is_one_line(redis_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["stats", "--redis-url", redis_url, "--namespace", "bad ns"])
    assert exited.value.code == EXIT_USAGE
    err = capsys.readouterr().err
    assert "--namespace" in err and "http" not in err and "pydantic" not in err


def test_an_invalid_setting_is_one_line(redis_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["trainer", "--redis-url", redis_url, "--consumer-name", ""]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert err.startswith("staging-sink: error: invalid setting: consumer_name: ") and err.count("\n") == 1, err
    assert "http" not in err


def test_log_lines_have_timestamps_and_a_json_format(redis_url: str) -> None:
    done = subprocess.run(
        sink_command("trainer", "--redis-url", redis_url, "--timeout-s", "0.3", "-v", "--log-format", "json"),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == EXIT_OK, done.stderr
    records = [json.loads(line) for line in done.stderr.splitlines() if line.startswith("{")]
    assert records and all({"time", "level", "logger", "message"} <= record.keys() for record in records)
    done = subprocess.run(
        sink_command("trainer", "--redis-url", redis_url, "--timeout-s", "0.3", "-v"),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    logged = [line for line in done.stderr.splitlines() if " INFO " in line]
    assert logged and all(line[:4].isdigit() and line[10] == "T" for line in logged), done.stderr


# --- on a cluster -------------------------------------------------------------------------------------------


def test_list_retire_delete_and_stats_on_a_cluster(cluster: LocalCluster, capsys: pytest.CaptureFixture[str]) -> None:
    rollout_ids = ["ops-cli-a", "ops-cli-b"]
    anyio.run(partial(stage_rollouts, cluster.url, rollout_ids, cluster=True))
    target = ["--redis-url", cluster.url, "--cluster"]

    def states() -> dict[str, str]:
        assert main(["list", *target, "--json"]) == EXIT_OK
        rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
        return {row["rollout_id"]: row["state"] for row in rows if row["rollout_id"] in rollout_ids}

    assert states() == dict.fromkeys(rollout_ids, "staging")
    assert main(["retire", *rollout_ids, *target]) == EXIT_OK
    assert capsys.readouterr().out.count("retired (ledger removed, fence set)") == 2
    assert states() == dict.fromkeys(rollout_ids, "retired")
    assert main(["delete", *rollout_ids, *target, "--json"]) == EXIT_OK
    assert [entry["fence_removed"] for entry in json.loads(capsys.readouterr().out)["rollouts"]] == [True, True]
    assert main(["stats", *target, "--json"]) == EXIT_OK
    snapshot = json.loads(capsys.readouterr().out)
    assert snapshot["durability"]["nodes_checked"] == 6 and isinstance(snapshot["consumers"], list)
