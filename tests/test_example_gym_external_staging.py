"""The external-staging example: a worker staging from 16 threads through the sync StagingSink, a finalizer
fetching through the sync StagingSource, against a durable server."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import redis

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "gym_external_staging.py"


def test_the_example_stages_from_16_threads_and_finalizes_everything(redis_url: str, tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    argv = [sys.executable, "-W", "error", str(EXAMPLE), "--redis-url", redis_url, "--threads", "16"]
    result = subprocess.run(
        [*argv, "--rollouts", "48", "--calls", "3", "--namespace", "gymx"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env=env,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "finalized 48 rollouts, 144 records verified and cleared, staged from 16 threads"
    with redis.Redis.from_url(redis_url) as client:
        assert list(client.scan_iter(match="gymx:*")) == []  # every staged record was cleared
