"""``staging-sink bench groups``: what delivering GRPO groups costs the trainer, against plain pulls.

Stages ``--groups`` groups of ``--group-size`` rollouts (``--calls`` calls of ``--tokens`` tokens each, linear
chains), finishes every member (with its ``group_id``, except in ``pull`` mode) and runs an assembler until every
receipt (or group entry) is published. Then, once per mode and best of ``--repeats`` (the staging is redone before
every timed run, outside the timing):

* ``pull``: the same rollouts without groups; one :class:`~sink.trainer.reader.rollout_reader.RolloutReader` pulls
  every rollout (``--pull`` at a time) and acknowledges each pull: the floor of any group delivery (a whole group
  published as one entry still claims, fetches and verifies every member);
* ``groups``: one :class:`~sink.trainer.groups.GroupReader` (``pull_groups`` then ``ack_groups``) until every
  group is delivered: one group entry per group, its members read from the group's record, the record closed;
* ``groups-<R>``: R ranks (R readers, R consumer names) taking turns, each ``pull_groups(--pull)``: each group
  entry goes to one rank, whole.

Reported per mode: the trainer's ms per group and round trips per group (the sends of every redis connection, a
pipeline is one send), rollouts consumed (claimed, fetched and verified) per rollout staged (1.0: every member
once), the assembler's round trips per group (the ``finished`` events and the assembly, outside the trainer's
timing: the group record costs the assembler a script per member and a few writes per group) and the mean
receipts entry (a member's receipt entry in ``pull`` mode, a group entry otherwise).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from contextlib import AsyncExitStack
from dataclasses import asdict, dataclass
from functools import partial
from typing import NamedTuple

import anyio
import redis.asyncio as aioredis

from sink.keys import receipts_stream
from sink.settings import DEFAULT_SHARDS
from sink.trainer.groups import GroupReader, RolloutGroup
from sink.trainer.reader.rollout_reader import RolloutReader
from sink_tools.bench import (
    DEFAULT_BENCH_NAMESPACE,
    DEFAULT_REPEATS,
    BenchHelpFormatter,
    add_common_arguments,
    bench_namespace,
    progress,
    report_on_server,
)
from sink_tools.bench.ack import count_round_trips
from sink_tools.bench.trainer import stage_records
from sink_tools.bench.workload import assemble_receipts, build_records

__all__ = ("GroupFigures", "ModeFigures", "format_report", "main", "run_groups_benchmark")

MODES = ("pull", "groups", "groups-2", "groups-4")
"""The default modes: ``groups-<R>`` is ``groups`` over R ranks taking turns (any R >= 1)."""


_PROMPT_TOKENS = 64
"""The prompt tokens (mask 0) of a rollout's first call in :func:`~sink_tools.bench.workload.build_records`."""


def _ranks(mode: str) -> int | None:
    """The ranks of a mode (``groups``: 1, ``groups-<R>``: R), ``None`` for ``pull`` or an unknown mode."""
    if mode == "groups":
        return 1
    prefix, _, count = mode.partition("-")
    return int(count) if prefix == "groups" and count.isdigit() and int(count) >= 1 else None


@dataclass(frozen=True, slots=True)
class ModeFigures:
    """One delivery mode, its best run: the trainer's ms and round trips per group, rollouts consumed per rollout
    staged, ``consumed_again``: the members consumed more than once (0 when each group goes to one rank, whole),
    the assembler's round trips per group and the mean receipts entry's bytes."""

    mode: str
    ms_per_group: float
    round_trips_per_group: float
    consumed_per_rollout: float
    consumed_again: int
    assembly_round_trips_per_group: float
    entry_bytes: int


@dataclass(frozen=True, slots=True)
class GroupFigures:
    """The workload and one :class:`ModeFigures` per mode."""

    groups: int
    group_size: int
    calls: int
    tokens: int
    pull: int
    modes: tuple[ModeFigures, ...]


async def _deliver_pull(url: str, namespace: str, rollouts: int, pull: int, run: str) -> tuple[float, int, int]:
    async with RolloutReader.from_url(url, namespace=namespace, consumer_name=f"bench-pull-{run}") as reader:
        seen = 0
        with count_round_trips() as sends:
            start = time.perf_counter()
            while seen < rollouts:
                items = await reader.pull(pull, block_ms=200)
                seen += len(items)
                await reader.ack([item.rollout_id for item in items])
            seconds = time.perf_counter() - start
        return seconds, sends.count, reader.statistics().pulled


async def _deliver_groups(
    url: str, namespace: str, groups: int, pull: int, ranks: int, run: str
) -> tuple[float, int, int]:
    async with AsyncExitStack() as stack:
        readers = [
            await stack.enter_async_context(
                RolloutReader.from_url(url, namespace=namespace, consumer_name=f"bench-rank{rank}-{run}")
            )
            for rank in range(ranks)
        ]
        group_readers = [GroupReader(reader) for reader in readers]
        delivered: list[RolloutGroup] = []
        turn = 0
        with count_round_trips() as sends:
            start = time.perf_counter()
            with anyio.fail_after(300):
                while sum(_settled(rank) for rank in group_readers) < groups:
                    rank = group_readers[turn % ranks]
                    turn += 1
                    out = await rank.pull_groups(pull, block_ms=200)
                    delivered += out
                    await rank.ack_groups(out)
            seconds = time.perf_counter() - start
        if len(delivered) != groups or any(not g.complete or len(g.members) != g.group_size for g in delivered):
            raise RuntimeError(f"{groups} groups staged, {len(delivered)} delivered, not every one whole")
        return seconds, sends.count, sum(reader.statistics().pulled for reader in readers)


def _settled(rank: GroupReader) -> int:
    """Groups a rank is done with: delivered, dropped or dead-lettered."""
    statistics = rank.statistics()
    return statistics.delivered + statistics.dropped + statistics.dead_lettered


async def _entry_bytes(url: str, namespace: str, shards: int) -> float:
    """The mean size of a receipts entry (field names and values) over every entry of the receipts streams."""
    sizes: list[int] = []
    async with aioredis.Redis.from_url(url) as client:
        for shard in range(shards):
            entries = await client.xrange(receipts_stream(namespace, shard)) or []
            sizes += [sum(len(k) + len(v) for k, v in (fields or {}).items()) for _entry_id, fields in entries]
    return sum(sizes) / len(sizes) if sizes else 0.0


class _Run(NamedTuple):
    seconds: float
    sends: int
    consumed: int
    assembly_sends: int
    entry_bytes: float


async def _one_run(url: str, namespace: str, mode: str, options: dict[str, int], run: int) -> _Run:
    groups, size, calls = options["groups"], options["group_size"], options["calls"]
    tag = f"{mode.replace('-', '')}r{run}"
    records = build_records(groups * size, calls, options["tokens"], tag=tag)
    await stage_records(url, namespace, records, calls)
    rollout_ids = list(dict.fromkeys(record.rollout_id for record in records))
    with count_round_trips() as assembly:
        await assemble_receipts(url, namespace, rollout_ids, group_size=None if mode == "pull" else size)
    entry_bytes = await _entry_bytes(url, namespace, DEFAULT_SHARDS)
    if mode == "pull":
        delivered = await _deliver_pull(url, namespace, groups * size, options["pull"], tag)
        return _Run(*delivered, assembly.count, entry_bytes)
    ranks = _ranks(mode)
    if ranks is None:
        raise ValueError(f"unknown mode {mode!r}")
    delivered = await _deliver_groups(url, namespace, groups, options["pull"], ranks, tag)
    return _Run(*delivered, assembly.count, entry_bytes)


async def run_groups_benchmark(
    url: str,
    *,
    groups: int = 16,
    group_size: int = 8,
    calls: int = 2,
    tokens: int = 256,
    pull: int = 16,
    repeats: int = DEFAULT_REPEATS,
    namespace: str = DEFAULT_BENCH_NAMESPACE,
    modes: Sequence[str] = MODES,
) -> GroupFigures:
    """Measure on *url*, in *namespace* only (its keys deleted at the end; refused when it already has keys)."""
    options = {"groups": groups, "group_size": group_size, "calls": calls, "tokens": tokens, "pull": pull}
    figures: list[ModeFigures] = []
    async with bench_namespace(url, namespace):
        for mode in modes:
            runs = []
            for run in range(repeats):
                progress(f"{mode}, run {run + 1} of {repeats}")
                runs.append(await _one_run(url, namespace, mode, options, run))
            best = min(runs, key=lambda one: one.seconds)
            figures.append(
                ModeFigures(
                    mode=mode,
                    ms_per_group=best.seconds * 1e3 / groups,
                    round_trips_per_group=best.sends / groups,
                    consumed_per_rollout=best.consumed / (groups * group_size),
                    consumed_again=best.consumed - groups * group_size,
                    assembly_round_trips_per_group=best.assembly_sends / groups,
                    entry_bytes=round(best.entry_bytes),
                )
            )
    return GroupFigures(groups, group_size, calls, tokens, pull, tuple(figures))


def format_report(figures: GroupFigures) -> str:
    f = figures
    head = f"{f.groups} groups of {f.group_size} rollouts ({f.calls} calls x {f.tokens} tokens), pulls of {f.pull}"
    columns = (
        f"{'mode':<10} {'ms/group':>9} {'round trips/group':>18} {'consumed/rollout':>17} {'again':>6} "
        f"{'assembler trips/group':>22} {'entry bytes':>12}"
    )
    rows = [
        f"{m.mode:<10} {m.ms_per_group:>9.2f} {m.round_trips_per_group:>18.1f} "
        f"{m.consumed_per_rollout:>17.2f} {m.consumed_again:>6} {m.assembly_round_trips_per_group:>22.1f} "
        f"{m.entry_bytes:>12,}"
        for m in f.modes
    ]
    return "\n".join([head, "best run per mode:", columns, *rows])


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point: ``python -m sink_tools.bench.groups [--groups N] [--group-size N] [--redis-url URL]``."""
    parser = argparse.ArgumentParser(
        prog="staging-sink bench groups", description=__doc__.splitlines()[0], formatter_class=BenchHelpFormatter
    )
    add_common_arguments(parser)
    parser.add_argument("--groups", type=int, default=16, help="groups per run")
    parser.add_argument("--group-size", type=int, default=8, help="rollouts per group")
    parser.add_argument("--calls", type=int, default=2, help="calls per rollout")
    parser.add_argument("--tokens", type=int, default=256, help="tokens per call (more than 64: the prompt's)")
    parser.add_argument("--pull", type=int, default=16, help="rollouts per pull")
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated modes: pull, groups, groups-<R>")
    args = parser.parse_args(argv)
    modes = [mode for mode in args.modes.split(",") if mode]
    if min(args.groups, args.group_size, args.calls, args.tokens, args.pull, args.repeats) < 1:
        parser.error("--groups, --group-size, --calls, --tokens, --pull and --repeats must be positive")
    if args.tokens <= _PROMPT_TOKENS:
        parser.error(
            f"--tokens must exceed {_PROMPT_TOKENS} (a rollout's first call starts with that many prompt tokens)"
        )
    if not modes or any(mode != "pull" and _ranks(mode) is None for mode in modes):
        parser.error("--modes: pull, groups or groups-<R> (R ranks)")

    def run(url: str, _server: object) -> GroupFigures:
        options = {
            "groups": args.groups,
            "group_size": args.group_size,
            "calls": args.calls,
            "tokens": args.tokens,
            "pull": args.pull,
            "repeats": args.repeats,
            "namespace": args.namespace,
            "modes": modes,
        }
        return anyio.run(partial(run_groups_benchmark, url, **options))

    return report_on_server(args.redis_url, run, format_report, as_json=args.json, to_json=asdict)


if __name__ == "__main__":
    raise SystemExit(main())
