"""``staging-sink bench gym`` with --redis-url writes and deletes only its own namespace and its own files."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
import redis

from sink_cli.main import main as cli_main
from sink_tools.bench import gym as gym_bench

OTHERS = {"stg:{rollout-1}:gym": b"theirs", "team-b:{x}:gym:entries": b"theirs", "plain-key": b"value"}


def _snapshot(url: str) -> dict[bytes, bytes | None]:
    with redis.Redis.from_url(url) as client:
        return {key: client.get(key) for key in client.scan_iter(count=1000)}


def test_bench_gym_reports_both_systems_and_leaves_nothing_behind(
    redis_url: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    with redis.Redis.from_url(redis_url) as client:
        for key, value in OTHERS.items():
            client.set(key, value)
    before = _snapshot(redis_url)
    # This test's own temporary directory: another test running the benchmark at the same time (another xdist
    # worker) makes and removes its files elsewhere.
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    floor_dirs = set(Path(tempfile.gettempdir()).glob("stg-bench-gym-*"))
    assert floor_dirs == set()
    assert cli_main(["bench", "gym", "--redis-url", redis_url, "--puts", "8", "--repeats", "1", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [(r["system"], r["tasks"]) for r in report["put"][:4]] == [
        ("jsonl", 1),
        ("redis", 1),
        ("jsonl", 16),
        ("redis", 16),
    ]
    assert {r["entries"] for r in report["lifecycle"]} == {8, 400}
    assert all(r["freeze_ms"] > 0 and r["drop_ms"] > 0 for r in report["lifecycle"]) and report["lists_400_ms"] > 0
    assert len(gym_bench.gym_targets(report)) == 5
    assert _snapshot(redis_url) == before  # only its namespace was written, and all of it deleted
    assert set(Path(tempfile.gettempdir()).glob("stg-bench-gym-*")) == floor_dirs  # the floor's files too


def test_bench_gym_refuses_a_namespace_in_use(redis_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    with redis.Redis.from_url(redis_url) as client:
        client.set("mine:{r}:gym", b"someone's")
    assert gym_bench.main(["--redis-url", redis_url, "--namespace", "mine"]) == 1
    assert "already has keys in the benchmark namespace 'mine'" in capsys.readouterr().err
    with redis.Redis.from_url(redis_url) as client:
        assert client.get("mine:{r}:gym") == b"someone's"
