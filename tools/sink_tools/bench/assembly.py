"""Benchmark: receipt assembly throughput and finished()-to-receipt latency.

Run ``python -m sink_tools.bench.assembly [--redis-url URL]`` (default: a private
durable server). Every rollout has a 32-call linear ledger. Measured:

* throughput: N done events are queued, then one and then two assembler
  processes (each its own interpreter, as deployed) turn them into stored,
  published receipts; rollouts/s from the start signal to the last receipt;
* latency: one assembler process, ``finished()`` paced at a steady rate
  (default 100 rollouts/s); time from ``finished()`` returning to the receipt
  being readable on ``ns:receipts:<k>`` (a blocking ``XREAD``, as a trainer
  would see it), p50/p99/max.

Every figure is the best of ``--repeats`` runs (throughput: the fastest; latency: the run with the lowest
p99). With ``--redis-url`` everything lives under ``--namespace`` (see :mod:`sink_tools.bench`). Targets: p99 at
most :data:`MAX_LATENCY_P99_MS`, one assembler at least :data:`MIN_ROLLOUTS_PER_S`.
"""

from __future__ import annotations

import argparse
import hashlib
import multiprocessing
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from multiprocessing.context import SpawnProcess
from typing import Any

import anyio
import redis.asyncio as aioredis

from sink.contract.records import CallRecord, CaptureLedgerCommit
from sink.keys import done_stream, receipt_key, receipts_stream
from sink.ledger.redis import RedisCaptureLedger
from sink.rollout.assembler import Assembler, finished
from sink.settings import DEFAULT_SHARDS, AssemblerSettings
from sink_tools.bench import (
    DEFAULT_BENCH_NAMESPACE,
    DEFAULT_REPEATS,
    Target,
    add_common_arguments,
    bench_namespace,
    format_targets,
    percentile_ms,
    progress,
    report_on_server,
)

__all__ = (
    "MAX_LATENCY_P99_MS",
    "MIN_ROLLOUTS_PER_S",
    "AssemblyFigures",
    "assembly_targets",
    "format_report",
    "main",
    "run_assembly_benchmark",
)

MAX_LATENCY_P99_MS = 50.0
"""Target: p99 from ``finished()`` returning to a readable receipt, at the steady rate."""
MIN_ROLLOUTS_PER_S = 200.0
"""Target: receipts per second of one assembler process (32-call rollouts)."""


def _go_key(namespace: str) -> str:
    return f"{namespace}:bench:assembly:go"


def _ready_key(namespace: str) -> str:
    return f"{namespace}:bench:assembly:ready"


@dataclass(frozen=True, slots=True)
class AssemblyFigures:
    """Measured assembly figures."""

    repeats: int
    calls_per_rollout: int
    throughput_rollouts: int
    one_assembler_rollouts_per_s: float
    two_assemblers_rollouts_per_s: float
    latency_rate_per_s: float
    latency_rollouts: int
    latency_p50_ms: float
    latency_p99_ms: float
    latency_max_ms: float


def _hex(*parts: object) -> str:
    return hashlib.sha256("/".join(map(str, parts)).encode()).hexdigest()


def _commits(rollout_id: str, calls: int, tokens: int = 64) -> list[CaptureLedgerCommit]:
    commits, chain = [], []
    for index in range(calls):
        chain.append(f"{rollout_id}/c{index}")
        record = CallRecord(
            model_call_id=f"c{index}",
            parent_call_id=f"c{index - 1}" if index else None,
            prev_len=index * tokens,
            delta_len=tokens,
            cum_len=(index + 1) * tokens,
            weight_version=1,
            digest=_hex(rollout_id, index, "d"),
            extras_digest=_hex("extras"),
            staging_key=chain[-1],
            mode="token_in" if index else "text",
            chain_hash=_hex(rollout_id, index, "chain"),
            cumulative_hash=_hex(rollout_id, index, "cum"),
            response_id=f"resp-{index}",
            admitted_at=float(index),
        )
        commits.append(
            CaptureLedgerCommit(
                rollout_id=rollout_id, record=record, staging_chain=tuple(chain), request_items=[], response_items=[]
            )
        )
    return commits


async def _record_ledgers(url: str, namespace: str, rollout_ids: Sequence[str], calls: int) -> None:
    limiter = anyio.CapacityLimiter(64)
    ledgers = RedisCaptureLedger.from_url(url, namespace=namespace)
    async with ledgers as ledger, anyio.create_task_group() as group:

        async def record(commit: CaptureLedgerCommit) -> None:
            async with limiter:
                await ledger.record(commit)

        for rollout_id in rollout_ids:
            for commit in _commits(rollout_id, calls):
                group.start_soon(record, commit)


def _assembler_process(url: str, settings_json: str) -> None:
    """One assembler in its own interpreter: open (group exists), wait for the start signal, run until SIGTERM."""
    from sink.rollout.assembler import run_assembler

    async def body() -> None:
        settings = AssemblerSettings.model_validate_json(settings_json)
        async with aioredis.Redis.from_url(url) as client:
            await client.rpush(_ready_key(settings.namespace), "ready")
            await client.blpop([_go_key(settings.namespace)], timeout=0)
        await run_assembler(url, settings)

    anyio.run(body)


async def _await_receipts(client: aioredis.Redis, namespace: str, count: int) -> dict[str, float]:
    """Block on the receipts streams until *count* receipts arrived; return arrival times by rollout id."""
    cursors: dict[Any, Any] = {receipts_stream(namespace, k).encode(): b"0" for k in range(DEFAULT_SHARDS)}
    arrived: dict[str, float] = {}
    while len(arrived) < count:
        reply: Any = await client.xread(cursors, block=5_000)
        if not reply:
            raise RuntimeError(f"no receipt for 5 s ({len(arrived)} of {count} arrived)")
        now = time.perf_counter()
        for stream, entries in reply:
            for entry_id, fields in entries:
                cursors[stream] = entry_id
                arrived.setdefault(fields[b"rollout_id"].decode(), now)
    return arrived


_START_TIMEOUT_S = 60.0


def _start(url: str, processes: int, settings: AssemblerSettings) -> list[SpawnProcess]:
    context = multiprocessing.get_context("spawn")
    started = [
        context.Process(target=_assembler_process, args=(url, settings.model_dump_json()), daemon=True)
        for _ in range(processes)
    ]
    for process in started:
        process.start()
    return started


async def _wait_ready(client: aioredis.Redis, namespace: str, processes: int) -> None:
    # Short blocking pops under any socket timeout the URL sets (a busy machine starts a process slowly).
    deadline = anyio.current_time() + _START_TIMEOUT_S
    ready = 0
    while ready < processes:
        if await client.blpop([_ready_key(namespace)], timeout=0.5) is not None:
            ready += 1
        elif anyio.current_time() > deadline:
            raise RuntimeError(f"an assembler process did not start within {_START_TIMEOUT_S:.0f} s")


def _stop(started: list[SpawnProcess]) -> None:
    for process in started:
        process.terminate()  # SIGTERM: run_assembler stops gracefully
    for process in started:
        process.join(30)
        if process.is_alive():
            process.kill()
            process.join()


async def _reset(client: aioredis.Redis, namespace: str, rollout_ids: Sequence[str]) -> None:
    streams = [done_stream(namespace, k) for k in range(DEFAULT_SHARDS)]
    streams += [receipts_stream(namespace, k) for k in range(DEFAULT_SHARDS)]
    await client.delete(*streams, *(receipt_key(namespace, rollout_id) for rollout_id in rollout_ids))


async def _throughput(url: str, namespace: str, rollout_ids: Sequence[str], processes: int) -> float:
    settings = AssemblerSettings(namespace=namespace, block_ms=200, batch_events=64)
    async with aioredis.Redis.from_url(url) as client:
        await _reset(client, namespace, rollout_ids)
        async with Assembler.from_url(url, settings):
            pass  # creates the consumer groups before events arrive
        for rollout_id in rollout_ids:
            await finished(client, rollout_id, reward=1.0, namespace=namespace)
        started = _start(url, processes, settings)
        try:
            await _wait_ready(client, namespace, processes)  # interpreter start-up is not part of the measurement
            begin = time.perf_counter()
            await client.rpush(_go_key(namespace), *(["go"] * processes))
            arrived = await _await_receipts(client, namespace, len(rollout_ids))
        finally:
            _stop(started)
    return len(rollout_ids) / (max(arrived.values()) - begin)


async def _latency(url: str, namespace: str, rollout_ids: Sequence[str], rate_per_s: float) -> list[float]:
    settings = AssemblerSettings(namespace=namespace, block_ms=1_000, batch_events=64)
    async with aioredis.Redis.from_url(url) as client:
        await _reset(client, namespace, rollout_ids)
        async with Assembler.from_url(url, settings):
            pass
        started = _start(url, 1, settings)
        try:
            await _wait_ready(client, namespace, 1)
            await client.rpush(_go_key(namespace), "go")
            sent: dict[str, float] = {}
            arrived: dict[str, float] = {}
            async with aioredis.Redis.from_url(url) as watcher, anyio.create_task_group() as group:

                async def watch() -> None:
                    arrived.update(await _await_receipts(watcher, namespace, len(rollout_ids)))

                group.start_soon(watch)
                begin = time.perf_counter()
                for index, rollout_id in enumerate(rollout_ids):
                    await anyio.sleep(max(0.0, begin + index / rate_per_s - time.perf_counter()))
                    await finished(client, rollout_id, reward=1.0, namespace=namespace)
                    sent[rollout_id] = time.perf_counter()
        finally:
            _stop(started)
    return [arrived[rollout_id] - sent[rollout_id] for rollout_id in rollout_ids]


async def run_assembly_benchmark(
    url: str,
    *,
    rollouts: int = 400,
    calls: int = 32,
    rate_per_s: float = 100.0,
    latency_s: float = 5.0,
    namespace: str = DEFAULT_BENCH_NAMESPACE,
    repeats: int = DEFAULT_REPEATS,
) -> AssemblyFigures:
    """Run the throughput (1 and 2 assemblers) and steady-rate latency measurements *repeats* times each on
    *url*, in *namespace* only (deleted at the end; a namespace that already has keys is refused).

    :raises BenchmarkNamespaceInUseError: *namespace* already has keys on that server.
    """
    if repeats < 1:
        raise ValueError("repeats must be at least 1")
    throughput_ids = [f"tp-{i}" for i in range(rollouts)]
    latency_ids = [f"lat-{i}" for i in range(int(rate_per_s * latency_s))]
    async with bench_namespace(url, namespace):
        progress(f"assembly: recording {len(throughput_ids) + len(latency_ids)} ledgers of {calls} calls")
        await _record_ledgers(url, namespace, throughput_ids + latency_ids, calls)
        one, two, latency_runs = [], [], []
        for repeat in range(repeats):
            progress(f"assembly: throughput, one assembler, repeat {repeat + 1}/{repeats}")
            one.append(await _throughput(url, namespace, throughput_ids, 1))
            progress(f"assembly: throughput, two assemblers, repeat {repeat + 1}/{repeats}")
            two.append(await _throughput(url, namespace, throughput_ids, 2))
            progress(f"assembly: latency at {rate_per_s:g}/s for {latency_s:g} s, repeat {repeat + 1}/{repeats}")
            latency_runs.append(await _latency(url, namespace, latency_ids, rate_per_s))
    latencies = min(latency_runs, key=lambda run: percentile_ms(run, 0.99))
    return AssemblyFigures(
        repeats=repeats,
        calls_per_rollout=calls,
        throughput_rollouts=rollouts,
        one_assembler_rollouts_per_s=max(one),
        two_assemblers_rollouts_per_s=max(two),
        latency_rate_per_s=rate_per_s,
        latency_rollouts=len(latency_ids),
        latency_p50_ms=percentile_ms(latencies, 0.50),
        latency_p99_ms=percentile_ms(latencies, 0.99),
        latency_max_ms=max(latencies) * 1000.0,
    )


def assembly_targets(figures: AssemblyFigures) -> list[Target]:
    """The documented targets, measured."""
    return [
        Target(
            "one assembler throughput", figures.one_assembler_rollouts_per_s, ">=", MIN_ROLLOUTS_PER_S, "rollouts/s"
        ),
        Target("finished() -> receipt p99", figures.latency_p99_ms, "<=", MAX_LATENCY_P99_MS, "ms"),
    ]


def format_report(figures: AssemblyFigures) -> str:
    """Human-readable summary."""
    f = figures
    return "\n".join(
        [
            (
                f"assembly, {f.calls_per_rollout} calls per rollout, {f.throughput_rollouts} queued rollouts, "
                f"best of {f.repeats} runs:"
            ),
            f"  one assembler process : {f.one_assembler_rollouts_per_s:8.0f} rollouts/s",
            f"  two assembler processes: {f.two_assemblers_rollouts_per_s:8.0f} rollouts/s",
            f"finished() -> receipt readable, steady {f.latency_rate_per_s:.0f} rollouts/s x {f.latency_rollouts}:",
            f"  p50 {f.latency_p50_ms:.2f} ms, p99 {f.latency_p99_ms:.2f} ms, max {f.latency_max_ms:.2f} ms",
            *format_targets(assembly_targets(f)),
        ]
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point: ``python -m sink_tools.bench.assembly [--redis-url URL] [--namespace NS] [--json]``."""
    parser = argparse.ArgumentParser(prog="staging-sink bench assembly", description=__doc__.splitlines()[0])
    add_common_arguments(parser)
    parser.add_argument(
        "--rollouts", type=int, default=400, help="queued rollouts for the throughput runs (default: 400)"
    )
    parser.add_argument("--calls", type=int, default=32, help="ledger rows per rollout (default: 32)")
    parser.add_argument(
        "--rate", type=float, default=100.0, help="finished() rate for the latency run, per s (default: 100)"
    )
    parser.add_argument("--latency-seconds", type=float, default=5.0, help="duration of the latency run (default: 5)")
    args = parser.parse_args(argv)
    if min(args.rollouts, args.calls, args.repeats) < 1 or args.rate <= 0 or args.rate * args.latency_seconds < 1:
        parser.error("--rollouts, --calls, --repeats, --rate and --rate x --latency-seconds must be positive")

    def run(url: str) -> AssemblyFigures:
        return anyio.run(
            lambda: run_assembly_benchmark(
                url,
                rollouts=args.rollouts,
                calls=args.calls,
                rate_per_s=args.rate,
                latency_s=args.latency_seconds,
                namespace=args.namespace,
                repeats=args.repeats,
            )
        )

    return report_on_server(
        args.redis_url, lambda url, _server: run(url), format_report, as_json=args.json, to_json=asdict
    )


if __name__ == "__main__":
    raise SystemExit(main())
