"""Benchmark: durable staging throughput and latency against a plain-SET baseline.

Run ``python -m sink_tools.bench.stage`` (or ``staging-sink bench stage``). On one
durable server (``appendfsync always``), for each record size and number of
concurrent stagers it measures, side by side in one run:

* the sink: ``AsyncRedisStagingSink.stage`` (script + calls entry + verified durability);
* the baseline: the same records encoded with ``encode_record`` and written
  with plain pipelined ``SET``s over the same number of connections;
* the server ceiling: ``redis-benchmark -t set -P 16`` with the same payload size;
* the server's own cost per record, sink and baseline: its main thread's CPU time (``INFO cpu``) over the run,
  divided by the records (what every stager queues behind on the server's single thread);
* chain fetch: ``fetch`` and ``fetch_packed`` of a 50-call chain with full verification against
  the hash-and-fetch floor (a raw ``MGET`` plus ``sha256`` over the bytes the
  digest covers).

Each configuration runs ``--repeats`` times (the run with the highest throughput is kept) and chain fetch
keeps the best of its repeats. With ``--redis-url`` the benchmark writes only under ``--namespace`` (see
:mod:`sink_tools.bench`) and skips the server ceiling (``redis-benchmark`` writes keys of its own) and the server's
cost per record (other clients' work would count too).
Targets: sink throughput at least :data:`MIN_THROUGHPUT_RATIO` of the baseline's in every configuration;
its p99 in the largest configuration (most tokens, most stagers) at most :data:`MAX_LARGEST_P99_RATIO` times the
baseline's; ``fetch_packed`` of the chain at most :data:`MAX_FETCH_PACKED_RATIO` times the floor.
"""

from __future__ import annotations

import argparse
import hashlib
import re
import shutil
import subprocess
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import anyio
import redis.asyncio as aioredis

from sink.contract.codec import encode_record
from sink.contract.records import StagedCallRecord
from sink.keys import record_key
from sink.server import DurableServer
from sink.store.sink import AsyncRedisStagingSink
from sink.store.source import AsyncRedisStagingSource
from sink_tools.bench import (
    DEFAULT_BENCH_NAMESPACE,
    DEFAULT_REPEATS,
    Target,
    add_common_arguments,
    bench_namespace,
    drive,
    format_targets,
    percentile_ms,
    progress,
    report_on_server,
)
from sink_tools.bench.workload import build_records

__all__ = (
    "MAX_FETCH_PACKED_RATIO",
    "MAX_LARGEST_P99_RATIO",
    "MIN_THROUGHPUT_RATIO",
    "StageFigures",
    "format_report",
    "main",
    "run_stage_benchmark",
    "server_ceiling",
    "stage_targets",
)

MIN_THROUGHPUT_RATIO = 1.0
"""Target: the sink's records/s at least this share of the plain-SET baseline's, in every configuration."""
MAX_LARGEST_P99_RATIO = 1.0
"""Target: the sink's p99 in the largest configuration (most tokens, then most stagers) at most this many times the
plain-SET baseline's (131,072 tokens x 16 stagers with the issue's sizes)."""
MAX_FETCH_PACKED_RATIO = 4.0
"""Target: ``fetch_packed`` of a 50-call chain at most this many times the fetch-and-hash floor."""


@dataclass(frozen=True, slots=True)
class StageFigures:
    """One measured configuration: records/s, MB/s and latency percentiles in ms."""

    system: str
    tokens: int
    concurrency: int
    records: int
    records_per_s: float
    mb_per_s: float
    p50_ms: float
    p99_ms: float
    server_cpu_us: float | None = None
    """The server main thread's CPU time per record (user + system, ``INFO cpu``); measured on a private server."""


async def _server_cpu_s(url: str) -> float:
    """The server main thread's CPU seconds so far (``used_cpu_user_main_thread`` + ``used_cpu_sys_main_thread``)."""
    async with aioredis.Redis.from_url(url) as client:
        info = await client.info("cpu")
    return float(info["used_cpu_user_main_thread"]) + float(info["used_cpu_sys_main_thread"])


async def _stop_automatic_aof_rewrites(url: str) -> None:
    """On the private server: a rewrite's fork inside one run would land in that run's server CPU
    (:func:`_compact_aof` rewrites the file between runs instead)."""
    async with aioredis.Redis.from_url(url) as client:
        await client.config_set("auto-aof-rewrite-percentage", 0)


async def _compact_aof(url: str) -> None:
    """Rewrite the private server's append-only file now, between runs, and wait for it, so the file stays small
    with automatic rewrites off."""
    async with aioredis.Redis.from_url(url) as client:
        await client.bgrewriteaof()
        with anyio.fail_after(120):
            while True:
                info = await client.info("persistence")
                if not int(info["aof_rewrite_in_progress"]) and not int(info["aof_rewrite_scheduled"]):
                    return
                await anyio.sleep(0.05)


def _figures(system: str, tokens: int, concurrency: int, nbytes: int, elapsed: float, lat: list[float]) -> StageFigures:
    return StageFigures(
        system=system,
        tokens=tokens,
        concurrency=concurrency,
        records=len(lat),
        records_per_s=len(lat) / elapsed,
        mb_per_s=nbytes / elapsed / 1e6,
        p50_ms=percentile_ms(lat, 0.50),
        p99_ms=percentile_ms(lat, 0.99),
    )


async def _bench_sink(
    url: str, namespace: str, records: list[StagedCallRecord], concurrency: int, connections: int
) -> StageFigures:
    nbytes = sum(len(encode_record(r)) for r in records)
    async with AsyncRedisStagingSink.from_url(url, writer_connections=connections, namespace=namespace) as sink:

        async def op(record: StagedCallRecord) -> None:
            result = await sink.stage(record)
            if not result.ok:
                raise RuntimeError(f"stage failed during the benchmark: {result.error}")

        elapsed, lat = await drive(records, concurrency, op)
    return _figures("sink", records[0].delta_len, concurrency, nbytes, elapsed, lat)


async def _bench_plain_set(
    url: str, namespace: str, records: list[StagedCallRecord], concurrency: int, connections: int
) -> StageFigures:
    """Baseline: encode_record + plain SETs, pipelined per connection, no script, no checks.

    Encoding is timed on both sides: the sink also encodes inside ``stage``.
    """
    nbytes = sum(len(encode_record(r)) for r in records)
    client = aioredis.Redis.from_url(url)
    send, receive = anyio.create_memory_object_stream[tuple[str, bytes, anyio.Event]](len(records))

    async def connection_writer() -> None:
        async with receive.clone() as stream:
            async for first in stream:
                batch = [first]
                while True:
                    try:
                        batch.append(stream.receive_nowait())
                    except (anyio.WouldBlock, anyio.EndOfStream):
                        break
                pipe = client.pipeline(transaction=False)
                for key, blob, _ in batch:
                    pipe.set(key, blob)
                await pipe.execute()
                for _, _, done in batch:
                    done.set()

    async def op(record: StagedCallRecord) -> None:
        done = anyio.Event()
        await send.send((f"{namespace}:base:{record.staging_key}", encode_record(record), done))
        await done.wait()

    try:
        async with anyio.create_task_group() as group:
            for _ in range(connections):
                group.start_soon(connection_writer)
            elapsed, lat = await drive(records, concurrency, op)
            send.close()
    finally:
        receive.close()
        await client.aclose()
    return _figures("plain-set", records[0].delta_len, concurrency, nbytes, elapsed, lat)


def server_ceiling(port: int, payload_bytes: int, requests: int = 2000) -> float | None:
    """``redis-benchmark -t set -P 16`` requests/s with this payload size (None if not installed)."""
    binary = shutil.which("valkey-benchmark") or shutil.which("redis-benchmark")
    if binary is None:
        return None
    argv = [binary, "-p", str(port), "-t", "set", "-P", "16", "-d", str(payload_bytes), "-n", str(requests), "-q"]
    output = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=True).stdout
    match = re.search(r"SET: ([\d.]+) requests per second", output.replace("\r", "\n"))
    return float(match.group(1)) if match else None


def _digest_payload_bytes(record: StagedCallRecord) -> int:
    ids = 16 + 8 * record.delta_len
    columns = 2 * (16 + 4 * record.delta_len)
    texts = sum(8 + len(s.encode()) for s in (record.rollout_id, record.model_call_id, record.mode))
    return 3 + texts + 9 + len(record.parent_call_id or "") + 32 + ids + columns + 32 + 33 + 33


async def _bench_chain_fetch(url: str, namespace: str, chain: list[StagedCallRecord], repeats: int) -> dict[str, float]:
    keys = [r.staging_key for r in chain]
    payloads = [bytes(_digest_payload_bytes(r)) for r in chain]
    redis_keys = [record_key(namespace, k) for k in keys]
    async with AsyncRedisStagingSource.from_url(url, namespace=namespace) as source:
        client = aioredis.Redis.from_url(url)
        try:
            fetch_times, packed_times, floor_times = [], [], []
            for _ in range(repeats):
                start = time.perf_counter()
                await source.fetch(keys)
                fetch_times.append(time.perf_counter() - start)
                start = time.perf_counter()
                await source.fetch_packed(keys)
                packed_times.append(time.perf_counter() - start)
                start = time.perf_counter()
                await client.mget(redis_keys)
                for payload in payloads:
                    hashlib.sha256(payload).digest()
                floor_times.append(time.perf_counter() - start)
        finally:
            await client.aclose()
    fetch_ms, packed_ms, floor_ms = (min(times) * 1000 for times in (fetch_times, packed_times, floor_times))
    return {
        "fetch_ms": fetch_ms,
        "fetch_packed_ms": packed_ms,
        "floor_ms": floor_ms,
        "ratio": fetch_ms / floor_ms,
        "packed_ratio": packed_ms / floor_ms,
    }


async def run_stage_benchmark(
    url: str,
    *,
    token_sizes: Sequence[int] = (2048, 16384),
    concurrencies: Sequence[int] = (1, 16, 64),
    records_per_run: int = 256,
    connections: int = 4,
    port: int | None = None,
    namespace: str = DEFAULT_BENCH_NAMESPACE,
    repeats: int = DEFAULT_REPEATS,
) -> dict[str, Any]:
    """Run every configuration *repeats* times on the server at *url*, in *namespace* only (its keys are
    cleared between runs and at the end; a namespace that already has keys is refused).

    *port* (a private server's) also measures the server ceiling with ``redis-benchmark`` and the server's CPU per
    record (with the server's automatic AOF rewrites off, the file rewritten between runs instead).

    :raises BenchmarkNamespaceInUseError: *namespace* already has keys on that server.
    """
    if repeats < 1:
        raise ValueError("repeats must be at least 1")
    results: list[StageFigures] = []
    ceilings: dict[int, float | None] = {}
    if port is not None:
        await _stop_automatic_aof_rewrites(url)
    async with bench_namespace(url, namespace) as space:
        for tokens in token_sizes:
            count = records_per_run if tokens <= 4096 else max(32, records_per_run // 4)
            for concurrency in concurrencies:
                for system in ("plain-set", "sink"):
                    bench = _bench_sink if system == "sink" else _bench_plain_set
                    runs = []
                    for repeat in range(repeats):
                        progress(f"stage: {tokens} tokens x{concurrency} {system}, repeat {repeat + 1}/{repeats}")
                        await space.clear()
                        records = build_records(count // 8, 8, tokens, tag=f"b{tokens}-{concurrency}")
                        if port is not None:
                            await _compact_aof(url)
                        cpu_before = await _server_cpu_s(url) if port is not None else 0.0
                        figures = await bench(url, namespace, records, concurrency, connections)
                        if port is not None:
                            cpu_us = (await _server_cpu_s(url) - cpu_before) / len(records) * 1e6
                            figures = replace(figures, server_cpu_us=cpu_us)
                        runs.append(figures)
                    results.append(max(runs, key=lambda figures: figures.records_per_s))
            if port is not None:
                progress(f"stage: server ceiling (redis-benchmark) at {tokens} tokens")
                ceilings[tokens] = server_ceiling(port, len(encode_record(build_records(1, 1, tokens, tag="p")[0])))
        await space.clear()
        progress(f"stage: 50-call chain fetch, best of {repeats + 4}")
        chain = build_records(1, 50, 2048, tag="chain")
        async with AsyncRedisStagingSink.from_url(url, namespace=namespace) as sink:
            for record in chain:
                await sink.stage(record)
        chain_fetch = await _bench_chain_fetch(url, namespace, chain, repeats=repeats + 4)
    return {
        "repeats": repeats,
        "stage": [asdict(f) for f in results],
        "ceiling_set_per_s": ceilings,
        "chain_fetch": chain_fetch,
    }


def stage_targets(report: dict[str, Any]) -> list[Target]:
    """The documented targets, measured (one per configuration, plus chain fetch)."""
    rows = report["stage"]
    targets = [
        Target(
            f"sink/baseline throughput, {sink['tokens']} tokens x{sink['concurrency']}",
            sink["records_per_s"] / base["records_per_s"],
            ">=",
            MIN_THROUGHPUT_RATIO,
            "x",
        )
        for base, sink in zip(rows[0::2], rows[1::2], strict=True)
    ]
    if rows:
        base, sink = max(
            zip(rows[0::2], rows[1::2], strict=True), key=lambda pair: (pair[1]["tokens"], pair[1]["concurrency"])
        )
        targets.append(
            Target(
                f"sink/baseline p99, {sink['tokens']} tokens x{sink['concurrency']}",
                sink["p99_ms"] / base["p99_ms"],
                "<=",
                MAX_LARGEST_P99_RATIO,
                "x",
            )
        )
    targets.append(
        Target(
            "fetch_packed/floor, 50-call chain",
            report["chain_fetch"]["packed_ratio"],
            "<=",
            MAX_FETCH_PACKED_RATIO,
            "x",
        )
    )
    return targets


def format_report(report: dict[str, Any]) -> str:
    """Human-readable table with the sink/baseline ratios."""
    lines = [
        f"best of {report['repeats']} runs per configuration",
        f"{'tokens':>7} {'conc':>5} {'system':>10} {'rec/s':>9} {'MB/s':>8} {'p50 ms':>8} {'p99 ms':>8}",
    ]
    rows = report["stage"]
    lines.extend(
        f"{row['tokens']:>7} {row['concurrency']:>5} {row['system']:>10} {row['records_per_s']:>9.0f} "
        f"{row['mb_per_s']:>8.1f} {row['p50_ms']:>8.2f} {row['p99_ms']:>8.2f}"
        for row in rows
    )
    lines.append("")
    for base, sink in zip(rows[0::2], rows[1::2], strict=True):
        ceiling = report["ceiling_set_per_s"].get(sink["tokens"])
        ceiling_text = f", sink/ceiling {sink['records_per_s'] / ceiling:.2f}" if ceiling else ""
        lines.append(
            f"{sink['tokens']:>6} tokens x{sink['concurrency']:<3} throughput sink/baseline "
            f"{sink['records_per_s'] / base['records_per_s']:.2f}, p99 sink/baseline "
            f"{sink['p99_ms'] / base['p99_ms']:.2f}{ceiling_text}"
        )
    for base, sink in zip(rows[0::2], rows[1::2], strict=True):
        if sink.get("server_cpu_us") is not None and base.get("server_cpu_us") is not None:
            lines.append(
                f"{sink['tokens']:>6} tokens x{sink['concurrency']:<3} server CPU per record: sink "
                f"{sink['server_cpu_us']:.1f} us, plain SET {base['server_cpu_us']:.1f} us"
            )
    for tokens, ceiling in report["ceiling_set_per_s"].items():
        lines.append(f"server ceiling (redis-benchmark -t set -P 16), {tokens} tokens: {ceiling} SET/s")
    chain = report["chain_fetch"]
    lines.append(
        f"50-call chain fetch (2048 tokens each): fetch {chain['fetch_ms']:.2f} ms ({chain['ratio']:.2f}x), "
        f"fetch_packed {chain['fetch_packed_ms']:.2f} ms ({chain['packed_ratio']:.2f}x), "
        f"floor {chain['floor_ms']:.2f} ms"
    )
    lines.extend(format_targets(stage_targets(report)))
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point: ``python -m sink_tools.bench.stage [--redis-url URL] [--namespace NS] [--json]``."""
    parser = argparse.ArgumentParser(prog="staging-sink bench stage", description=__doc__.splitlines()[0])
    add_common_arguments(parser)
    parser.add_argument(
        "--records", type=int, default=256, help="records per configuration (2,048 tokens) (default: 256)"
    )
    parser.add_argument(
        "--tokens", type=int, nargs="+", default=[2048, 16384], help="record sizes (default: 2048 16384)"
    )
    parser.add_argument(
        "--concurrency", type=int, nargs="+", default=[1, 16, 64], help="concurrent stagers (default: 1 16 64)"
    )
    parser.add_argument("--connections", type=int, default=4, help="writer connections, sink and baseline (default: 4)")
    args = parser.parse_args(argv)
    if min([args.records, args.connections, args.repeats, *args.tokens, *args.concurrency]) < 1:
        parser.error("--records, --tokens, --concurrency, --connections and --repeats must be positive")

    def run(url: str, server: DurableServer | None) -> dict[str, Any]:
        port = server.port if server else None
        return anyio.run(
            lambda: run_stage_benchmark(
                url,
                token_sizes=args.tokens,
                concurrencies=args.concurrency,
                records_per_run=args.records,
                connections=args.connections,
                port=port,
                namespace=args.namespace,
                repeats=args.repeats,
            )
        )

    return report_on_server(args.redis_url, run, format_report, as_json=args.json)


if __name__ == "__main__":
    raise SystemExit(main())
