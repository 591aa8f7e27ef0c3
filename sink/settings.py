"""Settings models, one per component (pydantic, frozen, ``extra="forbid"``).

Units are in the field names. The library never reads environment variables;
only :mod:`sink_cli` does.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from sink.keys import DEFAULT_NAMESPACE

__all__ = (
    "DEFAULT_ABANDON_AFTER_S",
    "DEFAULT_RETENTION_S",
    "DEFAULT_SHARDS",
    "RECLAIMS_PER_IDLE",
    "AssemblerSettings",
    "ConnectionSettings",
    "GymTransportSettings",
    "LedgerSettings",
    "OutageSettings",
    "ProxySettings",
    "PruneSettings",
    "ReaderSettings",
    "RecordLimit",
    "ServiceSettings",
    "SinkSettings",
    "SourceSettings",
    "UpstreamKind",
)

_MIB = 1024 * 1024

DEFAULT_SHARDS = 4
"""Default number of ``done`` and ``receipts`` stream shards (every producer and consumer must agree)."""

DEFAULT_RETENTION_S = 86_400.0
"""How long a consumed rollout's receipt and fence stay after the trainer's ack (1 day): long enough for a
late duplicate ``done`` event or an operator's ``inspect``/``verify`` to find them, then they expire."""

DEFAULT_ABANDON_AFTER_S = 21_600.0
"""A rollout with staged records or a ledger but no receipt, untouched for this long (6 hours), is abandoned
by ``staging-sink prune``: its staged records and ledger are removed, a fence is set and a failure recorded."""


class ConnectionSettings(BaseModel):
    """How to reach Redis/Valkey: shared by every component."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    namespace: str = Field(default=DEFAULT_NAMESPACE, pattern=r"^[A-Za-z0-9._-]+$")
    cluster: bool = False
    """Treat the URL as one node of a Redis/Valkey Cluster."""
    connect_timeout_s: float = Field(default=5.0, gt=0)
    command_timeout_s: float = Field(default=10.0, gt=0)
    """Socket read timeout for one command or pipeline (WAIT adds ``confirm_timeout_s``)."""
    max_connections: int = Field(default=64, ge=1, le=10_000)
    """Connections per server node; callers beyond it wait for a free one (up to ``connect_timeout_s``)."""
    durability: Literal["fsync", "none"] = "fsync"
    """``fsync``: refuse to acknowledge a write unless the server fsyncs every write (``appendfsync always``,
    read back in the write's own round trip, with ``WAITAOF`` where the server has it); ``none``: skip the
    check (benchmarks, throwaway runs)."""

    @property
    def socket_timeout_s(self) -> float:
        """Socket read timeout of this component's connections."""
        return self.command_timeout_s


class RecordLimit(BaseModel):
    """The one size limit of a staged record, for every component that writes or reads one."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_record_bytes: int = Field(default=64 * _MIB, ge=1024)
    """Encoded records (NeMo Gym entries) larger than this are refused: before any write by a sink, before any
    decode by a source or the trainer's reader."""


class LedgerSettings(ConnectionSettings):
    """Settings of :class:`sink.ledger.redis.RedisCaptureLedger` (the connection settings; ``namespace``
    is all a ledger on a borrowed client uses)."""


class SinkSettings(ConnectionSettings, RecordLimit):
    """Settings of :class:`sink.store.sink.AsyncRedisStagingSink`."""

    min_replicas: int = Field(default=0, ge=0)
    """Replicas that must acknowledge each write (``WAIT``) before ``ok=True``."""
    confirm_timeout_s: float = Field(default=5.0, gt=0)
    """Deadline for the replica acknowledgement (``WAIT``/``WAITAOF``)."""
    writer_connections: int = Field(default=4, ge=1, le=64)
    """Connections used for group commit; each carries one batch at a time."""
    max_batch_records: int = Field(default=256, ge=1)
    """The most queued records one writer sends in one transaction (fewer once their blobs reach
    :data:`sink.store.commit.MAX_BATCH_VALUE_BYTES`)."""
    durability_check_interval_s: float = Field(default=30.0, gt=0)
    """How often the server's persistence configuration is re-verified."""

    @property
    def socket_timeout_s(self) -> float:
        """``command_timeout_s``, plus ``confirm_timeout_s`` when ``min_replicas > 0``."""
        # With replicas required, a write pipeline ends with WAIT, which may block for
        # confirm_timeout_s. (WAITAOF returns at once under appendfsync always.)
        return self.command_timeout_s + (self.confirm_timeout_s if self.min_replicas > 0 else 0.0)


class SourceSettings(ConnectionSettings, RecordLimit):
    """Settings of :class:`sink.store.source.AsyncRedisStagingSource`."""


_CONSUMER_NAME = r"^[A-Za-z0-9._-]+$"


RECLAIMS_PER_IDLE = 2
"""A consumer looks for entries crashed consumers left pending this many times per ``claim_idle_ms``."""


class OutageSettings(ConnectionSettings):
    """How a long-running service rides out a server it cannot reach (:class:`sink.service.OutagePolicy`): the
    assembler, the trainer reader and ``staging-sink prune --interval-s``."""

    reconnect_backoff_s: float = Field(default=1.0, gt=0)
    """First pause before retrying after the server could not be reached."""
    reconnect_backoff_max_s: float = Field(default=5.0, gt=0)
    """The longest pause between retries during an outage (the pause doubles from ``reconnect_backoff_s``)."""
    max_outage_s: float | None = Field(default=300.0, gt=0)
    """Give up after the server was unreachable this long without a success in between, in any phase (opening,
    running, closing): a :class:`~sink.errors.StagingUnavailableError` naming the limit, exit 3 for
    ``staging-sink assembler``/``trainer``/``prune --interval-s``; ``None``: retry forever. A refusal
    (:class:`~sink.errors.StagingRefusedError`) stops the service at once."""


class ServiceSettings(OutageSettings):
    """What every long-running service shares (the assembler, the trainer reader): its consumer group and its
    outage policy (:class:`sink.service.OutagePolicy`)."""

    consumer_name: str | None = Field(default=None, pattern=_CONSUMER_NAME)
    """This process's consumer name in the group; default ``<host>-<pid>-<random>``.
    A stable name (``rank-3``) lets a restarted process pick up its own pending entries at once."""
    claim_idle_ms: int = Field(default=60_000, ge=1)
    """Entries delivered to a consumer and unacknowledged for this long are reclaimed (``XAUTOCLAIM``)."""
    max_deliveries: int = Field(default=5, ge=1)
    """An entry delivered more often than this is moved to ``ns:dead:<role>-<shard>`` instead of processed."""

    @property
    def reclaim_interval_s(self) -> float:
        """How often a consumer looks for entries crashed consumers left pending (``claim_idle_ms / 2``)."""
        return self.claim_idle_ms / RECLAIMS_PER_IDLE / 1000.0


class AssemblerSettings(ServiceSettings):
    """Settings of :class:`sink.rollout.assembler.Assembler` (consumer group ``assemblers``)."""

    done_shards: int = Field(default=DEFAULT_SHARDS, ge=1)
    """Shards of ``ns:done:<k>`` to consume (must match ``finished(shards=...)``)."""
    receipt_shards: int = Field(default=DEFAULT_SHARDS, ge=1)
    """Shards of ``ns:receipts:<k>`` to publish to (must match the readers)."""
    block_ms: int = Field(default=1_000, ge=1)
    """How long one ``XREADGROUP`` waits for new events."""
    batch_events: int = Field(default=64, ge=1)
    """Events read per ``XREADGROUP`` (``COUNT``) and processed concurrently per shard."""
    shutdown_grace_s: float = Field(default=10.0, ge=0)
    """After :meth:`~sink.rollout.assembler.Assembler.stop`, how long in-flight events may finish before cancellation."""
    group_timeout_s: float = Field(default=600.0, gt=0)
    """GRPO groups: a group still incomplete this long after its first member was assembled is sealed (its member
    set frozen) and published partial; the reader's ``group_timeout_policy`` says what a rank does with it."""

    @model_validator(mode="after")
    def _check_block_fits_timeout(self) -> AssemblerSettings:
        if self.block_ms / 1000.0 >= self.command_timeout_s:
            raise ValueError("block_ms must be shorter than command_timeout_s (a blocked read would time out)")
        return self


class ReaderSettings(ServiceSettings, RecordLimit):
    """Settings of :class:`sink.trainer.RolloutReader` (consumer group ``trainers``)."""

    receipt_shards: int = Field(default=DEFAULT_SHARDS, ge=1)
    """Shards of ``ns:receipts:<k>`` to consume (must match the assemblers)."""
    claim_idle_ms: int = Field(default=300_000, ge=1)
    """A rank's pulled-but-unacknowledged rollouts are reclaimed by other ranks after this long;
    it must exceed the time between ``pull`` and ``ack`` (``pull``/``heartbeat`` reset it)."""
    fetch_concurrency: int = Field(default=8, ge=1)
    """Rollouts fetched and verified concurrently within one ``pull``."""
    max_weight_lag: int | None = Field(default=None, ge=0)
    """Staleness bound in weight versions: once the trainer tells the reader its current weight version
    (``set_weight_version``), a rollout whose oldest generating call is more than this many versions older
    is acknowledged by the reader and reported skipped with code ``stale_weights``; ``None``: no bound."""
    group_timeout_policy: Literal["partial", "dead_letter"] = "partial"
    """What the receiving rank does with a group the assemblers sealed at their ``group_timeout_s``: delivered with
    the members that arrived, or its members acknowledged and the group recorded on ``ns:dead:groups``."""
    group_failure_policy: Literal["deliver_rest", "drop_group"] = "deliver_rest"
    """A group with a failed, poisoned or stale member: deliver the trainable rest (``failed`` lists the others)
    or acknowledge every member and deliver nothing (counted as dropped)."""
    retention_s: float = Field(default=DEFAULT_RETENTION_S, gt=0)
    """After ``ack``, the rollout's receipt and fence expire after this many seconds (bounded state)."""
    chain_failure_policy: Literal["skip_chain", "skip_rollout"] = "skip_chain"
    """A multi-chain rollout with a poisoned chain (contract §14.4): train its healthy chains and report the
    poisoned one in ``chain_skips``, or skip the whole rollout."""


UpstreamKind = Literal["vllm", "nemo-rl"]
"""The capture proxy's upstream: a stock vLLM OpenAI server, or an engine honouring ``required_prefix_token_ids``."""


class ProxySettings(BaseModel):
    """Settings of the capture proxy (:mod:`worker.proxy.app`; the ``staging-sink proxy`` flags)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    upstream_url: str = Field(min_length=1)
    """The inference server, e.g. ``http://vllm:8000``."""
    redis_url: str = ""
    """The worker side (staging sink, and the source for ``staging_chain`` prefixes): ACL user ``worker``."""
    gate_redis_url: str = ""
    """The gate side (capture ledger, ``finished`` events): ACL user ``gate``; default ``redis_url``."""
    namespace: str = Field(default=DEFAULT_NAMESPACE, pattern=r"^[A-Za-z0-9._-]+$")
    cluster: bool = False
    """The URLs are nodes of a Redis/Valkey Cluster."""
    upstream_kind: UpstreamKind = "vllm"
    """``vllm``: a stock vLLM (>= 0.10.2) OpenAI server; ``nemo-rl``: an engine honouring
    ``required_prefix_token_ids``."""
    capture: bool = True
    """``False``: a bare forwarding proxy (no Redis at all)."""
    fail_closed: bool = False
    """Answer 503 for a call that cannot be captured (default: serve it, the rollout is poisoned)."""
    upstream_timeout_s: float = Field(default=600.0, gt=0)
    redis_timeout_s: float = Field(default=5.0, gt=0)
    """Connect and command timeout of the proxy's Redis clients."""
    max_request_bytes: int = Field(default=64 * _MIB, ge=1)
    max_response_bytes: int = Field(default=64 * _MIB, ge=1)
    """A larger upstream response is served but not captured."""
    weight_version: int = Field(default=0, ge=0, lt=1 << 64)
    """The policy weight version stamped on every call (``weight_source="fixed"``); with ``engine``, the version
    of vLLM's label ``"default"``; with ``published``, the version while the trainer has published none."""
    weight_source: Literal["fixed", "engine", "published"] = "fixed"
    """Where a call's weight version comes from: ``fixed`` (``weight_version``), ``engine`` (the generate route's
    ``weight_versions`` spans in exact-prefix mode, the oldest span; integer labels, ``"default"`` as
    ``weight_version``, any other label refused at start) or ``published`` (the trainer's key
    ``<namespace>:weight_version``, read at most every ``weight_staleness_s``)."""
    weight_staleness_s: float = Field(default=1.0, gt=0)
    """With ``weight_source="published"``: a call is stamped with a version read at most this long before."""
    prefix_mode: Literal["auto", "exact", "verify"] = "auto"
    """``auto``: exact-prefix (token-in/token-out) chat and completions calls where the engine serves vLLM 0.32's render, generate
    and derender routes (probed at start), verify mode elsewhere; ``exact``: refuse to start without them;
    ``verify``: never re-route (the engine re-templates history, drift is detected and the call not staged)."""
    exact_text_ttl_s: float = Field(default=7 * 86400.0, gt=0)
    """Exact-prefix ``/v1/completions``: a rollout's exact texts (``ns:{R}:ledger:text``, parent resolution of a text
    prompt) expire this long after their last write."""
    durability: Literal["fsync", "none"] = "fsync"
    server_timing: bool = False
    """Add a ``Server-Timing`` header (``engine``, ``capture``, ``total`` ms) to each captured call's response
    (benchmarks: the proxy's own share of a call is ``total - engine``)."""
    chain_policy: Literal["single", "roots", "branches"] = "single"
    """Multi-chain rollouts (contract §14.1): ``single`` (an unresolved continuation poisons the rollout),
    ``roots`` (a call that extends no earlier call starts a new chain) or ``branches`` (also every leaf);
    a rollout may opt in itself with the header ``X-Staging-Chains``."""

    @model_validator(mode="after")
    def _check_capture_has_a_store(self) -> ProxySettings:
        if self.capture and not self.redis_url:
            raise ValueError("capture needs redis_url")
        return self


class GymTransportSettings(SinkSettings):
    """Settings of :mod:`sink.gym`'s ``RedisTokenSink`` and ``RedisTokenSource`` (NeMo Gym's transport):
    the staging sink's durability and group-commit settings, plus the tombstone's retention."""

    tombstone_retention_s: float = Field(default=DEFAULT_RETENTION_S, gt=0)
    """How long a dropped rollout's tombstone (its fence) keeps late ``put``/``freeze``/``mark_incomplete``/
    ``begin_call`` failing; afterwards the rollout id is free again."""
    writer_connections: int = Field(default=2, ge=1, le=64)
    """Batches in flight at once (each writes to every cluster node it touches at once). Two: while one batch
    waits for its fsync the next one is on its way; more only splits the waiting operations into smaller batches
    (a server fsyncs them one after the other anyway)."""


class PruneSettings(OutageSettings):
    """Settings of :func:`sink.ops.prune.prune_namespace` (``staging-sink prune``): who removes what, and when.
    The outage fields apply to ``staging-sink prune --interval-s`` (a service)."""

    retention_s: float = Field(default=DEFAULT_RETENTION_S, gt=0)
    """Receipts and fences of consumed rollouts (no ledger, no staged records) without a TTL get this one."""
    abandon_after_s: float = Field(default=DEFAULT_ABANDON_AFTER_S, gt=0)
    """A rollout with no receipt whose last staged call or ledger row is older than this is abandoned."""
    dead_letter_max_entries: int = Field(default=10_000, ge=1)
    """Each ``ns:dead:*`` stream keeps at most (about) this many newest entries (``XTRIM MAXLEN ~``)."""
    consumer_idle_max_s: float = Field(default=DEFAULT_RETENTION_S, gt=0)
    """A consumer name idle this long that owns no pending entry is deleted from its group."""
    scan_count: int = Field(default=1_000, ge=1)
    """``SCAN ... COUNT`` hint."""
