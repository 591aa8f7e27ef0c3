"""What this process's pipeline components did, counted: the source of the Prometheus counters.

Every long-running component counts into one process-wide :class:`PipelineCounters` (see
:func:`pipeline_counters`) with a one-line call at the place where the thing happens:

* the staging sink: :func:`count_stage` (each ``stage()`` result and its latency) and :func:`count_staged_bytes`;
* the NeMo Gym transport: :func:`count_gym_operation` (each operation by kind and result);
* the assembler: :func:`count_receipt_published` (per receipts shard);
* every consumer group: :func:`count_dead_letter` (per role and shard);
* the trainer reader: :func:`count_pulled` (trainable, or skipped with its code; the verification codes are
  also counted as verification failures).

This module needs nothing beyond the standard library, costs a lock and a dict update per event, and never
raises on the hot path. :mod:`sink.ops.metrics.exporter` exports the counters to Prometheus (at scrape time, so no
``_created`` series); :meth:`PipelineCounters.snapshot` and :meth:`PipelineCounters.merge` carry them across
processes (the demo's worker processes report theirs to the parent, which exports the sum).
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Callable, Mapping
from enum import StrEnum
from typing import Any

from sink.contract.skip_codes import UPSTREAM_SKIP_CODES

__all__ = (
    "COUNTER_HELP",
    "LATENCY_BUCKETS_S",
    "LATENCY_SERIES",
    "CounterListener",
    "PipelineCounters",
    "StageOutcome",
    "count_dead_letter",
    "count_gym_operation",
    "count_pulled",
    "count_receipt_published",
    "count_rollouts_abandoned",
    "count_stage",
    "count_staged_bytes",
    "pipeline_counters",
)

LATENCY_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
"""Stage latency histogram buckets in seconds: an fsync'd stage takes ~0.5-20 ms; WAIT can take seconds."""


class StageOutcome(StrEnum):
    """How one ``stage()`` ended: the ``result`` label of ``staging_sink_stages_total``."""

    OK = "ok"
    CONFLICT = "conflict"
    """The key holds a record with another digest (nothing was written)."""
    FAILED = "failed"


COUNTER_HELP: Mapping[str, str] = {
    "staging_sink_stages": "stage() calls by result (ok, conflict, failed).",
    "staging_sink_staged_bytes": "Encoded bytes of records newly written by stage().",
    "staging_sink_receipts_published": "Receipts the assembler published, by receipts shard.",
    "staging_sink_dead_letters": "Entries a consumer group moved to a dead-letter stream, by role and shard.",
    "staging_sink_rollouts_pulled": "Rollouts a trainer reader pulled, by outcome (trainable, skipped).",
    "staging_sink_rollouts_skipped": "Rollouts a trainer reader skipped, by skip code.",
    "staging_sink_verification_failures": "Trainer-side verification failures, by check code.",
    "staging_sink_rollouts_abandoned": "Rollouts that never finished, abandoned by prune (records removed).",
    "staging_sink_gym_operations": "NeMo Gym transport operations (put, mark, begin, freeze, drop) by result.",
}
"""Every counter family (exported with the ``_total`` suffix) and its help text."""

LATENCY_SERIES = "staging_sink_stage_latency_seconds"
"""The stage-latency histogram's name (what a :data:`CounterListener` is given for a latency)."""

CounterListener = Callable[[str, float, Mapping[str, str]], None]
"""Told every event as it is counted: ``(counter name, value, labels)``, or ``(LATENCY_SERIES, seconds,
{"namespace": ...})`` for a stage latency. Used to mirror the counters into prometheus-client's multiprocess
files (the capture proxy with several workers); it runs on the hot path, so it must be cheap and not raise."""

_Key = tuple[str, tuple[tuple[str, str], ...]]


class PipelineCounters:
    """Thread-safe counters and one stage-latency histogram per namespace."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counters: dict[_Key, float] = {}
        self._latency: dict[str, list[float]] = {}  # namespace -> [bucket counts..., +Inf count, sum]
        self._listeners: tuple[CounterListener, ...] = ()

    def add_listener(self, listener: CounterListener) -> None:
        """Tell *listener* every event from now on (see :data:`CounterListener`)."""
        with self._lock:
            self._listeners = (*self._listeners, listener)

    def remove_listener(self, listener: CounterListener) -> None:
        """Stop telling *listener* (unknown listeners are ignored)."""
        with self._lock:
            self._listeners = tuple(known for known in self._listeners if known is not listener)

    def add(self, name: str, value: float = 1.0, **labels: str) -> None:
        """Add *value* to counter *name* (one of :data:`COUNTER_HELP`) with *labels*."""
        key = (name, tuple(sorted(labels.items())))
        with self._lock:
            self._counters[key] = self._counters.get(key, 0.0) + value
            listeners = self._listeners
        for listener in listeners:
            listener(name, value, labels)

    def observe_latency(self, namespace: str, seconds: float) -> None:
        """One stage latency in *namespace*."""
        index = bisect.bisect_left(LATENCY_BUCKETS_S, seconds)
        with self._lock:
            row = self._latency.setdefault(namespace, [0.0] * (len(LATENCY_BUCKETS_S) + 2))
            row[index] += 1
            row[-1] += seconds
            listeners = self._listeners
        for listener in listeners:
            listener(LATENCY_SERIES, seconds, {"namespace": namespace})

    def counters(self) -> list[tuple[str, dict[str, str], float]]:
        """Every counter as (name, labels, value), sorted."""
        with self._lock:
            items = sorted(self._counters.items())
        return [(name, dict(labels), value) for (name, labels), value in items]

    def latency(self) -> dict[str, tuple[list[tuple[float, float]], float, float]]:
        """Per namespace: cumulative (upper bound, count) buckets ending with ``inf``, the sum and the count."""
        with self._lock:
            rows = {namespace: list(row) for namespace, row in self._latency.items()}
        out: dict[str, tuple[list[tuple[float, float]], float, float]] = {}
        for namespace, row in sorted(rows.items()):
            cumulative, running = [], 0.0
            for bound, count in zip((*LATENCY_BUCKETS_S, float("inf")), row[:-1], strict=True):
                running += count
                cumulative.append((bound, running))
            out[namespace] = (cumulative, row[-1], running)
        return out

    def value(self, name: str, **labels: str) -> float:
        """The counter *name* with exactly *labels* (0 when never counted)."""
        with self._lock:
            return self._counters.get((name, tuple(sorted(labels.items()))), 0.0)

    def snapshot(self) -> dict[str, Any]:
        """Everything, as JSON-able data for :meth:`merge` in another process."""
        with self._lock:
            return {
                "counters": [[name, dict(labels), value] for (name, labels), value in self._counters.items()],
                "latency": {namespace: list(row) for namespace, row in self._latency.items()},
            }

    def merge(self, snapshot: Mapping[str, Any]) -> None:
        """Add another process's :meth:`snapshot` to these counters.

        :raises ValueError: *snapshot* is not what :meth:`snapshot` returns.
        """
        try:
            counters = [
                (str(n), {str(k): str(v) for k, v in labels.items()}, float(x)) for n, labels, x in snapshot["counters"]
            ]
            latency = {str(ns): [float(x) for x in row] for ns, row in snapshot["latency"].items()}
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ValueError(f"not a pipeline counters snapshot: {exc}") from exc
        if any(len(row) != len(LATENCY_BUCKETS_S) + 2 for row in latency.values()):
            raise ValueError("not a pipeline counters snapshot: latency rows of the wrong length")
        for name, labels, value in counters:
            self.add(name, value, **labels)
        with self._lock:
            for namespace, row in latency.items():
                mine = self._latency.setdefault(namespace, [0.0] * (len(LATENCY_BUCKETS_S) + 2))
                for index, count in enumerate(row):
                    mine[index] += count

    def reset(self) -> None:
        """Forget everything (tests, or a worker process starting a new report)."""
        with self._lock:
            self._counters.clear()
            self._latency.clear()


_PROCESS_COUNTERS = PipelineCounters()


def pipeline_counters() -> PipelineCounters:
    """This process's counters (one instance per process)."""
    return _PROCESS_COUNTERS


def count_stage(namespace: str, result: StageOutcome, seconds: float) -> None:
    """One ``stage()`` in *namespace* that ended with *result*."""
    _PROCESS_COUNTERS.add("staging_sink_stages", namespace=namespace, result=result)
    _PROCESS_COUNTERS.observe_latency(namespace, max(0.0, seconds))


def count_gym_operation(namespace: str, operation: str, result: str) -> None:
    """One NeMo Gym transport *operation* in *namespace* that ended with *result* (``ok``, ``conflict``,
    ``frozen``, ``retired``, ``refused``: a drop that did not match, ``failed``: not confirmed durable)."""
    _PROCESS_COUNTERS.add("staging_sink_gym_operations", namespace=namespace, operation=operation, result=result)


def count_staged_bytes(namespace: str, nbytes: int) -> None:
    """*nbytes* of a record newly written in *namespace*."""
    _PROCESS_COUNTERS.add("staging_sink_staged_bytes", float(nbytes), namespace=namespace)


def count_receipt_published(namespace: str, shard: int, receipts: int = 1) -> None:
    """*receipts* published on receipts shard *shard* (one entry: a rollout's, or a GRPO group's members)."""
    _PROCESS_COUNTERS.add("staging_sink_receipts_published", float(receipts), namespace=namespace, shard=str(shard))


def count_dead_letter(namespace: str, role: str, shard: int) -> None:
    """One entry of the *role* group's shard *shard* moved to its dead-letter stream."""
    _PROCESS_COUNTERS.add("staging_sink_dead_letters", namespace=namespace, role=role, shard=str(shard))


def count_rollouts_abandoned(namespace: str) -> None:
    """One rollout that never finished, abandoned by :func:`sink.ops.prune.prune_namespace`."""
    _PROCESS_COUNTERS.add("staging_sink_rollouts_abandoned", namespace=namespace)


def count_pulled(namespace: str, skip_code: str | None) -> None:
    """One rollout pulled by a trainer reader: trainable (*skip_code* ``None``) or skipped with *skip_code*."""
    if skip_code is None:
        _PROCESS_COUNTERS.add("staging_sink_rollouts_pulled", namespace=namespace, outcome="trainable")
        return
    _PROCESS_COUNTERS.add("staging_sink_rollouts_pulled", namespace=namespace, outcome="skipped")
    _PROCESS_COUNTERS.add("staging_sink_rollouts_skipped", namespace=namespace, code=skip_code)
    if skip_code not in UPSTREAM_SKIP_CODES:
        _PROCESS_COUNTERS.add("staging_sink_verification_failures", namespace=namespace, code=skip_code)
