"""Benchmarks never destroy data: with --redis-url they write and delete only their own namespace, refuse a
namespace that already has keys, print progress to stderr and a PASS/MISS line per target."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anyio
import pytest
import redis

from sink.errors import StagingError
from sink_tools.bench import (
    DEFAULT_BENCH_NAMESPACE,
    BenchmarkNamespaceInUseError,
    Target,
    bench_namespace,
    format_targets,
)
from sink_tools.bench import assembly as assembly_bench
from sink_tools.bench import codec as codec_bench
from sink_tools.bench import stage as stage_bench
from sink_tools.bench import worker as worker_bench

pytestmark = pytest.mark.redis

BENCH_SOURCES = [Path(module.__file__ or "") for module in (stage_bench, assembly_bench, codec_bench, worker_bench)] + [
    Path(stage_bench.__file__ or "").parent / "__init__.py"
]

# Another user's data: the services' namespace, another namespace, a key with no namespace, and a key whose
# name starts like the benchmark's namespace without being in it.
OTHERS = {
    "stg:{rollout-1}:receipt": b"receipt",
    "stg:done:0": None,  # a stream
    "team-b:{x}:rec:c0": b"record",
    "plain-key": b"value",
    f"{DEFAULT_BENCH_NAMESPACE}x:key": b"not the bench namespace",
}


def _seed(url: str) -> dict[bytes, object]:
    client = redis.Redis.from_url(url)
    try:
        for key, value in OTHERS.items():
            if value is None:
                client.xadd(key, {"rollout_id": "rollout-1"})
            else:
                client.set(key, value)
        return _snapshot(client)
    finally:
        client.close()


def _snapshot(client: redis.Redis) -> dict[bytes, object]:
    out: dict[bytes, object] = {}
    for key in client.scan_iter(count=1000):
        out[key] = client.xrange(key) if client.type(key) == b"stream" else client.get(key)
    return out


def _keys_after(url: str) -> dict[bytes, object]:
    client = redis.Redis.from_url(url)
    try:
        return _snapshot(client)
    finally:
        client.close()


def test_no_benchmark_source_flushes_the_server() -> None:
    for path in BENCH_SOURCES:
        text = path.read_text().lower()
        assert ".flushall(" not in text and ".flushdb(" not in text, path


def test_stage_bench_leaves_other_namespaces_intact(redis_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    before = _seed(redis_url)
    argv = ["--redis-url", redis_url, "--records", "16", "--tokens", "128", "--concurrency", "1", "4"]
    assert stage_bench.main([*argv, "--repeats", "2"]) == 0
    out, err = capsys.readouterr()
    assert _keys_after(redis_url) == before  # nothing of theirs touched, nothing of ours left
    assert "repeat 2/2" in err and "bench: stage:" in err  # progress on stderr, not in the report
    assert "best of 2 runs" in out
    assert out.count("PASS ") + out.count("MISS ") == 4  # two configurations, the largest one's p99, chain fetch
    assert "(a)" not in out


def test_worker_bench_json_leaves_other_namespaces_intact(redis_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    before = _seed(redis_url)
    argv = ["--redis-url", redis_url, "--turns", "3", "--tokens", "64", "--repeats", "2", "--json"]
    assert worker_bench.main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["repeats"] == 2 and report["chain_ratio"] > 0
    assert _keys_after(redis_url) == before


def test_assembly_bench_in_its_own_namespace(redis_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    before = _seed(redis_url)
    argv = ["--redis-url", redis_url, "--namespace", "mine", "--rollouts", "8", "--calls", "2"]
    assert assembly_bench.main([*argv, "--rate", "40", "--latency-seconds", "0.25", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "one assembler process" in out and "finished() -> receipt p99" in out
    assert _keys_after(redis_url) == before


@pytest.mark.parametrize("bench", ["stage", "worker", "assembly"])
def test_a_namespace_with_keys_is_refused_and_untouched(
    redis_url: str, bench: str, capsys: pytest.CaptureFixture[str]
) -> None:
    client = redis.Redis.from_url(redis_url)
    try:
        client.set(f"{DEFAULT_BENCH_NAMESPACE}:{{r}}:rec:c0", b"someone's data")
        before = _snapshot(client)
    finally:
        client.close()
    main = {"stage": stage_bench.main, "worker": worker_bench.main, "assembly": assembly_bench.main}[bench]
    assert main(["--redis-url", redis_url]) == 1
    err = capsys.readouterr().err
    assert "already has keys in the benchmark namespace 'stg-bench'" in err and "--namespace" in err
    assert _keys_after(redis_url) == before


def test_bench_namespace_clears_only_its_keys_even_on_failure(redis_url: str) -> None:
    before = _seed(redis_url)

    async def body() -> None:
        async with bench_namespace(redis_url, "own") as space:
            client = redis.asyncio.Redis.from_url(redis_url)
            try:
                await client.set("own:a", 1)
                await client.xadd("own:done:0", {"k": "v"})
                await client.set("own:{r}:rec:c0", 2)
            finally:
                await client.aclose()
            assert await space.first_key() is not None
            raise RuntimeError("the benchmark failed")

    with pytest.raises(RuntimeError, match="the benchmark failed"):
        anyio.run(body)
    assert _keys_after(redis_url) == before


def test_bench_namespace_rejects_a_pattern_namespace(redis_url: str) -> None:
    async def body() -> None:
        async with bench_namespace(redis_url, "*"):
            pass

    with pytest.raises(ValueError, match="benchmark namespace"):
        anyio.run(body)


def test_the_refusal_is_a_staging_error() -> None:
    assert issubclass(BenchmarkNamespaceInUseError, StagingError)


def test_target_lines() -> None:
    lines = format_targets([Target("p99", 4.0, "<=", 50, "ms"), Target("ratio", 0.2, ">=", 0.4, "x")])
    assert lines == [
        "targets: 1 of 2 met",
        "  PASS p99: 4.00 ms (target <= 50 ms)",
        "  MISS ratio: 0.20x (target >= 0.4x)",
    ]


def test_trainer_bench_leaves_other_namespaces_intact(redis_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    from sink_tools.bench import trainer as trainer_bench

    before = _seed(redis_url)
    argv = ["--redis-url", redis_url, "--rollouts", "3", "--calls", "3", "--tokens", "512", "--repeats", "2"]
    assert trainer_bench.main([*argv, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["tokens"] == 3 * 3 * 512
    assert _keys_after(redis_url) == before
    client = redis.Redis.from_url(redis_url)
    try:
        client.set(f"{DEFAULT_BENCH_NAMESPACE}:{{r}}:receipt", b"someone's")
    finally:
        client.close()
    assert trainer_bench.main(argv) == 1
    assert "already has keys in the benchmark namespace" in capsys.readouterr().err


def _stage_row(system: str, tokens: int, concurrency: int, records_per_s: float, p99_ms: float) -> dict[str, Any]:
    return {
        "system": system,
        "tokens": tokens,
        "concurrency": concurrency,
        "records_per_s": records_per_s,
        "p99_ms": p99_ms,
    }


def test_stage_targets_are_the_issues_throughput_and_the_largest_configurations_p99() -> None:
    """Every configuration's sink/SET throughput against 1.0x; the p99 ratio of the most tokens at the most stagers
    only (here 131,072 x 16, listed before a smaller one to show the choice is by size, not by position)."""
    rows = [
        _stage_row("plain-set", 131072, 16, 180.0, 100.0),
        _stage_row("sink", 131072, 16, 180.0, 96.0),
        _stage_row("plain-set", 2048, 16, 1000.0, 10.0),
        _stage_row("sink", 2048, 16, 900.0, 30.0),
    ]
    report = {"stage": rows, "chain_fetch": {"packed_ratio": 2.3}}
    lines = [target.line() for target in stage_bench.stage_targets(report)]
    assert lines == [
        "PASS sink/baseline throughput, 131072 tokens x16: 1.00x (target >= 1x)",
        "MISS sink/baseline throughput, 2048 tokens x16: 0.90x (target >= 1x)",
        "PASS sink/baseline p99, 131072 tokens x16: 0.96x (target <= 1x)",
        "PASS fetch_packed/floor, 50-call chain: 2.30x (target <= 4x)",
    ]
