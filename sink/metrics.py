"""Prometheus metrics of the staging pipeline, and the Redis stream gauges that ops tools share.

:class:`Metrics` keeps its collectors in its own ``CollectorRegistry`` (never the global one), so several
services or tests in one process do not clash. :func:`serve_metrics` exposes one over HTTP and returns a
:class:`MetricsServer` that :meth:`~MetricsServer.stop` shuts down (``prometheus_client.start_http_server``
returns the WSGI server and its daemon thread; this module keeps them and stops both).

:func:`collect_redis_gauges` (async) reads the length of every ``done``/``receipts``/``dead`` stream and
each consumer group's pending count and lag (``XINFO GROUPS``); the ``stats`` CLI prints it and the exporter
feeds it to :meth:`Metrics.update_redis_gauges`. It needs only the read-only ``ops`` ACL role.

``prometheus_client`` is the ``metrics`` extra (``pip install 'staging-sink[metrics]'``); it is imported
when a :class:`Metrics` is made, and its absence raises :class:`MetricsExtraMissingError`.
:func:`collect_redis_gauges` does not need it.
"""

from __future__ import annotations

import importlib
import re
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import ModuleType, TracebackType
from typing import TYPE_CHECKING, Any, Self, TypedDict
from wsgiref.simple_server import WSGIServer

import redis.asyncio as aioredis
import redis.exceptions as redis_errors

from .errors import MetricsExtraMissingError
from .keys import DEFAULT_NAMESPACE

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

__all__ = (
    "LATENCY_BUCKETS_S",
    "STAGE_RESULTS",
    "STREAM_KINDS",
    "GroupGauges",
    "Metrics",
    "MetricsServer",
    "StreamGauges",
    "collect_redis_gauges",
    "serve_metrics",
)

STAGE_RESULTS = ("ok", "failed", "conflict", "durability_refused")
"""Label values of ``staging_sink_stages_total{result=...}``."""
STREAM_KINDS = ("done", "receipts", "dead")
"""The namespace's shared streams, ``<ns>:<kind>:<name>``, that the gauges cover."""
LATENCY_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
"""Stage latency histogram buckets in seconds: an fsync'd stage takes ~0.5-20 ms; WAIT can take seconds."""

_LABEL_RE = re.compile(r"[A-Za-z0-9_.:-]{1,64}")
_SCAN_COUNT = 1000


def _prometheus() -> ModuleType:
    try:
        return importlib.import_module("prometheus_client")
    except ImportError as exc:
        raise MetricsExtraMissingError("metrics need prometheus_client: pip install 'staging-sink[metrics]'") from exc


def _label(value: str, what: str) -> str:
    if not isinstance(value, str) or _LABEL_RE.fullmatch(value) is None:
        raise ValueError(f"{what} must be 1-64 characters of [A-Za-z0-9_.:-], got {value!r}")
    return value


class GroupGauges(TypedDict):
    """One consumer group: entries delivered but not acknowledged, entries not yet delivered (``None``
    where the server cannot tell, e.g. Redis 6.2 or after XDEL), and its consumer count."""

    pending: int
    lag: int | None
    consumers: int


class StreamGauges(TypedDict):
    """One stream: its kind (``done``/``receipts``/``dead``/``other``), length and consumer groups."""

    kind: str
    length: int
    groups: dict[str, GroupGauges]


class Metrics:
    """The pipeline's Prometheus collectors, in a private registry (:attr:`registry`).

    :raises MetricsExtraMissingError: ``prometheus_client`` is not installed.
    """

    def __init__(self) -> None:
        prom = _prometheus()
        self.registry: CollectorRegistry = prom.CollectorRegistry(auto_describe=True)
        registry = self.registry
        self.stages = prom.Counter("staging_sink_stages", "Stage calls by result.", ["result"], registry=registry)
        self.stage_latency = prom.Histogram(
            "staging_sink_stage_latency_seconds",
            "Time from stage() to its result, durable write included.",
            buckets=LATENCY_BUCKETS_S,
            registry=registry,
        )
        self.staged_bytes = prom.Counter(
            "staging_sink_staged_bytes", "Encoded bytes of records staged with ok=True.", registry=registry
        )
        self.receipts = prom.Counter(
            "staging_sink_receipts", "Receipts the assembler handled, by outcome.", ["outcome"], registry=registry
        )
        self.verification_failures = prom.Counter(
            "staging_sink_verification_failures",
            "Trainer-side receipt verification failures, by check code.",
            ["code"],
            registry=registry,
        )
        self.dead_letters = prom.Counter(
            "staging_sink_dead_letters",
            "Entries moved to a dead-letter stream, by stream.",
            ["stream"],
            registry=registry,
        )
        self.stream_length = prom.Gauge(
            "staging_sink_stream_length", "Entries in a shared stream.", ["stream", "kind"], registry=registry
        )
        self.consumer_pending = prom.Gauge(
            "staging_sink_consumer_pending",
            "Entries delivered to a consumer group and not acknowledged.",
            ["stream", "group"],
            registry=registry,
        )
        self.consumer_lag = prom.Gauge(
            "staging_sink_consumer_lag",
            "Entries not yet delivered to a consumer group (absent where the server cannot tell).",
            ["stream", "group"],
            registry=registry,
        )
        self.redis_collect_errors = prom.Counter(
            "staging_sink_redis_collect_errors", "Failed reads of the Redis stream gauges.", registry=registry
        )
        for result in STAGE_RESULTS:
            self.stages.labels(result=result)  # export every result at 0 from the start

    def observe_stage(self, result: str, seconds: float, *, staged_bytes: int = 0) -> None:
        """Count one stage call with its *result* (one of :data:`STAGE_RESULTS`) and latency.

        :raises ValueError: an unknown *result*, or a negative duration or size.
        """
        if result not in STAGE_RESULTS:
            raise ValueError(f"stage result must be one of {STAGE_RESULTS}, got {result!r}")
        if seconds < 0 or staged_bytes < 0:
            raise ValueError("seconds and staged_bytes must be non-negative")
        self.stages.labels(result=result).inc()
        self.stage_latency.observe(seconds)
        if staged_bytes:
            self.staged_bytes.inc(staged_bytes)

    def record_receipt(self, outcome: str) -> None:
        """Count one receipt by *outcome* (``built``, ``duplicate``, ``dead_lettered``, ...).

        :raises ValueError: *outcome* is not a short ``[A-Za-z0-9_.:-]`` label.
        """
        self.receipts.labels(outcome=_label(outcome, "outcome")).inc()

    def record_verification_failure(self, code: str) -> None:
        """Count one failed verification by its stable check code (``ReceiptVerificationError.code``).

        :raises ValueError: *code* is not a short ``[A-Za-z0-9_.:-]`` label.
        """
        self.verification_failures.labels(code=_label(code, "code")).inc()

    def record_dead_letter(self, stream: str) -> None:
        """Count one entry dead-lettered to *stream*.

        :raises ValueError: *stream* is not a short ``[A-Za-z0-9_.:-]`` label.
        """
        self.dead_letters.labels(stream=_label(stream, "stream")).inc()

    def update_redis_gauges(self, gauges: Mapping[str, StreamGauges]) -> None:
        """Replace the stream gauges with *gauges* (from :func:`collect_redis_gauges`); streams that are
        gone disappear from the exposition."""
        for gauge in (self.stream_length, self.consumer_pending, self.consumer_lag):
            gauge.clear()
        for stream, stats in gauges.items():
            self.stream_length.labels(stream=stream, kind=stats["kind"]).set(stats["length"])
            for group, group_stats in stats["groups"].items():
                self.consumer_pending.labels(stream=stream, group=group).set(group_stats["pending"])
                if group_stats["lag"] is not None:
                    self.consumer_lag.labels(stream=stream, group=group).set(group_stats["lag"])

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


# --- Redis stream gauges -----------------------------------------------------------------------------


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _kind(namespace: str, stream: str) -> str:
    prefix, _, rest = stream.partition(":")
    kind = rest.partition(":")[0]
    return kind if prefix == namespace and kind in STREAM_KINDS else "other"


def _is_absent(exc: redis_errors.ResponseError) -> bool:
    text = str(exc).lower()
    return "no such key" in text or "wrongtype" in text


def _groups(reply: Iterable[Mapping[Any, Any]]) -> dict[str, GroupGauges]:
    groups: dict[str, GroupGauges] = {}
    for raw in reply:
        info = {_text(key): value for key, value in raw.items()}
        lag = info.get("lag")
        groups[_text(info["name"])] = GroupGauges(
            pending=int(info.get("pending", 0)),
            lag=None if lag is None else int(lag),
            consumers=int(info.get("consumers", 0)),
        )
    return groups


def _patterns(namespace: str) -> list[str]:
    return [f"{namespace}:{kind}:*" for kind in STREAM_KINDS]


async def collect_redis_gauges(
    client: aioredis.Redis, namespace: str = DEFAULT_NAMESPACE, *, streams: Sequence[str] | None = None
) -> dict[str, StreamGauges]:
    """Length and consumer groups of each shared stream, by stream name, sorted.

    Without *streams*, the ``<ns>:done:*``, ``<ns>:receipts:*`` and ``<ns>:dead:*`` streams are found with
    ``SCAN ... TYPE stream``, which walks the whole keyspace: an ops-tool cost, fine at scrape intervals,
    never on a hot path. Streams that do not exist (or are not streams) are left out.

    :raises redis.RedisError: the server cannot be reached or refuses a command (e.g. ``NOPERM``).
    """
    if streams is None:
        found: set[str] = set()
        for pattern in _patterns(namespace):
            async for key in client.scan_iter(match=pattern, count=_SCAN_COUNT, _type="stream"):
                found.add(_text(key))
        names = sorted(found)
    else:
        names = list(streams)
    result: dict[str, StreamGauges] = {}
    for name in names:
        try:
            if _text(await client.type(name)) != "stream":
                continue
            length = int(await client.xlen(name))
            groups = _groups(await client.xinfo_groups(name))
        except redis_errors.ResponseError as exc:
            if _is_absent(exc):
                continue
            raise
        result[name] = StreamGauges(kind=_kind(namespace, name), length=length, groups=groups)
    return result
