"""The GRPO training-loop example runs against a durable server, trains on every group exactly once, says what it
sets aside as it happens and ends by itself."""

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
from tests.helpers.trainer import publish

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "grpo_training_loop.py"
LINE = re.compile(
    r"step (\d+): groups=2 rollouts=8 bins=(\d+) tokens=(\d+) mean_reward=([\d.]+) mean\|adv\|=([\d.]+) "
    r"loss=(-?[\d.]+)"
)


def _run(url: str, tmp_path: Path, *arguments: str, timeout: float = 100) -> subprocess.CompletedProcess[str]:
    """The example as a user runs it, against *url*."""
    return subprocess.run(
        [sys.executable, "-W", "error", str(EXAMPLE), "--redis-url", url, *arguments],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        check=False,
    )


def _receipts_left(url: str) -> int:
    with redis.Redis.from_url(url) as client:
        return sum(int(client.xlen(receipts_stream("stg", shard))) for shard in range(DEFAULT_SHARDS))


def _publish_group(url: str, group_id: str, members: int, size: int, *, calls: int, n_tokens: int) -> int:
    """Publish *members* rollouts of group *group_id* (announced *size*); return their row length."""
    ids = [f"{group_id}-{i}" for i in range(members)]
    groups = dict.fromkeys(ids, (group_id, size))
    staged = anyio.run(lambda: publish(url, ids, groups=groups, calls=calls, n_tokens=n_tokens))
    [length] = {len(s.token_ids) for s in staged.values()}
    return length


def test_the_example_reports_what_it_sets_aside_as_it_happens_and_ends_by_itself(
    redis_url: str, tmp_path: Path
) -> None:
    """Found against real proxy rollouts: rows over --max-tokens were set aside silently and the pull loop never
    ended. Now: a line per group set aside (overlong), with the numbers, as it happens; the loop ends when no group
    came for --idle-timeout-s, well before its --max-steps. An incomplete group waits at the assemblers: never
    published, never delivered."""
    short = _publish_group(redis_url, "fits", 2, 2, calls=2, n_tokens=4)
    long = _publish_group(redis_url, "long", 2, 2, calls=3, n_tokens=12)
    _publish_group(redis_url, "part", 2, 3, calls=2, n_tokens=4)  # the third member never comes
    assert short < long
    max_tokens = short + 1
    arguments = ["--no-simulate", "--max-steps", "5", "--groups-per-step", "1", "--max-tokens", str(max_tokens)]
    result = _run(redis_url, tmp_path, *arguments, "--idle-timeout-s", "2")
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.strip().splitlines()
    steps = [line for line in lines if line.startswith("step ")]
    assert len(steps) == 1 and "groups=1 rollouts=2 " in steps[0], lines
    overlong = [i for i, line in enumerate(lines) if line.startswith("set aside group 'long' (2 rollouts)")]
    assert len(overlong) == 1, lines
    assert f"{long} tokens > --max-tokens {max_tokens}" in lines[overlong[0]], lines
    assert not any("'part'" in line for line in lines), lines
    [stop] = [i for i, line in enumerate(lines) if line.startswith("no new group for 2")]
    assert "after 1 of 5 steps" in lines[stop], lines
    assert overlong[0] < stop  # said when it happened, not only in the summary
    summary = "\n".join(lines[stop:])
    assert re.search(r"left 1 overlong .*group \(2 rollouts\) unacknowledged", summary), summary
    assert _receipts_left(redis_url) == 1  # the trained group was consumed; the overlong group's entry stays


def test_the_default_max_tokens_fits_a_multi_turn_agent_rollout(redis_url: str, tmp_path: Path) -> None:
    """Rows of a few thousand tokens (several turns of prompt, tool output and generation) train at the defaults."""
    length = _publish_group(redis_url, "agent", 2, 2, calls=6, n_tokens=400)
    assert length > 2000
    result = _run(redis_url, tmp_path, "--no-simulate", "--max-steps", "1", "--groups-per-step", "1")
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("step 0: groups=1 rollouts=2 "), lines
    assert f"tokens={2 * length} " in lines[0]
    assert _receipts_left(redis_url) == 0


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
        members = list(client.scan_iter(match="stg:{grp:*}:members"))  # kept with the tombstone, expiring
        assert all(client.pttl(key) > 0 for key in members)
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
    assert left == 4  # only the group of the 2 trained rollouts was consumed: 4 group entries (8 rollouts) left
