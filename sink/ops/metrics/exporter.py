"""Prometheus metrics of the staging pipeline: counters that move, and gauges of the Redis side.

:class:`Metrics` keeps its collectors in its own ``CollectorRegistry`` (never the global one), so several
services or tests in one process do not clash. It exports:

* the counters of :mod:`sink.store.pipeline_counters` (what this process's sink, assembler, consumer groups and
  trainer readers did), read at scrape time: ``staging_sink_stages_total{namespace,result}``,
  ``staging_sink_stage_latency_seconds`` (histogram), ``staging_sink_staged_bytes_total``,
  ``staging_sink_receipts_published_total{namespace,shard}``, ``staging_sink_dead_letters_total{namespace,role,shard}``,
  ``staging_sink_rollouts_pulled_total{namespace,outcome}``, ``staging_sink_rollouts_skipped_total{namespace,code}``,
  ``staging_sink_verification_failures_total{namespace,code}``;
* gauges refreshed by :meth:`Metrics.refresh` (the ``staging-sink metrics`` exporter calls it every interval):
  stream length, consumer pending/lag/idle by ``namespace``/``kind``/``shard``, dead-letter length (0 when
  empty), durability and memory per node, rollouts in flight, receipts retained, and ``collection_up``;
* ``staging_sink_build_info{version}`` and ``staging_sink_collection_errors_total``.

No ``_created`` series are exported (``prometheus_client.disable_created_metrics()``).
:func:`serve_metrics` exposes a :class:`Metrics` over HTTP (each service's ``--metrics-port``, or the exporter)
and returns a :class:`MetricsServer` that :meth:`~MetricsServer.stop` shuts down.

``prometheus_client`` is the ``metrics`` extra (``pip install -e '.[metrics]'`` in a clone); it is imported
when a :class:`Metrics` is made, and its absence raises :class:`MetricsExtraMissingError`. The counting
itself (:mod:`sink.store.pipeline_counters`) and :func:`collect_redis_gauges` do not need it.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from types import ModuleType, TracebackType
from typing import TYPE_CHECKING, Any, Self
from wsgiref.simple_server import WSGIServer

import redis.asyncio as aioredis

from sink.errors import MetricsExtraMissingError
from sink.keys import DEFAULT_NAMESPACE
from sink.ops.metrics.collect import (
    STREAM_KINDS,
    GroupGauges,
    ServerGauges,
    StreamGauges,
    collect_redis_gauges,
    collect_server_gauges,
    stream_labels,
)
from sink.store.pipeline_counters import COUNTER_HELP, PipelineCounters, StageOutcome, pipeline_counters

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

__all__ = (
    "EXPORTED_METRICS",
    "STAGE_RESULTS",
    "STREAM_KINDS",
    "GroupGauges",
    "Metrics",
    "MetricsServer",
    "StreamGauges",
    "collect_redis_gauges",
    "serve_metrics",
    "serve_process_metrics",
)

_GAUGES: Mapping[str, tuple[str, tuple[str, ...]]] = {
    "staging_sink_stream_length": ("Entries in a shared stream.", ("namespace", "kind", "shard")),
    "staging_sink_consumer_pending": (
        "Entries delivered to a consumer group and not acknowledged.",
        ("namespace", "kind", "shard", "group"),
    ),
    "staging_sink_consumer_lag": (
        "Entries not yet delivered to a consumer group (absent where the server cannot tell).",
        ("namespace", "kind", "shard", "group"),
    ),
    "staging_sink_consumer_idle_seconds": (
        "Seconds since a consumer of a group last read or acknowledged.",
        ("namespace", "kind", "shard", "group", "consumer"),
    ),
    "staging_sink_dead_letter_length": (
        "Entries in the namespace's dead-letter streams (0 when none).",
        ("namespace",),
    ),
    "staging_sink_durable": ("1 when the node runs appendonly, appendfsync always and noeviction.", ("node",)),
    "staging_sink_used_memory_bytes": ("INFO memory used_memory of the node.", ("node",)),
    "staging_sink_maxmemory_bytes": ("INFO memory maxmemory of the node (0: no limit).", ("node",)),
    "staging_sink_rollouts_in_flight": ("Rollouts with a capture ledger and no receipt yet.", ("namespace",)),
    "staging_sink_receipts_retained": ("Stored receipts in the namespace.", ("namespace",)),
    "staging_sink_collection_up": ("1 when the last read of the Redis gauges succeeded.", ("namespace",)),
    "staging_sink_build_info": ("The staging-sink version that exports these metrics.", ("version",)),
}

STAGE_RESULTS = tuple(StageOutcome)
"""Label values of ``staging_sink_stages_total{result=...}``."""

EXPORTED_METRICS: frozenset[str] = frozenset(
    {f"{name}_total" for name in COUNTER_HELP}
    | {f"staging_sink_stage_latency_seconds_{suffix}" for suffix in ("bucket", "sum", "count")}
    | set(_GAUGES)
    | {"staging_sink_collection_errors_total"}
)
"""Every series name the exporter can emit (the dashboard test checks its expressions against it)."""


def _prometheus() -> ModuleType:
    try:
        return importlib.import_module("prometheus_client")
    except ImportError as exc:
        raise MetricsExtraMissingError(
            "metrics need prometheus_client, the 'metrics' extra: pip install -e '.[metrics]' in a clone"
        ) from exc


def _version() -> str:
    try:
        return importlib.metadata.version("staging-sink")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


class _CountersCollector:
    """Reads :class:`PipelineCounters` at scrape time (custom families: no ``_created`` series)."""

    def __init__(self, counters: PipelineCounters) -> None:
        self._core = importlib.import_module("prometheus_client.core")
        self._counters = counters

    def describe(self) -> list[Any]:
        return []  # unchecked collector: its label sets depend on what was counted

    def collect(self) -> Iterator[Any]:
        core = self._core
        families: dict[str, Any] = {}
        for name, labels, value in self._counters.counters():
            if name not in COUNTER_HELP:
                continue
            family = families.get(name)
            if family is None:
                family = families[name] = core.CounterMetricFamily(name, COUNTER_HELP[name], labels=sorted(labels))
            family.add_metric([labels[key] for key in sorted(labels)], value)
        yield from families.values()
        latency = core.HistogramMetricFamily(
            "staging_sink_stage_latency_seconds",
            "Time from stage() to its result, durable write included.",
            labels=["namespace"],
        )
        for namespace, (buckets, total, _count) in self._counters.latency().items():
            bounds = [("+Inf" if bound == float("inf") else repr(bound), count) for bound, count in buckets]
            latency.add_metric([namespace], bounds, total)
        yield latency


class Metrics:
    """The pipeline's Prometheus collectors, in a private registry (:attr:`registry`).

    *counters* defaults to this process's :func:`~sink.store.pipeline_counters.pipeline_counters`.

    The ``stages`` and ``rollouts_pulled`` series of *namespace* are exported at 0 from the start.
    ``process_counters=False`` (the standalone ``staging-sink metrics`` exporter, which stages and pulls nothing
    itself): only the Redis-side gauges, build info and collection errors, no counter it cannot know.

    :raises MetricsExtraMissingError: ``prometheus_client`` is not installed.
    """

    def __init__(
        self,
        counters: PipelineCounters | None = None,
        *,
        namespace: str = DEFAULT_NAMESPACE,
        process_counters: bool = True,
    ) -> None:
        prom = _prometheus()
        prom.disable_created_metrics()
        self.counters = counters if counters is not None else pipeline_counters()
        self.registry: CollectorRegistry = prom.CollectorRegistry(auto_describe=True)
        if process_counters:
            for result in STAGE_RESULTS:  # exported at 0 from the start, so rates and alerts see a series
                self.counters.add("staging_sink_stages", 0.0, namespace=namespace, result=result)
            for outcome in ("trainable", "skipped"):
                self.counters.add("staging_sink_rollouts_pulled", 0.0, namespace=namespace, outcome=outcome)
            self.registry.register(_CountersCollector(self.counters))
        self.gauges = {
            name: prom.Gauge(name, help_text, list(labels), registry=self.registry)
            for name, (help_text, labels) in _GAUGES.items()
        }
        self.collection_errors = prom.Counter(
            "staging_sink_collection_errors", "Failed reads of the Redis gauges.", registry=self.registry
        )
        self.gauges["staging_sink_build_info"].labels(version=_version()).set(1)

    def update_redis_gauges(self, gauges: Mapping[str, StreamGauges], namespace: str = DEFAULT_NAMESPACE) -> None:
        """Replace the stream gauges with *gauges* (from :func:`collect_redis_gauges`); streams that are gone
        disappear from the exposition; the dead-letter length is their sum (0 without any)."""
        names = ("staging_sink_stream_length", "staging_sink_consumer_pending", "staging_sink_consumer_lag")
        for name in (*names, "staging_sink_consumer_idle_seconds"):
            self.gauges[name].clear()
        dead = 0
        for stream, stats in gauges.items():
            kind, shard = stream_labels(namespace, stream)
            if kind == "dead":
                dead += stats["length"]
            where = {"namespace": namespace, "kind": kind, "shard": shard}
            self.gauges["staging_sink_stream_length"].labels(**where).set(stats["length"])
            for group, group_stats in stats["groups"].items():
                self.gauges["staging_sink_consumer_pending"].labels(**where, group=group).set(group_stats["pending"])
                if group_stats["lag"] is not None:
                    self.gauges["staging_sink_consumer_lag"].labels(**where, group=group).set(group_stats["lag"])
                for consumer, idle_ms in group_stats.get("idle_ms", {}).items():
                    idle = self.gauges["staging_sink_consumer_idle_seconds"]
                    idle.labels(**where, group=group, consumer=consumer).set(idle_ms / 1000.0)
        self.gauges["staging_sink_dead_letter_length"].labels(namespace=namespace).set(dead)

    def update_server_gauges(self, server: ServerGauges, namespace: str = DEFAULT_NAMESPACE) -> None:
        """Replace the per-node and per-namespace gauges with *server* (from :func:`collect_server_gauges`)."""
        for name in ("staging_sink_durable", "staging_sink_used_memory_bytes", "staging_sink_maxmemory_bytes"):
            self.gauges[name].clear()
        for node, gauges in server.nodes.items():
            self.gauges["staging_sink_durable"].labels(node=node).set(1 if gauges.durable else 0)
            self.gauges["staging_sink_used_memory_bytes"].labels(node=node).set(gauges.used_memory_bytes)
            self.gauges["staging_sink_maxmemory_bytes"].labels(node=node).set(gauges.maxmemory_bytes)
        self.gauges["staging_sink_rollouts_in_flight"].labels(namespace=namespace).set(server.rollouts_in_flight)
        self.gauges["staging_sink_receipts_retained"].labels(namespace=namespace).set(server.receipts_retained)

    async def refresh(
        self,
        client: aioredis.Redis,
        namespace: str = DEFAULT_NAMESPACE,
        *,
        streams: Sequence[str] | None = None,
        nodes: Sequence[aioredis.Redis] | None = None,
        primaries: Sequence[aioredis.Redis] | None = None,
    ) -> None:
        """Read every Redis gauge (keyed commands through *client*; per-node reads on *nodes*/*primaries*,
        default ``[client]``) and set ``collection_up`` to 1; on an error set it to 0, count it and re-raise.

        :raises redis.RedisError: a read failed (the previous gauge values stay).
        :raises OSError: a node could not be reached.
        """
        try:
            streams_found = await collect_redis_gauges(client, namespace, streams=streams)
            server = await collect_server_gauges(nodes or [client], primaries or [client], namespace)
        except BaseException:
            self.collection_failed(namespace)
            raise
        self.update_redis_gauges(streams_found, namespace)
        self.update_server_gauges(server, namespace)
        self.gauges["staging_sink_collection_up"].labels(namespace=namespace).set(1)

    def collection_failed(self, namespace: str = DEFAULT_NAMESPACE) -> None:
        """Record a failed read of the Redis gauges: ``collection_up`` 0, ``collection_errors_total`` + 1."""
        self.collection_errors.inc()
        self.gauges["staging_sink_collection_up"].labels(namespace=namespace).set(0)

    def exposition(self) -> bytes:
        """The registry in the Prometheus text format."""
        generated: bytes = _prometheus().generate_latest(self.registry)
        return generated


@dataclass(slots=True)
class MetricsServer:
    """A running exporter: ``GET http://<host>:<port>/metrics``. Stop it with :meth:`stop` or ``with``."""

    host: str
    port: int
    _server: WSGIServer
    _thread: threading.Thread

    @property
    def url(self) -> str:
        """``http://<host>:<port>/metrics``."""
        return f"http://{self.host}:{self.port}/metrics"

    def stop(self, *, timeout_s: float = 5.0) -> None:
        """Stop serving, close the socket and join the server thread (idempotent)."""
        if self._thread.is_alive():
            self._server.shutdown()
            self._thread.join(timeout_s)
        self._server.server_close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def serve_metrics(port: int, metrics: Metrics, *, host: str = "127.0.0.1") -> MetricsServer:
    """Serve *metrics* over HTTP on *host*:*port* (``port=0`` picks a free one; see ``.port``) from a daemon
    thread. Loopback by default: pass ``host="0.0.0.0"`` inside a container.

    :raises MetricsExtraMissingError: ``prometheus_client`` is not installed.
    :raises OSError: the address cannot be bound.
    """
    server, thread = _prometheus().start_http_server(port, addr=host, registry=metrics.registry)
    return MetricsServer(host=host, port=int(server.server_port), _server=server, _thread=thread)


@contextmanager
def serve_process_metrics(
    port: int | None, *, host: str = "127.0.0.1", namespace: str = DEFAULT_NAMESPACE
) -> Iterator[MetricsServer | None]:
    """A service's ``--metrics-port``: serve this process's counters (:func:`~sink.store.pipeline_counters.pipeline_counters`)
    on *host*:*port* for the duration of the ``with`` block; ``port=None`` serves nothing (yields ``None``).

    :raises MetricsExtraMissingError: ``prometheus_client`` is not installed.
    :raises OSError: the address cannot be bound.
    """
    if port is None:
        yield None
        return
    with serve_metrics(port, Metrics(namespace=namespace), host=host) as server:
        yield server
