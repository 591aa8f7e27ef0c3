"""``staging-sink bench proxy``: the report's arithmetic, and one tiny real run (engine and proxies as processes)."""

from __future__ import annotations

import pytest
import redis

from sink.cli.main import main
from worker.proxy.bench import PathResult, format_report


def test_report_checks_both_targets() -> None:
    results = [
        PathResult("bare", 1, 10, 1.0, [0.002] * 10),
        PathResult("capture", 1, 10, 1.0, [0.0035] * 10),
        PathResult("bare", 16, 100, 1.0, [0.01] * 100),
        PathResult("capture", 16, 40, 1.0, [0.03] * 40, errors=2),
    ]
    report = format_report(results, stage_p50_ms=1.0, tokens=2048)
    assert "capture/bare calls/s at 16 clients: 0.40 (target >= 0.5: MISSED)" in report
    assert "added p50 at 1 client: 1.50 ms (target <= 2.00 ms: ok)" in report
    assert "     16  capture     40      2      40.0" in report


@pytest.mark.slow
def test_tiny_benchmark_run(redis_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    argv = [
        "bench",
        "proxy",
        "--clients",
        "1",
        "2",
        "--tokens",
        "64",
        "--calls-per-client",
        "2",
        "--stage-samples",
        "3",
    ]
    with redis.Redis.from_url(redis_url) as client:
        client.set("other-ns:{r}:receipt", b"keep me")
        assert main([*argv, "--redis-url", redis_url]) == 0
        # Only its own namespace was written, and all of it was deleted: another namespace's key is untouched.
        assert sorted(client.scan_iter()) == [b"other-ns:{r}:receipt"]
        assert client.get("other-ns:{r}:receipt") == b"keep me"
    out = capsys.readouterr().out
    assert "capture/bare calls/s at" not in out  # no 16-client row was asked for
    assert "added p50 at 1 client" in out
    assert out.count(" capture ") == 2 and out.count(" direct ") == 2
