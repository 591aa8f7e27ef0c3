"""Line-oriented output stays one record per line when piped: ``tail``, ``verify``, the trainer's rollout lines
and the service banners are never hard-wrapped at a terminal width (``COLUMNS`` set or not)."""

from __future__ import annotations

import os
import subprocess
import sys

import anyio
import pytest
import redis

from sink.keys import record_key
from tests.helpers.e2e import stage_rollouts
from tests.helpers.trainer import publish

LONG = "line-" + "x" * 110  # every record line about this rollout is well over 120 characters


def _piped(*args: str, columns: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    if columns is not None:
        env["COLUMNS"] = columns
    return subprocess.run(
        [sys.executable, "-m", "sink_cli", *args],
        capture_output=True,  # stdout and stderr are pipes, not terminals
        text=True,
        timeout=60,
        env=env,
        check=False,
    )


@pytest.mark.parametrize("columns", [None, "40"])
def test_tail_prints_one_line_per_staged_record(redis_url: str, columns: str | None) -> None:
    anyio.run(lambda: stage_rollouts(redis_url, [LONG], calls=3))
    result = _piped("tail", LONG, "--from-start", "--count", "3", "--redis-url", redis_url, columns=columns)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 3, lines
    assert all(f"key={LONG}/c" in line and line.rstrip().endswith(line.split("key=")[1]) for line in lines)
    assert all(len(line) > 120 for line in lines)
    (banner,) = result.stderr.splitlines()
    assert banner.startswith(f"following the calls of {LONG} from ") and banner.endswith("Ctrl-C stops")


def test_verify_prints_one_line_verified_or_not(redis_url: str) -> None:
    staged = anyio.run(lambda: publish(redis_url, [LONG], calls=2))
    result = _piped("verify", LONG, "--redis-url", redis_url, columns="40")
    assert result.returncode == 0, result.stderr
    (line,) = result.stdout.splitlines()
    assert line.startswith(f"verified {LONG}: ") and line.endswith("stored receipt")
    with redis.Redis.from_url(redis_url) as client:
        client.delete(record_key("stg", staged[LONG].staging_keys[1]))
    result = _piped("verify", LONG, "--redis-url", redis_url, columns="40")
    assert result.returncode == 1
    (line,) = result.stdout.splitlines()
    assert line.startswith(f"NOT verified {LONG}: missing_record") and line.endswith("(stored receipt)")


def test_the_trainer_prints_one_line_per_rollout_and_its_banners_whole(redis_url: str) -> None:
    staged = anyio.run(lambda: publish(redis_url, [LONG, LONG + "-2"], calls=2))
    with redis.Redis.from_url(redis_url) as client:  # one skipped rollout, with a long skip reason
        client.delete(record_key("stg", staged[LONG + "-2"].staging_keys[0]))
    name = "rank-" + "r" * 100
    result = _piped(
        "trainer", "--max-rollouts", "2", "--timeout-s", "30", "--consumer-name", name, "--redis-url", redis_url
    )
    assert result.returncode == 0, result.stderr
    lines = sorted(result.stdout.splitlines())
    assert len(lines) == 2, lines
    assert lines[0].startswith(f"skipped {LONG}-2: missing_record (") and lines[0].endswith(")")
    assert lines[1].startswith(f"verified {LONG}: ") and "reward" in lines[1]
    banners = result.stderr.splitlines()
    assert any(b.startswith(f"trainer {name} on ") and b.endswith("Ctrl-C stops it") for b in banners), banners
