"""``staging-sink demo --http``: agents over HTTP through the capture proxy; the trainer verifies every rollout
except those whose history the agent edited on purpose (skipped as unresolved_parent)."""

from __future__ import annotations

import json

import pytest

from sink_cli.main import main


def test_demo_over_http(redis_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["demo", "--http", "--redis-url", redis_url, "--rollouts", "6", "--turns", "3", "--inject-failures", "2"]
    assert main([*argv, "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["ok"] is True and summary["verified"] == 4
    assert sorted(set(summary["skipped"].values())) == ["unresolved_parent"] and len(summary["skipped"]) == 2
    assert summary["proxy_calls"]["capture_failed"] == 0 and summary["proxy_calls"]["captured"] >= 14
    assert summary["path"].startswith("HTTP: ")
