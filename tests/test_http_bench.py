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


def test_report_compares_exact_with_verify() -> None:
    results = [
        PathResult("direct", 16, 10, 1.0, [0.010] * 10),
        PathResult("capture", 16, 10, 1.0, [0.012] * 10),
        PathResult("exact", 16, 10, 1.0, [0.014] * 10),
    ]
    report = format_report(results, stage_p50_ms=1.0, tokens=64)
    assert "added over direct at 16 clients: verify p50 2.00 / p99 2.00 ms, exact p50 4.00 / p99 4.00 ms" in report
    assert "exact/verify p50 2.00 (target <= 1.5: MISSED)" in report


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
        "--turns",
        "2",
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
    rows = [line.split()[1] for line in out.splitlines() if line.split() and line.split()[0] in ("1", "2")]
    assert sorted(rows) == sorted(["direct", "bare", "capture", "exact"] * 2)
    assert "added over direct at 2 clients: verify p50" in out
