"""``staging-sink bench ack``: the time and the round trips of one ``RolloutReader.ack`` of k pulled rollouts.

Stages ``--rollouts`` rollouts of ``--calls`` calls each (ledger rows, ``finished`` events, receipts), and one
more, pulls them with one reader, acknowledges the one more (so every connection is open), then times one
``reader.ack(the others)`` and counts its round trips: the sends of every
redis connection during the call (a pipeline is one send). The best of ``--repeats`` is reported. Acknowledging
is batched per node (:mod:`sink.store.batch`), so the round trips do not grow with the rollouts.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any

import anyio
from redis.asyncio.connection import AbstractConnection

from sink.trainer.reader.rollout_reader import RolloutReader
from sink_tools.bench import (
    DEFAULT_BENCH_NAMESPACE,
    DEFAULT_REPEATS,
    add_common_arguments,
    bench_namespace,
    report_on_server,
)
from sink_tools.bench.trainer import stage_and_assemble
from sink_tools.bench.workload import build_records

__all__ = ("AckFigures", "RoundTrips", "count_round_trips", "format_report", "main", "run_ack_benchmark")


@dataclass(frozen=True, slots=True)
class AckFigures:
    """One ``ack`` of ``rollouts`` rollouts (``calls`` calls each): its round trips and its time (the best run)."""

    rollouts: int
    calls: int
    round_trips: int
    ack_ms: float


@dataclass(slots=True)
class RoundTrips:
    """Sends counted by :func:`count_round_trips` so far."""

    count: int = 0


@contextmanager
def count_round_trips() -> Iterator[RoundTrips]:
    """Count every send of every ``redis.asyncio`` connection in the block (one per command or pipeline)."""
    original = AbstractConnection.send_packed_command
    sends = RoundTrips()

    async def counted(self: AbstractConnection, command: Any, check_health: bool = True) -> None:
        sends.count += 1
        await original(self, command, check_health)

    AbstractConnection.send_packed_command = counted  # type: ignore[method-assign]
    try:
        yield sends
    finally:
        AbstractConnection.send_packed_command = original  # type: ignore[method-assign]


async def _one_ack(url: str, namespace: str, rollouts: int, calls: int, run: int) -> tuple[int, float]:
    records = build_records(rollouts + 1, calls, 64, tag=f"ack{run}")
    await stage_and_assemble(url, namespace, records, calls)
    async with RolloutReader.from_url(url, namespace=namespace, consumer_name=f"bench-ack-{run}") as reader:
        pulled: list[str] = []
        with anyio.fail_after(120):
            while len(pulled) < rollouts + 1:
                pulled += [item.rollout_id for item in await reader.pull(rollouts + 1, block_ms=1_000)]
        await reader.ack(pulled[:1])  # the connections are open and the script mode is known before counting
        with count_round_trips() as sends:
            start = time.perf_counter()
            outcome = await reader.ack(pulled[1:])
            seconds = time.perf_counter() - start
        if len(outcome.removed) != rollouts:
            raise RuntimeError(f"ack removed {len(outcome.removed)} of {rollouts} ledgers")
        return sends.count, seconds


async def run_ack_benchmark(
    url: str,
    *,
    rollouts: int = 64,
    calls: int = 4,
    repeats: int = DEFAULT_REPEATS,
    namespace: str = DEFAULT_BENCH_NAMESPACE,
) -> AckFigures:
    """Measure on *url*, in *namespace* only (its keys deleted at the end; refused when it already has keys)."""
    async with bench_namespace(url, namespace):
        runs = [await _one_ack(url, namespace, rollouts, calls, run) for run in range(repeats)]
    round_trips, seconds = min(runs, key=lambda run: run[1])
    return AckFigures(rollouts=rollouts, calls=calls, round_trips=round_trips, ack_ms=seconds * 1e3)


def format_report(figures: AckFigures) -> str:
    return (
        f"ack of {figures.rollouts} rollouts ({figures.calls} calls each): "
        f"{figures.round_trips} round trips, {figures.ack_ms:.2f} ms (best of the repeats)"
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point: ``python -m sink_tools.bench.ack [--rollouts N] [--calls N] [--redis-url URL]``."""
    parser = argparse.ArgumentParser(prog="staging-sink bench ack", description=__doc__.splitlines()[0])
    add_common_arguments(parser)
    parser.add_argument("--rollouts", type=int, default=64, help="rollouts acknowledged by the one ack (default: 64)")
    parser.add_argument("--calls", type=int, default=4, help="calls per rollout (default: 4)")
    args = parser.parse_args(argv)
    if min(args.rollouts, args.calls, args.repeats) < 1:
        parser.error("--rollouts, --calls and --repeats must be positive")

    def run(url: str, _server: object) -> AckFigures:
        options = {"rollouts": args.rollouts, "calls": args.calls, "repeats": args.repeats, "namespace": args.namespace}
        return anyio.run(partial(run_ack_benchmark, url, **options))

    return report_on_server(args.redis_url, run, format_report, as_json=args.json, to_json=asdict)


if __name__ == "__main__":
    raise SystemExit(main())
