"""The GRPO training-loop example runs against a durable server and trains on every group exactly once."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import anyio
import redis

from sink.keys import receipts_stream
from sink.settings import DEFAULT_SHARDS

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "grpo_training_loop.py"
LINE = re.compile(
    r"step (\d+): groups=2 rollouts=8 bins=(\d+) tokens=(\d+) mean_reward=([\d.]+) mean\|adv\|=([\d.]+) "
    r"loss=(-?[\d.]+)"
)


def test_the_training_loop_example_prints_one_line_per_step_and_acks_everything(redis_url: str, tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, "-W", "error", str(EXAMPLE), "--redis-url", redis_url, "--steps", "3"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env=env,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.strip().splitlines()
    matches = [LINE.fullmatch(line) for line in lines]
    assert len(lines) == 3 and all(matches), lines
    assert [int(m.group(1)) for m in matches if m] == [0, 1, 2]
    assert all(int(m.group(2)) >= 1 and int(m.group(3)) > 0 for m in matches if m)
    with redis.Redis.from_url(redis_url) as client:
        # Everything trained was acknowledged: no receipt entry left, no staged record left.
        assert [client.xlen(receipts_stream("stg", shard)) for shard in range(DEFAULT_SHARDS)] == [0] * DEFAULT_SHARDS
        assert list(client.scan_iter(match="stg:{*}:rec:*")) == []
        assert list(client.scan_iter(match="stg:{grp:*}:members")) == []  # group members records deleted at ack
        metas = list(client.scan_iter(match="stg:{grp:*}:meta"))  # closed tombstones, expiring
        assert all(client.hget(meta, "closed") == b"1" and client.pttl(meta) > 0 for meta in metas)


def test_the_example_acknowledges_only_what_it_trained_and_says_what_it_left(redis_url: str, tmp_path: Path) -> None:
    """10 rollouts queued (5 groups of 2), 1 step of 1 group: 2 trained and acknowledged, 8 left pending."""
    spec = importlib.util.spec_from_file_location("grpo_training_loop", EXAMPLE)
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    anyio.run(example.simulate, redis_url, 5, 2)  # 10 rollouts queued
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    arguments = ["--no-simulate", "--steps", "1", "--groups-per-step", "1", "--group-size", "2"]
    result = subprocess.run(
        [sys.executable, "-W", "error", str(EXAMPLE), "--redis-url", redis_url, *arguments],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env=env,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "groups=1 rollouts=2 " in result.stdout
    assert re.search(r"left \d+ pulled groups? \(\d+ rollouts\) unacknowledged", result.stdout), result.stdout
    with redis.Redis.from_url(redis_url) as client:
        left = sum(int(client.xlen(receipts_stream("stg", shard))) for shard in range(DEFAULT_SHARDS))
    assert left == 8  # only the 2 trained rollouts were consumed
