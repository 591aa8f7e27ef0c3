"""Long-running and tooling commands: ``server``, ``assembler``, ``trainer``, ``metrics``, ``acl`` and ``bench``.

Services stop cleanly on SIGINT/SIGTERM. Each function returns the process exit code.
"""

from __future__ import annotations

import importlib
import logging
import sys
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import cast

import anyio
import redis.asyncio as aioredis
import redis.exceptions as redis_errors

from sink.errors import MetricsExtraMissingError, StagingRefusedError
from sink.ops.access.render import (
    ADMIN_ROLE,
    ROLE_NAMES,
    env_file_text,
    generate_passwords,
    render_acl_example,
    render_acl_file,
    write_private_file,
)
from sink.ops.metrics.exporter import Metrics, serve_metrics, serve_process_metrics
from sink.rollout.assembler import run_assembler
from sink.service import OutagePolicy
from sink.settings import AssemblerSettings, ReaderSettings
from sink.store.connection import Topology, describe_redis_error, map_redis_errors
from sink.store.scripts import LIBRARY
from sink.trainer.reader.rollout_reader import PulledRollout, RolloutReader
from sink_cli.common import (
    EXIT_FAILURE,
    EXIT_OK,
    EXIT_USAGE,
    CommandError,
    RedisTarget,
    cancel_on_signal,
    open_topology,
    service_outage_policy,
    stderr_console,
    stdout_console,
)
from sink_cli.stats import shared_stream_names

__all__ = (
    "BENCHMARKS",
    "acl_command",
    "assembler_command",
    "bench_command",
    "metrics_command",
    "setup_command",
    "trainer_command",
)

logger = logging.getLogger(__name__)

BENCHMARKS = ("codec", "stage", "assembly", "trainer", "gym", "ack", "groups", "proxy", "worker")
"""The benchmarks: ``staging-sink bench NAME`` runs ``sink_tools.bench.NAME.main(argv)``."""
_PULL_BLOCK_MS = 1000


def assembler_command(
    target: RedisTarget,
    *,
    shards: int,
    consumer_name: str | None,
    metrics: tuple[int | None, str] = (None, ""),
    outage: OutagePolicy | None = None,
) -> int:
    """``staging-sink assembler``: turn ``done`` events into receipts until SIGINT/SIGTERM.

    *outage*: the policy the command line already waited under (while it asked the server's cluster mode)."""
    settings = AssemblerSettings(
        namespace=target.namespace,
        cluster=target.cluster,
        done_shards=shards,
        receipt_shards=shards,
        consumer_name=consumer_name,
        connect_timeout_s=target.settings().connect_timeout_s,
    )
    stderr_console().print(
        f"assembler on {target.display_url} (namespace {target.namespace}, {shards} shard(s)); Ctrl-C stops it"
    )
    with serve_process_metrics(metrics[0], host=metrics[1], namespace=target.namespace) as exporter:
        if exporter is not None:
            stderr_console().print(f"assembler metrics at {exporter.url}")
        anyio.run(partial(run_assembler, target.url, settings, outage=outage))
    return EXIT_OK


def _rollout_line(pulled: PulledRollout) -> str:
    if pulled.row is not None:
        row = pulled.row
        return (
            f"[green]verified[/] {pulled.rollout_id}: {len(row.token_ids)} tokens over {len(row.model_call_ids)} "
            f"call(s), terminal {pulled.receipt.terminal_model_call_id}, reward {pulled.receipt.reward}"
        )
    if pulled.rows:  # a multi-chain rollout (contract §14): one row per healthy chain
        tokens = sum(len(row.token_ids) for row in pulled.rows)
        skipped = "".join(f"; chain {skip.chain_index} skipped: {skip.skip_code}" for skip in pulled.chain_skips)
        return (
            f"[green]verified[/] {pulled.rollout_id}: {len(pulled.rows)} chain(s), {tokens} tokens, "
            f"reward {pulled.receipt.reward}{skipped}"
        )
    return f"[yellow]skipped[/] {pulled.rollout_id}: {pulled.skip_code} ({pulled.skip_reason})"


async def trainer_command(
    target: RedisTarget,
    *,
    shards: int,
    consumer_name: str | None,
    max_rollouts: int | None,
    timeout_s: float | None,
    batch: int,
    metrics: tuple[int | None, str] = (None, ""),
    max_outage_s: float | None = None,
    outage: OutagePolicy | None = None,
) -> int:
    """``staging-sink trainer``: pull, verify and acknowledge rollouts, one line each, until SIGINT/SIGTERM,
    *max_rollouts* or *timeout_s*, then delete its consumer name from the group (where it owns nothing
    pending). Exit 1 when *max_rollouts* were asked for and fewer arrived in time.

    The server's outages are ridden out while it opens, runs and closes (:class:`~sink.service.OutagePolicy`:
    backoff from ``reconnect_backoff_s`` up to ``reconnect_backoff_max_s``; after *max_outage_s*, default
    :attr:`ReaderSettings.max_outage_s`, it exits 3); a refusal (``WRONGTYPE``, ``NOPERM``) exits 1 at once.
    *outage*: the policy the command line already waited under (while it asked the server's cluster mode)."""
    settings = ReaderSettings(
        namespace=target.namespace,
        cluster=target.cluster,
        receipt_shards=shards,
        consumer_name=consumer_name,
        connect_timeout_s=target.settings().connect_timeout_s,
        **({} if max_outage_s is None else {"max_outage_s": max_outage_s}),
    )
    outage = outage or service_outage_policy(settings, "trainer")
    console = stdout_console()
    seen = verified = 0
    unacked: list[str] = []

    async def open_reader() -> RolloutReader:
        return await RolloutReader.from_url(target.url, settings).__aenter__()

    reader = await outage.call(open_reader, "opening")
    try:
        exporter = serve_process_metrics(metrics[0], host=metrics[1], namespace=target.namespace)
        with exporter as server:
            if server is not None:
                stderr_console().print(f"trainer metrics at {server.url}")
            async with anyio.create_task_group() as group:
                await group.start(cancel_on_signal, group.cancel_scope)
                stderr_console().print(f"trainer {reader.consumer_name} on {target.display_url}; Ctrl-C stops it")

                async def step() -> None:
                    nonlocal seen, verified, unacked
                    if unacked:  # pulled before an outage: acknowledge them first
                        await reader.ack(unacked)
                        unacked = []
                        return
                    wanted = batch if max_rollouts is None else min(batch, max_rollouts - seen)
                    pulled = await reader.pull(wanted, block_ms=_PULL_BLOCK_MS)
                    for rollout in pulled:
                        console.print(_rollout_line(rollout))
                    seen += len(pulled)
                    verified += sum(1 for rollout in pulled if rollout.trainable)
                    unacked = [rollout.rollout_id for rollout in pulled]
                    if unacked:
                        await reader.ack(unacked)
                        unacked = []

                with anyio.move_on_after(timeout_s if timeout_s is not None else float("inf")):
                    while unacked or max_rollouts is None or seen < max_rollouts:
                        await outage.call(step, "running")
                group.cancel_scope.cancel()
        # Leave the group tidy: a consumer name per run would otherwise pile up in `stats`.
        shards_retired = await outage.call(reader.retire_consumer, "closing")
        logger.info("trainer %s: consumer retired on %d shard(s)", reader.consumer_name, shards_retired)
    finally:
        await reader.aclose()
    stderr_console().print(f"trainer: {seen} rollout(s), {verified} verified, {seen - verified} skipped")
    if max_rollouts is not None and seen < max_rollouts:
        stderr_console().print(f"trainer: only {seen} of {max_rollouts} rollout(s) arrived within {timeout_s} s")
        return EXIT_FAILURE
    return EXIT_OK


async def setup_command(target: RedisTarget) -> int:
    """``staging-sink setup``: load the function library (``FUNCTION LOAD REPLACE``) on every primary.

    Run it as an admin once per deployment and after each upgrade; running it again changes nothing. A
    server without functions (Redis 6.2) needs no setup: the scripts run with ``EVALSHA`` there.
    """
    async with open_topology(target) as topology:
        try:
            with map_redis_errors(f"load function library {LIBRARY.name}"):
                await LIBRARY.load(topology.client)
        except StagingRefusedError as exc:
            if exc.code == "ERR" and "unknown command" in str(exc).lower():
                stdout_console().print(f"{target.display_url} has no functions (Redis < 7.0): nothing to set up")
                return EXIT_OK
            if exc.code == "NOPERM":
                raise CommandError(f"{exc}: run setup as an admin user") from exc
            raise
    stdout_console().print(f"function library {LIBRARY.name} loaded on {target.display_url}")
    return EXIT_OK


async def metrics_command(target: RedisTarget, *, port: int, host: str, interval_s: float) -> int:
    """``staging-sink metrics``: serve Prometheus metrics with the Redis stream gauges refreshed every
    *interval_s* seconds, until SIGINT/SIGTERM. A Redis outage (a cluster's failover or slot migration too) is
    counted and logged, never fatal."""
    try:
        # The exporter stages and pulls nothing: it serves what it reads from Redis, no process counter.
        metrics = Metrics(namespace=target.namespace, process_counters=False)
    except MetricsExtraMissingError as exc:
        raise CommandError(str(exc)) from exc
    try:
        exporter = serve_metrics(port, metrics, host=host)
    except OSError as exc:
        raise CommandError(f"cannot serve metrics on {host}:{port}: {exc}") from exc
    topology = Topology.from_url(target.url, target.settings())
    try:
        async with anyio.create_task_group() as group:
            await group.start(cancel_on_signal, group.cancel_scope)
            stdout_console().print(
                f"metrics at {exporter.url} (Redis gauges from {target.display_url}); Ctrl-C stops it"
            )
            while True:
                try:
                    await topology.initialize()
                    names = await shared_stream_names(topology, target.namespace)
                    # The gauges issue only keyed commands, which the cluster client routes.
                    client = cast(aioredis.Redis, topology.client)
                    nodes, primaries = await topology.all_nodes(), topology.primaries()
                    await metrics.refresh(client, target.namespace, streams=names, nodes=nodes, primaries=primaries)
                except (redis_errors.RedisError, redis_errors.RedisClusterException, OSError) as exc:
                    # Counted by refresh (collection_up 0). A failover, a migration or a lost node: the next
                    # collection reads the slot map again.
                    logger.warning("metrics: cannot read the Redis gauges: %s", describe_redis_error(exc))
                    await topology.refresh_quietly()
                await anyio.sleep(interval_s)
    finally:
        exporter.stop()
        with anyio.CancelScope(shield=True):
            await topology.aclose()
    return EXIT_OK


def _parse_passwords(pairs: Sequence[str]) -> dict[str, str]:
    passwords: dict[str, str] = {}
    known = (*ROLE_NAMES, ADMIN_ROLE)
    for pair in pairs:
        role, sep, password = pair.partition("=")
        if not sep or role not in known or not password:
            raise CommandError(
                f"--password takes ROLE=PASSWORD with ROLE one of {', '.join(known)}; got {pair!r}",
                exit_code=EXIT_USAGE,
            )
        passwords[role] = password
    return passwords


def acl_command(
    *,
    namespace: str,
    server_version: str,
    passwords: Sequence[str],
    admin: bool,
    env_file: Path | None,
    example: bool,
) -> int:
    """``staging-sink acl``: print the ACL file for the given passwords (``ROLE=PASSWORD``), generating the
    missing ones. Generated passwords go to *env_file* (mode 0600) or, without it, to stderr as
    ``STG_<ROLE>_PASSWORD=...`` lines; the ACL itself holds only SHA-256 hashes."""
    try:
        if example:
            sys.stdout.write(render_acl_example(namespace=namespace, server_version=server_version))
            return EXIT_OK
        given = _parse_passwords(passwords)
        roles = (*ROLE_NAMES, ADMIN_ROLE) if admin or ADMIN_ROLE in given else ROLE_NAMES
        generated = generate_passwords(role for role in roles if role not in given)
        text = render_acl_file(namespace=namespace, passwords={**generated, **given}, server_version=server_version)
    except ValueError as exc:
        raise CommandError(str(exc), exit_code=EXIT_USAGE) from exc
    sys.stdout.write(text)
    if generated:
        env_lines = env_file_text(generated)
        if env_file is not None:
            write_private_file(env_file, env_lines)
            sys.stderr.write(f"# generated passwords for {', '.join(generated)} written to {env_file}\n")
        else:
            sys.stderr.write("# generated passwords (keep them secret):\n" + env_lines)
    return EXIT_OK


def bench_command(name: str, argv: Sequence[str]) -> int:
    """``staging-sink bench NAME ARGS...``: run ``sink_tools.bench.NAME.main(ARGS)``.

    :raises CommandError: *name* is not a benchmark, or one of its optional dependencies is not installed.
    """
    if name not in BENCHMARKS:
        choices = ", ".join(BENCHMARKS)
        raise CommandError(f"unknown benchmark {name!r}: choose one of {choices}", exit_code=EXIT_USAGE)
    module = f"sink_tools.bench.{name}"
    try:
        main: Callable[[list[str]], int | None] = importlib.import_module(module).main
    except ModuleNotFoundError as exc:
        if exc.name is None or exc.name == module or exc.name.startswith(("sink", "worker")):
            raise
        raise CommandError(f"benchmark {name!r} is not available in this installation ({exc.name} missing)") from exc
    code = main(list(argv))
    return int(code or 0)
