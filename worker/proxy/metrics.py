"""Counters and latencies of the capture proxy.

:class:`ProxyMetrics` always counts in plain attributes (tests and the summary line read them); when
``prometheus_client`` is installed (the ``metrics`` extra) it also feeds collectors in its own
``CollectorRegistry``, served by the proxy at ``GET /staging-sink/metrics``:

* ``staging_proxy_calls_total{outcome=captured|uncaptured|capture_failed|capture_error}`` (``capture_error``: an
  unexpected exception, a bug, logged with its traceback; the call is recorded failed)
* ``staging_proxy_upstream_seconds{route}`` (every engine round trip, by engine route: the captured route in verify
  mode; render, generate, derender and ``/tokenize`` in exact-prefix mode) and ``staging_proxy_stage_seconds``
  (histograms)
* ``staging_proxy_response_bytes_total``
* ``staging_proxy_deleted_weight_version_calls_total``: calls stamped with the fallback ``--weight-version``
  because the trainer's published version was deleted (``--weight-source published``; 0 otherwise)
* the sink's stage series of this process (mirrored from :mod:`sink.store.pipeline_counters` while the app is
  open): ``staging_sink_stages_total``, ``staging_sink_staged_bytes_total``, ``staging_sink_stage_latency_seconds``.

With several workers the samples go through prometheus-client's multiprocess files (:mod:`worker.proxy.multiproc`),
so every scrape sees every worker's. No ``_created`` series.
"""

from __future__ import annotations

import importlib
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from sink.store.pipeline_counters import COUNTER_HELP, LATENCY_BUCKETS_S, LATENCY_SERIES, pipeline_counters
from worker.proxy.multiproc import mark_process_dead, multiprocess_exposition, multiprocess_mode

__all__ = ("OUTCOMES", "Outcome", "ProxyMetrics")

Outcome = Literal["captured", "uncaptured", "capture_failed", "capture_error"]
OUTCOMES: tuple[Outcome, ...] = ("captured", "uncaptured", "capture_failed", "capture_error")
_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


@dataclass
class ProxyMetrics:
    """Per-process proxy counters (and Prometheus collectors when available)."""

    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(OUTCOMES, 0))
    response_bytes: int = 0
    deleted_weight_version_calls: int = 0
    upstream_seconds: deque[float] = field(default_factory=lambda: deque(maxlen=10_000))
    stage_seconds: deque[float] = field(default_factory=lambda: deque(maxlen=10_000))
    _prom: dict[str, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        try:
            prometheus = importlib.import_module("prometheus_client")
        except ImportError:
            return
        prometheus.disable_created_metrics()  # as sink.ops.metrics.exporter: no `_created` twin of any series
        registry = prometheus.CollectorRegistry()
        self._prom = {
            "module": prometheus,
            "registry": registry,
            "calls": prometheus.Counter(
                "staging_proxy_calls", "Calls seen by the capture proxy", ["outcome"], registry=registry
            ),
            "upstream": prometheus.Histogram(
                "staging_proxy_upstream_seconds",
                "Latency of each engine round trip, by engine route",
                ["route"],
                buckets=_BUCKETS_S,
                registry=registry,
            ),
            "stage": prometheus.Histogram(
                "staging_proxy_stage_seconds",
                "Capture (stage and commit) latency",
                buckets=_BUCKETS_S,
                registry=registry,
            ),
            "bytes": prometheus.Counter(
                "staging_proxy_response_bytes", "Response bytes served to clients", registry=registry
            ),
            "deleted_weight_version": prometheus.Counter(
                "staging_proxy_deleted_weight_version_calls",
                "Calls stamped with the fallback --weight-version because the published weight version was deleted",
                registry=registry,
            ),
            "stages": prometheus.Counter(
                "staging_sink_stages", COUNTER_HELP["staging_sink_stages"], ["namespace", "result"], registry=registry
            ),
            "staged_bytes": prometheus.Counter(
                "staging_sink_staged_bytes", COUNTER_HELP["staging_sink_staged_bytes"], ["namespace"], registry=registry
            ),
            "latency": prometheus.Histogram(
                LATENCY_SERIES,
                "Time from stage() to its result, durable write included.",
                ["namespace"],
                buckets=LATENCY_BUCKETS_S,
                registry=registry,
            ),
        }
        for outcome in OUTCOMES:  # every outcome exported from the start (0), in every worker's files too
            self._prom["calls"].labels(outcome=outcome)

    def attach(self) -> None:
        """Mirror this process's stage counters into the collectors (the app calls it when it opens)."""
        if self._prom:
            pipeline_counters().add_listener(self._mirror)

    def detach(self) -> None:
        """Stop mirroring; a worker in multiprocess mode marks itself dead (the app calls it when it closes)."""
        if self._prom:
            pipeline_counters().remove_listener(self._mirror)
            mark_process_dead()

    def _mirror(self, name: str, value: float, labels: Mapping[str, str]) -> None:
        prom = self._prom
        if name == "staging_sink_stages":
            prom["stages"].labels(namespace=labels["namespace"], result=labels["result"]).inc(value)
        elif name == "staging_sink_staged_bytes":
            prom["staged_bytes"].labels(namespace=labels["namespace"]).inc(value)
        elif name == LATENCY_SERIES:
            prom["latency"].labels(namespace=labels["namespace"]).observe(value)

    def count(self, outcome: Outcome) -> None:
        """Count one call with *outcome*."""
        self.counts[outcome] += 1
        if self._prom:
            self._prom["calls"].labels(outcome=outcome).inc()

    def count_deleted_weight_version(self) -> None:
        """Count one call stamped with the fallback version while the published one is deleted."""
        self.deleted_weight_version_calls += 1
        if self._prom:
            self._prom["deleted_weight_version"].inc()

    def observe(
        self, *, upstream_s: float | None = None, route: str = "", stage_s: float | None = None, nbytes: int = 0
    ) -> None:
        """Record latencies (an engine round trip on *route*) and served bytes (the deques keep the last 10,000)."""
        if upstream_s is not None:
            self.upstream_seconds.append(upstream_s)
            if self._prom:
                self._prom["upstream"].labels(route=route).observe(upstream_s)
        if stage_s is not None:
            self.stage_seconds.append(stage_s)
            if self._prom:
                self._prom["stage"].observe(stage_s)
        self.response_bytes += nbytes
        if self._prom and nbytes:
            self._prom["bytes"].inc(nbytes)

    def exposition(self) -> bytes:
        """The Prometheus text format (without ``prometheus_client``: ``name value`` lines of the counters)."""
        if self._prom and multiprocess_mode():
            return multiprocess_exposition(self._prom["module"])
        if self._prom:
            data: bytes = self._prom["module"].generate_latest(self._prom["registry"])
            return data
        lines = [f'staging_proxy_calls_total{{outcome="{name}"}} {value}' for name, value in self.counts.items()]
        lines.append(f"staging_proxy_response_bytes_total {self.response_bytes}")
        lines.append(f"staging_proxy_deleted_weight_version_calls_total {self.deleted_weight_version_calls}")
        return ("\n".join(lines) + "\n").encode()
