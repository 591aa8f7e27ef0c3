"""The ``staging-sink`` command line: help, the embedded server, the ops commands against a real server,
the services (assembler, trainer, metrics), acl and bench dispatch, and the error messages and exit codes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import anyio
import pytest
import redis
import yaml

from sink.keys import record_key
from sink.ops.access.render import ADMIN_ROLE, ROLE_NAMES
from sink.rollout.assembler import finished
from sink.server import DurableServer
from sink.store.sink import AsyncRedisStagingSink
from sink_cli.common import EXIT_FAILURE, EXIT_UNREACHABLE, EXIT_USAGE, mask_url
from sink_cli.dispatch import ENV_REDIS_URL, build_parser
from sink_cli.main import main
from sink_cli.services import BENCHMARKS
from tests.helpers.acl import AclServer, start_acl_server
from tests.helpers.commands import Command, staging_sink
from tests.helpers.e2e import stage_rollouts
from tests.helpers.processes import free_port
from tests.helpers.staging import make_chain

ROOT = Path(__file__).resolve().parent.parent
SUBCOMMANDS = (
    "demo",
    "server",
    "stats",
    "assembler",
    "trainer",
    "metrics",
    "inspect",
    "verify",
    "tail",
    "retire",
    "delete",
    "list",
    "report",
    "acl",
    "dead-letters",
    "bench",
)


def sink_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "sink_cli", *args]


@pytest.fixture
def no_env_url(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_REDIS_URL, raising=False)


@pytest.fixture
def staged(redis_url: str) -> str:
    """The server URL, with rollout ``r1`` staged (3 calls of 8 tokens) and its ledger rows recorded."""
    anyio.run(partial(stage_rollouts, redis_url, ["r1"], calls=3, n_tokens=8))
    return redis_url


# --- help and parsing ----------------------------------------------------------------------------------


@pytest.mark.parametrize("command", SUBCOMMANDS)
def test_every_subcommand_has_help(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main([command, "--help"])
    assert exited.value.code == 0
    assert f"usage: staging-sink {command}" in capsys.readouterr().out


def test_top_level_help_lists_every_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--help"])
    out = capsys.readouterr().out
    assert exited.value.code == 0
    assert all(command in out for command in SUBCOMMANDS)


def test_bad_arguments_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["nosuchcommand"], ["demo", "--rollouts", "0"], ["tail"], ["stats", "--watch", "-1"], []):
        with pytest.raises(SystemExit) as exited:
            main(argv)
        assert exited.value.code == EXIT_USAGE, argv
        err = capsys.readouterr().err
        assert err.startswith("staging-sink") and err.count("\n") == 1 and "--help`" in err, err


def test_every_docker_compose_command_line_parses() -> None:
    services = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    ours = [service for service in services.values() if service.get("command", [""])[0] == "staging-sink"]
    assert {service["command"][1] for service in ours} >= {"assembler", "demo", "trainer", "metrics"}
    for service in ours:  # the URL comes from the service's environment, never its command line
        args = build_parser(env=service.get("environment", {})).parse_args(service["command"][1:])
        # every service but the simulated engine (no Redis) gets its server URL from the environment
        assert callable(args.handler) and (service["command"][1] == "engine" or args.redis_url), service["command"]


def test_environment_supplies_the_defaults() -> None:
    env = {ENV_REDIS_URL: "redis://127.0.0.1:7000", "STAGING_SINK_NAMESPACE": "team-a"}
    args = build_parser(env=env).parse_args(["stats"])
    assert (args.redis_url, args.namespace) == ("redis://127.0.0.1:7000", "team-a")
    assert build_parser(env={}).parse_args(["stats"]).redis_url is None


def test_mask_url_hides_the_password() -> None:
    assert mask_url("redis://worker:s3cret@host:6379/0") == "redis://worker:***@host:6379/0"
    assert mask_url("redis://host:6379") == "redis://host:6379"


# --- error messages and exit codes ---------------------------------------------------------------------


def test_missing_url_says_how_to_get_one(no_env_url: None, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["stats"]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "--redis-url" in err and ENV_REDIS_URL in err and "staging-sink server" in err


@pytest.mark.parametrize("url", ["http://127.0.0.1:6379", "redis://127.0.0.1:99999", "redis://", "not a url"])
def test_malformed_url_exits_2(url: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["stats", "--redis-url", url]) == EXIT_USAGE
    assert "malformed Redis URL" in capsys.readouterr().err


@pytest.mark.parametrize("command", [["stats"], ["inspect", "r1"], ["verify", "r1"], ["retire", "r1"]])
def test_unreachable_server_exits_3_without_traceback(command: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    url = f"redis://127.0.0.1:{free_port()}"
    assert main([*command, "--redis-url", url]) == EXIT_UNREACHABLE
    err = capsys.readouterr().err
    assert err.startswith("staging-sink: error: cannot reach Redis at") and "Traceback" not in err


def test_unreachable_server_in_a_subprocess_prints_one_line() -> None:
    done = subprocess.run(
        sink_command("verify", "r1", "--redis-url", f"redis://127.0.0.1:{free_port()}"),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == EXIT_UNREACHABLE
    assert done.stderr.count("\n") == 1 and "cannot reach Redis" in done.stderr, done.stderr


def test_missing_rollout_exits_1(redis_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    for command in ("inspect", "verify"):
        assert main([command, "nosuch", "--redis-url", redis_url]) == EXIT_FAILURE
        assert "no such rollout 'nosuch'" in capsys.readouterr().err


def test_invalid_rollout_id_exits_2(redis_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", "a b", "--redis-url", redis_url]) == EXIT_USAGE
    assert "Invalid rollout id" in capsys.readouterr().err


# --- server ----------------------------------------------------------------------------------------------


def test_server_prints_its_url_and_stops_on_sigterm(tmp_path: Path) -> None:
    with staging_sink("server", "--data-dir", str(tmp_path / "data")) as cmd:
        url = cmd.wait_for(r"^redis://127\.0\.0\.1:\d+$", "stdout")
        with redis.Redis.from_url(url) as client:
            assert client.ping()
            assert client.config_get("appendfsync") == {"appendfsync": "always"}
        cmd.process.send_signal(signal.SIGTERM)
        assert cmd.wait(timeout_s=30) == 0, cmd.lines("stderr")
    with pytest.raises(redis.ConnectionError), redis.Redis.from_url(url, socket_connect_timeout=1) as client:
        client.ping()


# --- ops commands on a staged rollout --------------------------------------------------------------------


def test_stats_reports_durability_and_rollouts_in_flight(staged: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["stats", "--redis-url", staged, "--json"]) == 0
    snapshot = json.loads(capsys.readouterr().out)
    assert snapshot["durability"]["durable"] is True
    assert snapshot["rollouts_in_flight"] == 1 and snapshot["calls_streams"] == 1
    assert snapshot["staged_calls_per_s"] > 0 and snapshot["dead_letters"] == 0
    assert main(["stats", "--redis-url", staged]) == 0
    out = capsys.readouterr().out
    assert "durable" in out and "1 (a capture ledger, no receipt yet); 0 receipt(s) stored" in out


def test_stats_sees_consumer_groups_and_lag(staged: str, capsys: pytest.CaptureFixture[str]) -> None:
    async def announce() -> None:
        async with redis.asyncio.Redis.from_url(staged) as client:
            await finished(client, "r1", reward=1.0)

    anyio.run(announce)
    assert main(["stats", "--redis-url", staged, "--json"]) == 0
    streams = json.loads(capsys.readouterr().out)["streams"]
    done = [stream for name, stream in streams.items() if ":done:" in name]
    assert [stream["length"] for stream in done] == [1]


def test_inspect_shows_calls_manifest_and_receipt_state(staged: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", "r1", "--redis-url", staged]) == 0
    out = capsys.readouterr().out
    assert all(call in out for call in ("c0", "c1", "c2")) and "receipt: none yet" in out and "ledger: live" in out
    assert main(["inspect", "r1", "--redis-url", staged, "--json"]) == 0
    state = json.loads(capsys.readouterr().out)
    assert [row["model_call_id"] for row in state["manifest"]["records"]] == ["c0", "c1", "c2"]
    assert len(state["calls"]) == 3 and state["receipt"] is None and state["retired"] is False


def test_verify_passes_then_fails_when_a_record_is_lost(staged: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify", "r1", "--redis-url", staged, "--json"]) == 0
    outcome = json.loads(capsys.readouterr().out)
    assert outcome["verified"] is True and outcome["tokens"] == 24 and outcome["terminal"] == "c2"
    assert main(["verify", "r1", "--redis-url", staged]) == 0
    assert "verified r1: 24 tokens" in capsys.readouterr().out
    with redis.Redis.from_url(staged) as client:
        assert client.delete(record_key("stg", "r1/c1")) == 1
    assert main(["verify", "r1", "--redis-url", staged]) == EXIT_FAILURE
    assert "NOT verified r1: missing_record" in capsys.readouterr().out


def test_tail_prints_staged_entries_and_ends(staged: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["tail", "r1", "--redis-url", staged, "--from-start", "--count", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[1] for line in lines] == ["call=c0", "call=c1"]
    assert main(["tail", "r1", "--redis-url", staged, "--timeout-s", "0.3"]) == 0
    assert capsys.readouterr().out == ""  # nothing new was staged


def test_tail_follows_a_rollout_that_starts_later(redis_url: str) -> None:
    async def stage_two() -> None:
        async with AsyncRedisStagingSink.from_url(redis_url) as sink:
            for record in make_chain("late", 2):
                assert (await sink.stage(record)).ok

    command = ("tail", "late", "--redis-url", redis_url, "--from-start", "--count", "2", "--timeout-s", "60")
    with staging_sink(*command) as cmd:
        anyio.run(stage_two)
        code = cmd.wait(timeout_s=90)
    assert code == 0, cmd.lines("stderr")
    assert [line.split()[1] for line in cmd.lines("stdout")] == ["call=c0", "call=c1"]


def test_retire_then_delete(staged: str, capsys: pytest.CaptureFixture[str]) -> None:
    anyio.run(partial(stage_rollouts, staged, ["r2"]))
    assert main(["retire", "r1", "never-seen", "--redis-url", staged, "--json", "--force"]) == 0
    assert json.loads(capsys.readouterr().out) == {
        "verb": "retire",
        "dry_run": False,
        "rollouts": [
            {"rollout_id": "r1", "ledger_removed": True, "fence_set": True},
            {"rollout_id": "never-seen", "ledger_removed": False, "fence_set": True},
        ],
        "unknown": ["never-seen"],
    }
    assert main(["inspect", "r1", "--redis-url", staged]) == 0
    assert "retired (fenced)" in capsys.readouterr().out
    assert main(["delete", "r2", "r1", "--redis-url", staged]) == 0
    out = capsys.readouterr().out
    assert "r2: deleted the ledger and the staged calls, receipt and claim\n" in out
    assert "r1: deleted the fence and the staged calls, receipt and claim\n" in out
    # delete removes every key of the rollout (records and calls too): the id is reusable.
    assert main(["verify", "r1", "--redis-url", staged]) == EXIT_FAILURE
    assert "no such rollout 'r1'" in capsys.readouterr().err


# --- services --------------------------------------------------------------------------------------------


@pytest.fixture
def assembler_process(staged: str) -> Iterator[Command]:
    with staging_sink("assembler", "--redis-url", staged) as cmd:
        yield cmd


def test_assembler_and_trainer_commands_deliver_a_verified_rollout(
    staged: str, assembler_process: Command, capsys: pytest.CaptureFixture[str]
) -> None:
    async def announce() -> None:
        async with redis.asyncio.Redis.from_url(staged) as client:
            await finished(client, "r1", reward=0.5)

    anyio.run(announce)
    assert main(["trainer", "--redis-url", staged, "--max-rollouts", "1", "--timeout-s", "60"]) == 0
    out = capsys.readouterr().out
    assert "verified r1: 24 tokens over 3 call(s), terminal c2, reward 0.5" in out
    assembler_process.process.send_signal(signal.SIGTERM)
    assert assembler_process.wait(timeout_s=30) == 0, assembler_process.lines("stderr")
    with redis.Redis.from_url(staged) as client:
        assert client.exists(record_key("stg", "r1/c0")) == 0  # acknowledged: the staged records are gone


def test_trainer_exits_1_when_fewer_rollouts_arrive(redis_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["trainer", "--redis-url", redis_url, "--max-rollouts", "1", "--timeout-s", "0.5"]) == EXIT_FAILURE
    assert "only 0 of 1 rollout(s) arrived" in capsys.readouterr().err


def test_metrics_command_serves_prometheus_text(staged: str) -> None:
    with staging_sink("metrics", "--redis-url", staged, "--port", "0", "--interval-s", "0.2") as cmd:
        line = cmd.wait_for(r"^metrics at http://", "stdout")
        url = next(word for word in line.split() if word.startswith("http://"))
        with urllib.request.urlopen(url, timeout=10) as response:
            body = response.read().decode()
        assert "staging_sink_build_info" in body and "staging_sink_collection_up" in body
        # The exporter stages and pulls nothing itself: no counter it cannot know (no stages at 0 forever).
        assert "staging_sink_stages_total" not in body and "staging_sink_rollouts_pulled_total" not in body
        cmd.process.send_signal(signal.SIGINT)
        assert cmd.wait(timeout_s=30) == 0, cmd.lines("stderr")


# --- acl and bench ---------------------------------------------------------------------------------------


def test_acl_output_loads_in_a_server(server_binary: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    passwords = {role: f"pw-{role}" for role in (*ROLE_NAMES, ADMIN_ROLE)}
    version = DurableServer(binary=server_binary).version
    argv = ["acl", "--server-version", version, *(f"--password={role}={pw}" for role, pw in passwords.items())]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert captured.err == ""  # nothing generated: every password was given
    acl_path = tmp_path / "users.acl"
    acl_path.write_text(captured.out)
    server = AclServer(
        passwords=passwords, binary=server_binary, data_dir=tmp_path / "data", extra_config={"aclfile": str(acl_path)}
    )
    with server, server.role_client("ops") as ops:
        assert ops.ping()
        with pytest.raises(redis.exceptions.NoPermissionError):
            ops.set("stg:x", "1")


def test_acl_generates_missing_passwords_into_an_env_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    env_file = tmp_path / ".env"
    assert main(["acl", "--password", "worker=given", "--env-file", str(env_file)]) == 0
    out = capsys.readouterr().out
    lines = dict(line.split("=", 1) for line in env_file.read_text().splitlines())
    assert "STG_WORKER_PASSWORD" not in lines and "STG_GATE_PASSWORD" in lines
    assert oct(env_file.stat().st_mode & 0o777) == "0o600"
    assert "user worker on #" in out and not any(password in out for password in lines.values())


def test_the_command_line_has_the_worker_commands_and_every_benchmark_of_the_tools() -> None:
    parser = build_parser({})
    for argv in (["demo"], ["proxy", "--upstream", "http://x"], ["engine"]):
        assert callable(parser.parse_args(argv).handler), argv
    with_main = {p.stem for p in (ROOT / "tools" / "sink_tools" / "bench").glob("*.py") if "\ndef main(" in p.read_text()}
    assert set(BENCHMARKS) == with_main


@pytest.mark.parametrize("name", BENCHMARKS)
def test_bench_dispatches_to_the_module(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["bench", name, "--help"])
    assert exited.value.code == 0
    assert "usage:" in capsys.readouterr().out


def test_bench_codec_runs_with_tiny_sizes(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "codec", "--sizes", "16", "--repeats", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)


def test_bench_trainer_and_worker_run_with_tiny_sizes(redis_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    trainer_args = ["--rollouts", "3", "--calls", "3", "--tokens", "512", "--repeats", "2", "--json"]
    assert main(["bench", "trainer", "--redis-url", redis_url, *trainer_args]) == 0
    figures = json.loads(capsys.readouterr().out)
    assert figures["tokens"] == 3 * 3 * 512 and figures["pull_numpy_ns"] > 0 and figures["floor_ns"] > 0
    assert main(["bench", "worker", "--redis-url", redis_url, "--turns", "3", "--tokens", "64", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["turns"] == 3 and report["chain_ratio"] > 0


def test_environment_variable_is_used_by_a_subprocess(staged: str) -> None:
    done = subprocess.run(
        sink_command("inspect", "r1", "--json"),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**os.environ, ENV_REDIS_URL: staged},
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["rollout_id"] == "r1"


def test_the_read_only_ops_user_can_run_stats_and_inspect(
    server_binary: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with start_acl_server(server_binary, tmp_path) as server:
        anyio.run(partial(stage_rollouts, server.role_url(ADMIN_ROLE), ["r1"]))
        ops = ["--redis-url", server.role_url("ops")]
        assert main(["stats", *ops, "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["rollouts_in_flight"] == 1
        assert main(["inspect", "r1", *ops, "--json"]) == 0
        assert len(json.loads(capsys.readouterr().out)["manifest"]["records"]) == 3
        assert main(["verify", "r1", "--redis-url", server.role_url(ADMIN_ROLE)]) == 0
        assert main(["retire", "r1", *ops]) == EXIT_FAILURE  # read-only: the refusal is one clear line
        err = capsys.readouterr().err
        assert err.startswith("staging-sink: error: ") and err.count("\n") == 1, err


def test_ctrl_c_ends_tail_normally(redis_url: str) -> None:
    with staging_sink("tail", "quiet", "--redis-url", redis_url) as cmd:
        cmd.wait_for("following the calls of quiet")
        cmd.process.send_signal(signal.SIGINT)
        assert cmd.wait(timeout_s=30) == 0, cmd.lines("stderr")
