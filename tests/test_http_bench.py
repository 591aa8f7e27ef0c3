"""``staging-sink bench proxy``: the report's arithmetic, and one tiny real run (engine and proxies as processes)."""

from __future__ import annotations

import pytest
import redis

from sink_cli.main import main
from sink_tools.bench.proxy import PathResult, format_report


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


def test_report_takes_each_figure_from_the_best_repeat() -> None:
    results = [
        PathResult("bare", 16, 100, 2.0, [0.020] * 100),
        PathResult("bare", 16, 100, 1.0, [0.030] * 100),
        PathResult("capture", 16, 100, 2.0, [0.040] * 100),
        PathResult("capture", 16, 100, 4.0, [0.050] * 100),
    ]
    report = format_report(results, stage_p50_ms=1.0, tokens=64, engine="the test engine")
    assert "best of 2 interleaved repeat(s)" in report and "engine: the test engine" in report
    assert "     16     bare    100      0     100.0    20.00    20.00" in report  # the best p50 and calls/s
    assert "capture/bare calls/s at 16 clients: 0.50 (target >= 0.5: ok)" in report


def test_report_checks_the_proxys_own_share() -> None:
    own = PathResult("capture", 16, 4, 1.0, [0.01] * 4, engine_s=[0.006] * 4, own_s=[0.004] * 4, capture_s=[0.002] * 4)
    report = format_report([own], stage_p50_ms=1.5, tokens=64)
    assert "     16  capture      4      0       4.0    10.00    10.00     4.00     4.00" in report
    assert (
        "proxy's own share, capture at 16 clients: p50 4.00 / p99 4.00 ms (stage + commit p50 2.00 ms, engine wait "
        "p50 6.00 ms; target p50 <= stage p50 + 2 = 3.50 ms: MISSED)"
    ) in report
    assert "MISSED" not in format_report([own], stage_p50_ms=2.0, tokens=64)


def test_report_of_paths_that_only_failed() -> None:
    results = [PathResult("bare", 16, 0, 1.0, [], errors=16), PathResult("capture", 16, 0, 1.0, [], errors=16)]
    report = format_report(results, stage_p50_ms=1.0, tokens=64)
    assert "     16     bare      0     16       0.0      nan      nan" in report
    assert "calls/s at 16 clients" not in report  # no ratio over a path without one successful call


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
        "--repeats",
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
    assert "best of 2 interleaved repeat(s)" in out and "engine: the simulated engine" in out
    assert "proxy's own share, capture at 2 clients: p50" in out and "proxy's own share, exact at 1 clients" in out
    rows = [line.split()[1] for line in out.splitlines() if line.split() and line.split()[0] in ("1", "2")]
    assert sorted(rows) == sorted(["direct", "bare", "capture", "exact"] * 2)
    assert "added over direct at 2 clients: verify p50" in out
