"""The demo's simulated RL step, end to end, on a durable server (``staging-sink demo``: :mod:`sink_cli.demo`).

Worker processes (``multiprocessing``, spawn) play gate and inference worker for their share of the
rollouts (:mod:`sink_tools.demo.worker_process`, started by :mod:`sink_tools.demo.worker_pool`); this process
runs the receipt :class:`~sink.rollout.assembler.Assembler` and a trainer :class:`~sink.trainer.reader.rollout_reader.RolloutReader`
that pulls, verifies and acknowledges every rollout, all in one anyio task group under a deadline, with
live progress on stderr and a summary on stdout. A few rollouts get an injected capture failure on
purpose: they must come back skipped, with their reason, and every other rollout must verify. That is
the exit status: 0 only if exactly that happened.
"""

from __future__ import annotations

import random
import signal
import time
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import Any

import anyio

from sink.keys import calls_stream
from sink.rollout.assembler import Assembler
from sink.settings import DEFAULT_SHARDS, AssemblerSettings, ReaderSettings
from sink.store.connection import Topology, map_redis_errors
from sink.store.durability import verify_durability
from sink.trainer.reader.rollout_reader import RolloutReader
from sink_cli.common import CommandError, RedisTarget, open_topology, stderr_console
from sink_tools.demo.report import DemoTally, live_progress, show_progress
from sink_tools.demo.worker_pool import WorkerPool
from sink_tools.demo.worker_process import RolloutPlan, WorkerConfig
from worker.errors import WorkersFailedError

__all__ = ("DemoOptions", "make_plans", "run_demo")

_PULL_BLOCK_MS = 200
_PULL_BATCH = 32
_RETRY_PROBABILITY = 0.15
_BRANCH_PROBABILITY = 0.15


@dataclass(frozen=True, slots=True)
class DemoOptions:
    """The demo's knobs (see ``staging-sink demo --help``)."""

    rollouts: int = 24
    turns: int = 6
    tokens: int = 48
    workers: int = 2
    concurrency: int = 8
    seed: int = 0
    inject_failures: int = 2
    shards: int = DEFAULT_SHARDS
    timeout_s: float = 120.0
    role: str = "all"
    redis_url: str | None = None
    gate_redis_url: str | None = None
    namespace: str | None = None
    cluster: bool = False
    server_binary: str | None = None
    as_json: bool = False


def make_plans(options: DemoOptions, run_id: str) -> list[RolloutPlan]:
    """The deterministic (for a seed) plan of every rollout: retries, abandoned branches, injected failures."""
    rng = random.Random(options.seed)
    injected = set(rng.sample(range(options.rollouts), min(options.inject_failures, options.rollouts)))
    plans = []
    for index in range(options.rollouts):
        retries = tuple(turn for turn in range(options.turns) if rng.random() < _RETRY_PROBABILITY)
        branches = tuple(turn for turn in range(1, options.turns) if rng.random() < _BRANCH_PROBABILITY)
        fail_turn = (rng.randrange(1, options.turns) if options.turns > 1 else 0) if index in injected else None
        plans.append(
            RolloutPlan(
                rollout_id=f"demo-{run_id}-{index:04d}",
                turns=options.turns,
                seed=rng.randrange(2**31),
                retry_turns=retries,
                branch_turns=branches,
                fail_turn=fail_turn,
                reward=round(rng.random(), 3),
            )
        )
    return plans


async def _record_bytes(topology: Topology, namespace: str, rollout_id: str) -> int:
    stream = calls_stream(namespace, rollout_id)
    with map_redis_errors(f"read the calls of {rollout_id!r}"):
        entries: Any = await topology.client.xrange(stream)
    return sum(int(fields.get(b"bytes", fields.get("bytes", 0))) for _entry_id, fields in entries or [])


async def _train(reader: RolloutReader, topology: Topology, namespace: str, prefix: str, tally: DemoTally) -> None:
    """Pull, verify (inside ``pull``) and acknowledge until every rollout of this run came back."""
    while tally.pulled < tally.rollouts:
        pulled = await reader.pull(_PULL_BATCH, block_ms=_PULL_BLOCK_MS)
        ours = [rollout for rollout in pulled if rollout.rollout_id.startswith(prefix)]
        for rollout in ours:
            tally.record_bytes += await _record_bytes(topology, namespace, rollout.rollout_id)
            if rollout.rows:  # one row, or one per chain of a multi-chain rollout
                tally.verified[rollout.rollout_id] = sum(len(row.token_ids) for row in rollout.rows)
            else:
                tally.skipped[rollout.rollout_id] = (str(rollout.skip_code), str(rollout.skip_reason))
        if ours:
            await reader.ack([rollout.rollout_id for rollout in ours])  # another job's rollouts stay pending


async def _interrupt_on_signal(work: anyio.CancelScope, tally: DemoTally, stop: anyio.Event) -> None:
    """Until *stop*: on SIGINT/SIGTERM record the interruption and cancel *work* (the summary still prints)."""
    async with anyio.create_task_group() as group:

        async def watch() -> None:
            with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                async for signum in signals:
                    tally.errors.append(f"interrupted by {signal.Signals(signum).name}")
                    work.cancel()
                    return

        group.start_soon(watch)
        await stop.wait()
        group.cancel_scope.cancel()


def _worker_configs(options: DemoOptions, url: str, namespace: str, plans: list[RolloutPlan]) -> list[WorkerConfig]:
    return [
        WorkerConfig(
            index=index,
            url=url,
            gate_url=options.gate_redis_url or url,
            namespace=namespace,
            cluster=options.cluster,
            shards=options.shards,
            max_tokens=options.tokens,
            concurrency=options.concurrency,
            plans=tuple(plans[index :: options.workers]),
        )
        for index in range(min(options.workers, len(plans)))
    ]


async def run_demo(options: DemoOptions, url: str, namespace: str, tally: DemoTally, *, run_id: str) -> None:
    """Run the workers (and, for role ``all``, the assembler and the trainer loop) until done or the deadline.

    Outcomes land in *tally*; a deadline or a failed worker is recorded in ``tally.errors``.

    :raises CommandError: the server is not durable.
    :raises StagingConnectionError: the server cannot be reached.
    """
    target = RedisTarget(url, namespace, options.cluster)
    async with open_topology(target) as topology, AsyncExitStack() as stack:
        with map_redis_errors(f"verify the durability of {target.display_url}"):
            report = await verify_durability(await topology.all_nodes())
        if report.problem is not None:
            raise CommandError(f"{report.problem}; the demo stages only to a durable server")
        tally.durable = "appendfsync always verified" + (
            ", WAITAOF confirms every batch" if report.supports_waitaof else ""
        )
        assembler: Assembler | None = None
        reader: RolloutReader | None = None
        common: dict[str, Any] = {"namespace": namespace, "cluster": options.cluster, "consumer_name": f"demo-{run_id}"}
        if options.role == "all":
            assembler = await stack.enter_async_context(
                Assembler.from_url(
                    url,
                    AssemblerSettings(
                        **common,
                        done_shards=options.shards,
                        receipt_shards=options.shards,
                        block_ms=_PULL_BLOCK_MS,
                        shutdown_grace_s=2.0,
                    ),
                )
            )
            reader = await stack.enter_async_context(
                RolloutReader.from_url(url, ReaderSettings(**common, receipt_shards=options.shards))
            )
        plans = make_plans(options, run_id)
        started = time.perf_counter()
        workers = WorkerPool(_worker_configs(options, url, namespace, plans))
        workers.start()
        stop = anyio.Event()
        try:
            with live_progress(tally, stderr_console()) as progress, anyio.fail_after(options.timeout_s):
                async with anyio.create_task_group() as group:
                    if assembler is not None:
                        group.start_soon(assembler.run)
                    group.start_soon(show_progress, progress, tally, assembler, stop)
                    try:
                        with anyio.CancelScope() as work_scope:
                            group.start_soon(_interrupt_on_signal, work_scope, tally, stop)
                            async with anyio.create_task_group() as work:
                                work.start_soon(workers.supervise, tally)
                                if reader is not None:
                                    work.start_soon(_train, reader, topology, namespace, f"demo-{run_id}-", tally)
                    finally:
                        stop.set()
                        if assembler is not None:
                            assembler.stop()
        except* WorkersFailedError:
            pass
        except* TimeoutError:
            tally.errors.append(f"the demo did not finish within --timeout-s {options.timeout_s:g}")
        finally:
            tally.elapsed_s = time.perf_counter() - started
            workers.stop(tally)
        if reader is not None:
            await reader.retire_consumer()  # only where it holds nothing pending
        if assembler is not None:
            tally.receipts = assembler.statistics().published
            if assembler.statistics().failures:
                tally.errors.append(f"the assembler failed {assembler.statistics().failures} time(s) (see its log)")
        tally.memory_peak_bytes = 0
        with map_redis_errors("read INFO memory"):
            for node in topology.primaries():
                tally.memory_peak_bytes += int((await node.info("memory")).get("used_memory_peak", 0))
