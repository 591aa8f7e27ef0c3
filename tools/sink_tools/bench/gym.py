"""Benchmark: the NeMo Gym transport (``sink.gym``) against a node-local append+fsync JSONL store.

Run ``staging-sink bench gym`` (or ``python -m sink_tools.bench.gym``). Side by side in one run, on the same disk:

* ``redis``: :class:`~sink.gym.RedisTokenSink` / :class:`~sink.gym.RedisTokenSource` on a durable server
  (a private one unless ``--redis-url``; then only keys under ``--namespace`` are written and deleted);
* ``jsonl``: the floor, shaped like Gym's own file store (``nemo_gym`` is not needed): per rollout one JSONL
  file and one lock file; a put serializes the entry (``model_dump_json``), takes the rollout's ``flock``,
  appends one line and ``fsync`` s, on the default thread pool; a freeze reads and validates every line
  (entries unique per call id); a drop unlinks the files and fsyncs the directory.

Entries carry 2,048 generated tokens (float32-exact log-probs, as an engine reports them) and 64 prompt
tokens. Figures: puts/s and p50/p99 put latency with 1 and 16 concurrent tasks, into one rollout and across
many; freeze of an 8-entry and a 400-entry rollout; drop. Each figure is the best of ``--repeats`` runs.
Targets: at 16 tasks at least :data:`MIN_PUT_RATIO` x the floor's puts/s and a p99 below
:data:`MAX_P99_RATIO` of the floor's; a 400-entry freeze under :data:`MAX_FREEZE_400_MS` ms.
"""

from __future__ import annotations

import argparse
import asyncio
import fcntl
import os
import shutil
import tempfile
import time
from array import array
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

from sink.gym import LocalTokenEntry, RedisTokenSink, RedisTokenSource
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

__all__ = (
    "MAX_FREEZE_400_MS",
    "MAX_P99_RATIO",
    "MIN_PUT_RATIO",
    "JsonlFloorStore",
    "format_report",
    "gym_targets",
    "main",
    "run_gym_benchmark",
)

MIN_PUT_RATIO = 3.0
"""Target: at 16 concurrent tasks, the transport's puts/s at least this many times the floor's."""
MAX_P99_RATIO = 1 / 3
"""Target: at 16 concurrent tasks, the transport's p99 put latency at most this share of the floor's."""
MAX_FREEZE_400_MS = 25.0
"""Target: a freeze of a 400-entry rollout in at most this many milliseconds."""
_PROMPT_TOKENS = 64
_TOKENS = 2048


def _entry(rollout_id: str, call_id: str, salt: int) -> LocalTokenEntry:
    ids = [(salt * 7919 + i * 31) % 150_000 for i in range(_TOKENS)]
    return LocalTokenEntry(
        rollout_id=rollout_id,
        model_call_id=call_id,
        model="policy",
        prompt_token_ids=[(salt + i) % 150_000 for i in range(_PROMPT_TOKENS)],
        generation_token_ids=ids,
        generation_log_probs=[-((i % 97) + 1) / 64.0 for i in range(_TOKENS)],
        output_items=[{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "ok"}]}],
        token_item_index=0,
        created_at=1_700_000_000.0 + salt,
    )


def _entries(tag: str, count: int, rollouts: int) -> list[LocalTokenEntry]:
    return [_entry(f"{tag}-{i % rollouts}", f"c{i}", i) for i in range(count)]


class JsonlFloorStore:
    """The floor: an append+fsync JSONL store shaped like Gym's node-local file store (see the module)."""

    def __init__(self, root: Path) -> None:
        self._root = root

    def _paths(self, rollout_id: str) -> tuple[Path, Path]:
        return self._root / f"{rollout_id}.jsonl", self._root / f"{rollout_id}.lock"

    def _put(self, entry: LocalTokenEntry) -> None:
        line = entry.model_dump_json().encode() + b"\n"
        data, lock = self._paths(entry.rollout_id)
        with open(lock, "a") as lock_file:
            fcntl.flock(lock_file, fcntl.LOCK_EX)
            with open(data, "ab") as handle:
                handle.write(line)
                handle.flush()
                os.fsync(handle.fileno())

    def _freeze(self, rollout_id: str) -> tuple[LocalTokenEntry, ...]:
        data, lock = self._paths(rollout_id)
        with open(lock, "a") as lock_file:
            fcntl.flock(lock_file, fcntl.LOCK_SH)
            lines = data.read_bytes().splitlines() if data.exists() else []
        entries: dict[str, LocalTokenEntry] = {}
        for line in lines:
            entry = LocalTokenEntry.model_validate_json(line)
            entries[entry.model_call_id] = entry
        return tuple(entries.values())

    def _drop(self, rollout_id: str) -> None:
        for path in self._paths(rollout_id):
            path.unlink(missing_ok=True)
        directory = os.open(self._root, os.O_RDONLY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)

    async def put(self, entry: LocalTokenEntry) -> None:
        await asyncio.to_thread(self._put, entry)

    async def freeze(self, rollout_id: str) -> tuple[LocalTokenEntry, ...]:
        return await asyncio.to_thread(self._freeze, rollout_id)

    async def drop(self, rollout_id: str) -> None:
        await asyncio.to_thread(self._drop, rollout_id)


def _empty(directory: Path) -> None:
    for path in directory.iterdir():
        path.unlink()


async def _drive(
    items: Sequence[LocalTokenEntry], tasks: int, put: Callable[[Any], Awaitable[None]]
) -> dict[str, float]:
    elapsed, latencies = await drive(items, tasks, put)
    return {
        "puts_per_s": len(latencies) / elapsed,
        "p50_ms": percentile_ms(latencies, 0.5),
        "p99_ms": percentile_ms(latencies, 0.99),
    }


class _Systems:
    """The two systems under test, with the same three operations."""

    def __init__(self, url: str, namespace: str, root: Path) -> None:
        self.sink = RedisTokenSink(redis_url=url, namespace=namespace)
        self.source = RedisTokenSource(redis_url=url, namespace=namespace)
        self.floor = JsonlFloorStore(root)

    def put(self, system: str) -> Callable[[Any], Awaitable[None]]:
        return self.sink.put if system == "redis" else self.floor.put

    async def freeze(self, system: str, rollout_id: str) -> tuple[int, Any]:
        if system == "redis":
            snapshot = await self.source.freeze(rollout_id)
            return len(snapshot.entries), snapshot
        entries = await self.floor.freeze(rollout_id)
        return len(entries), None

    async def drop(self, system: str, rollout_id: str, snapshot: Any) -> None:
        if system == "redis":
            if not await self.source.drop(rollout_id, snapshot_id=snapshot.snapshot_id, version=snapshot.version):
                raise RuntimeError(f"benchmark drop of {rollout_id} was refused")
        else:
            await self.floor.drop(rollout_id)

    async def close(self) -> None:
        await self.sink.close()
        await self.source.close()


_PUT_CONFIGS = (("one rollout", 1, 1), ("one rollout", 16, 1), ("many rollouts", 1, 64), ("many rollouts", 16, 64))


async def _bench_puts(
    systems: _Systems, puts: int, repeats: int, reset: Callable[[], Awaitable[None]]
) -> list[dict[str, Any]]:
    rows = []
    for config, (shape, tasks, rollouts) in enumerate(_PUT_CONFIGS):
        for system in ("jsonl", "redis"):
            runs = []
            for repeat in range(repeats):
                await reset()
                progress(f"gym: put {shape} x{tasks} {system}, repeat {repeat + 1}/{repeats}")
                items = _entries(f"p{config}r{repeat}{system[0]}", puts, rollouts)
                runs.append(await _drive(items, tasks, systems.put(system)))
            best = max(runs, key=lambda run: run["puts_per_s"])
            rows.append({"system": system, "shape": shape, "tasks": tasks, "puts": puts, **best})
    return rows


async def _bench_lifecycle(
    systems: _Systems, repeats: int, reset: Callable[[], Awaitable[None]]
) -> list[dict[str, Any]]:
    rows = []
    for size in (8, 400):
        for system in ("jsonl", "redis"):
            freeze_ms, drop_ms = [], []
            for repeat in range(repeats):
                await reset()
                progress(f"gym: freeze/drop of {size} entries, {system}, repeat {repeat + 1}/{repeats}")
                rollout_id = f"f{size}r{repeat}{system[0]}"
                await _drive(_entries(rollout_id, size, 1), 16, systems.put(system))
                start = time.perf_counter()
                count, snapshot = await systems.freeze(system, f"{rollout_id}-0")
                freeze_ms.append((time.perf_counter() - start) * 1000)
                if count != size:
                    raise RuntimeError(f"benchmark freeze found {count} entries, expected {size}")
                start = time.perf_counter()
                await systems.drop(system, f"{rollout_id}-0", snapshot)
                drop_ms.append((time.perf_counter() - start) * 1000)
            rows.append({"system": system, "entries": size, "freeze_ms": min(freeze_ms), "drop_ms": min(drop_ms)})
    return rows


async def run_gym_benchmark(
    url: str, *, puts: int = 400, repeats: int = DEFAULT_REPEATS, namespace: str = DEFAULT_BENCH_NAMESPACE
) -> dict[str, Any]:
    """Every figure, best of *repeats*, on the server at *url* (only keys of *namespace*, deleted at the end)
    and in a temporary directory (the floor's files, deleted at the end).

    :raises BenchmarkNamespaceInUseError: *namespace* already has keys on that server.
    """
    if repeats < 1 or puts < 1:
        raise ValueError("repeats and puts must be at least 1")
    root = Path(tempfile.mkdtemp(prefix="stg-bench-gym-"))
    try:
        async with bench_namespace(url, namespace) as space:
            systems = _Systems(url, namespace, root)

            async def reset() -> None:
                """Every run starts empty: the namespace's keys and the floor's files deleted."""
                await space.clear()
                await asyncio.to_thread(_empty, root)

            try:
                for system in ("jsonl", "redis"):  # connect, verify durability, load the scripts: not timed
                    await systems.put(system)(_entry(f"warmup-{system}", "c0", 0))
                put_rows = await _bench_puts(systems, puts, repeats, reset)
                lifecycle_rows = await _bench_lifecycle(systems, repeats, reset)
            finally:
                await systems.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return {
        "repeats": repeats,
        "floor_dir": str(root.parent),
        "put": put_rows,
        "lifecycle": lifecycle_rows,
        "lists_400_ms": _lists_floor_ms(400, repeats),
    }


def _lists_floor_ms(size: int, repeats: int) -> float:
    """What any transport pays to hand *size* entries back as ``TokenEntry`` lists: the three token lists of
    each built from packed arrays, nothing else (no I/O, no parsing), best of *repeats*."""
    entry = _entry("lists", "c0", 1)
    packed: list[array[Any]] = [
        array("I", entry.prompt_token_ids),
        array("I", entry.generation_token_ids),
        array("f", entry.generation_log_probs),
    ]
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        built = [[column.tolist() for column in packed] for _ in range(size)]
        times.append(time.perf_counter() - start)
        del built
    return min(times) * 1000


def gym_targets(report: dict[str, Any]) -> list[Target]:
    """The documented targets, measured."""
    targets = []
    rows = report["put"]
    for floor, redis_row in zip(rows[0::2], rows[1::2], strict=True):
        if redis_row["tasks"] < 16:
            continue
        label = f"{redis_row['shape']} x{redis_row['tasks']}"
        targets.append(
            Target(
                f"puts/s redis/jsonl, {label}", redis_row["puts_per_s"] / floor["puts_per_s"], ">=", MIN_PUT_RATIO, "x"
            )
        )
        targets.append(
            Target(f"p99 put redis/jsonl, {label}", redis_row["p99_ms"] / floor["p99_ms"], "<=", MAX_P99_RATIO, "x")
        )
    freeze_400 = next(r for r in report["lifecycle"] if r["system"] == "redis" and r["entries"] == 400)
    targets.append(Target("freeze of 400 entries", freeze_400["freeze_ms"], "<=", MAX_FREEZE_400_MS, "ms"))
    return targets


def format_report(report: dict[str, Any]) -> str:
    """A table of both systems side by side, the ratios, and the targets."""
    lines = [
        f"best of {report['repeats']} runs; entries of {_TOKENS} generated + {_PROMPT_TOKENS} prompt tokens",
        f"{'put':<14} {'tasks':>5} {'system':>6} {'puts/s':>8} {'p50 ms':>8} {'p99 ms':>8}",
    ]
    rows = report["put"]
    lines += [
        f"{r['shape']:<14} {r['tasks']:>5} {r['system']:>6} {r['puts_per_s']:>8.0f} {r['p50_ms']:>8.2f} {r['p99_ms']:>8.2f}"
        for r in rows
    ]
    for floor, redis_row in zip(rows[0::2], rows[1::2], strict=True):
        lines.append(
            f"  {redis_row['shape']} x{redis_row['tasks']}: puts/s redis/jsonl "
            f"{redis_row['puts_per_s'] / floor['puts_per_s']:.2f}, p99 redis/jsonl {redis_row['p99_ms'] / floor['p99_ms']:.2f}"
        )
    lines.append(f"{'lifecycle':<14} {'size':>5} {'system':>6} {'freeze ms':>10} {'drop ms':>8}")
    lines += [
        f"{'':<14} {r['entries']:>5} {r['system']:>6} {r['freeze_ms']:>10.2f} {r['drop_ms']:>8.2f}"
        for r in report["lifecycle"]
    ]
    lines.append(
        f"floor of any 400-entry freeze that returns lists: building the token lists alone takes "
        f"{report['lists_400_ms']:.2f} ms here"
    )
    lines.extend(format_targets(gym_targets(report)))
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point: ``python -m sink_tools.bench.gym [--redis-url URL] [--namespace NS] [--json]``."""
    parser = argparse.ArgumentParser(prog="staging-sink bench gym", description=__doc__.splitlines()[0])
    add_common_arguments(parser)
    parser.add_argument("--puts", type=int, default=400, help="puts per put configuration (default: 400)")
    args = parser.parse_args(argv)
    if min(args.puts, args.repeats) < 1:
        parser.error("--puts and --repeats must be positive")

    def run(url: str) -> dict[str, Any]:
        return asyncio.run(run_gym_benchmark(url, puts=args.puts, repeats=args.repeats, namespace=args.namespace))

    return report_on_server(args.redis_url, lambda url, _server: run(url), format_report, as_json=args.json)


if __name__ == "__main__":
    raise SystemExit(main())
