"""The capture ledger on Redis/Valkey (contract §6, architecture §3).

Per rollout ``R`` three keys share the hash tag ``{R}``: the ledger stream
``ns:{R}:ledger`` (custody and failure rows, append order), the idempotency
hash ``ns:{R}:ledger:ids`` and the retire fence ``ns:{R}:fence``. Every
operation is one Lua script on those keys (see :mod:`sink.store.scripts`),
so it is atomic per rollout, runs on one cluster slot, and its effect is
visible to every process once the script returned. Durability is the
server's (``appendfsync always``, architecture §4).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from typing import Any, Self

import anyio
import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster

from ..errors import CodecError, LedgerConflictError, RolloutRetiredError, StagingConnectionError
from ..fingerprint import assistant_fingerprint
from ..keys import DEFAULT_NAMESPACE, fence_key, ledger_ids_key, ledger_stream, validate_rollout_id
from ..records import CaptureLedgerCommit, RolloutManifest, RolloutRemoval
from ..settings import ConnectionSettings
from ..store.connection import Topology, map_redis_errors, reply_text
from ..store.resource import AsyncResource
from ..store.scripts import (
    APPEND_CONFLICT,
    APPEND_DUPLICATE,
    APPEND_FENCED,
    APPEND_SCRIPT,
    HAS_ROWS_SCRIPT,
    LEDGER_DELETE_SCRIPT,
    LEDGER_FENCED,
    LEDGER_RETIRE_SCRIPT,
    READ_SCRIPT,
    REMOVED,
    ServerScript,
)
from .lineage import RETIRED_REASON, LineageResolution, LineageStatus, resolve_from_rows
from .rows import (
    check_failure_args,
    commit_rollout_id,
    conflict_message,
    custody_entry,
    custody_id_field,
    custody_row,
    decode_custody_rows,
    encode_row,
    failure_entry,
    failure_id_field,
    manifest_from_entries,
    normalize_rollout_batch,
    warn_discarded_call,
    warn_discarded_failure,
)

__all__ = ("RedisCaptureLedger",)

# Concurrent per-id scripts of one retire/delete batch: several connections
# in flight let one AOF fsync cover many fences (group commit).
_BATCH_CONCURRENCY = 16
# Scripts in flight per ledger. redis-py's asyncio pool raises
# MaxConnectionsError (it does not wait) once max_connections (default 100)
# are checked out, so a gate with hundreds of concurrent requests must queue
# here instead of failing.
_MAX_IN_FLIGHT = 64


def _in_flight_limit(client: aioredis.Redis | RedisCluster) -> int:
    if isinstance(client, aioredis.Redis):
        pool_size = getattr(client.connection_pool, "max_connections", _MAX_IN_FLIGHT)
        return max(1, min(_MAX_IN_FLIGHT, int(pool_size)))
    return _MAX_IN_FLIGHT  # the cluster client has one pool per node


def _text(value: object) -> str:
    return reply_text(value, "ledger entry")


def _entries(xrange_reply: object) -> list[dict[str, str]]:
    """Field maps of a raw ``XRANGE`` reply returned from a script."""
    if not isinstance(xrange_reply, list):
        raise CodecError("unexpected ledger reply shape")
    entries: list[dict[str, str]] = []
    for _entry_id, flat in xrange_reply:
        values = [_text(value) for value in flat]
        entries.append(dict(zip(values[::2], values[1::2], strict=True)))
    return entries


class RedisCaptureLedger(AsyncResource):
    """Async capture ledger shared by every gate process through one Redis/Valkey deployment.

    ``RedisCaptureLedger(client)`` borrows a ``redis.asyncio`` client (plain
    or cluster) and leaves it open; :meth:`from_url` owns its client and
    :meth:`aclose` closes it. Use it as an async context manager. Every
    method validates rollout ids (``ValueError("Invalid rollout id: …")``) and
    raises :class:`~sink.errors.StagingConnectionError` when the server
    cannot be reached or refuses the command.
    """

    def __init__(self, client: aioredis.Redis | RedisCluster, *, namespace: str = DEFAULT_NAMESPACE) -> None:
        self._init(Topology.borrow(client, ConnectionSettings(namespace=namespace)), namespace)

    @classmethod
    def from_url(cls, url: str, **settings: Any) -> Self:
        """Connect to *url* with :class:`~sink.settings.ConnectionSettings` fields as keywords.

        The ledger owns the client; :meth:`aclose` closes it.

        :raises pydantic.ValidationError: an unknown or invalid setting.
        """
        parsed = ConnectionSettings(**settings)
        ledger = cls.__new__(cls)
        ledger._init(Topology.from_url(url, parsed), parsed.namespace)
        return ledger

    def _init(self, topology: Topology, namespace: str) -> None:
        self._topology = topology
        self._ns = namespace
        client = topology.client
        self._in_flight = anyio.CapacityLimiter(_in_flight_limit(client))
        self._appended = self._duplicates = self._discarded = 0

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return (
            f"<RedisCaptureLedger ns={self._ns!r} {state} appended={self._appended} "
            f"duplicates={self._duplicates} discarded={self._discarded}>"
        )

    async def _close_resources(self) -> None:
        await self._topology.aclose()

    async def close(self) -> None:
        """Alias of :meth:`aclose` (the contract's name)."""
        await self.aclose()

    def is_process_shared(self) -> bool:
        """``True``: every process connected to the same server sees the same ledger."""
        return True

    # --- internals --------------------------------------------------------

    def _keys(self, rollout_id: str) -> tuple[str, str, str]:
        return (
            ledger_stream(self._ns, rollout_id),
            ledger_ids_key(self._ns, rollout_id),
            fence_key(self._ns, rollout_id),
        )

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the capture ledger is closed")

    async def _run(self, script: ServerScript, keys: Sequence[str], args: Sequence[str], action: str) -> Any:
        self._check_open()
        async with self._in_flight:
            with map_redis_errors(action):
                return await script.run(self._topology.client, keys, args)

    async def _append(self, rollout_id: str, id_field: str, id_value: str, entry: dict[str, str]) -> list[Any]:
        flat = [part for pair in entry.items() for part in pair]
        reply = await self._run(
            APPEND_SCRIPT, self._keys(rollout_id), [id_field, id_value, *flat], "append a ledger row"
        )
        if reply[0] == APPEND_FENCED:
            self._discarded += 1
        elif reply[0] == APPEND_DUPLICATE:
            self._duplicates += 1
        elif reply[0] != APPEND_CONFLICT:
            self._appended += 1
        return list(reply)

    async def _read_entries(self, rollout_id: str) -> list[dict[str, str]] | None:
        """All entries in append order, or ``None`` when the rollout is retired (one atomic read)."""
        stream, _ids, fence = self._keys(rollout_id)
        reply = await self._run(READ_SCRIPT, [stream, fence], [], "read a rollout ledger")
        return None if reply[0] == LEDGER_FENCED else _entries(reply[1])

    async def _is_fenced(self, rollout_id: str) -> tuple[bool, bool]:
        stream, _ids, fence = self._keys(rollout_id)
        reply = await self._run(HAS_ROWS_SCRIPT, [stream, fence], [], "check a rollout ledger")
        return (True, False) if reply[0] == LEDGER_FENCED else (False, bool(reply[1]))

    # --- writes -----------------------------------------------------------

    async def record(self, commit: CaptureLedgerCommit) -> None:
        """Append *commit*'s custody row (contract §6.3); the row is visible to every process on return.

        A replay of an identical commit is a no-op; for a retired rollout the
        row is discarded with a warning naming its staging key.

        :raises TypeError: *commit* is not a ``CaptureLedgerCommit``.
        :raises ValueError: invalid rollout id, or unfingerprintable items.
        :raises LedgerConflictError: a different row exists for the same ``model_call_id`` (nothing changed).
        """
        rollout_id = commit_rollout_id(commit)
        text = encode_row(custody_row(commit))
        call_id = commit.record.model_call_id
        reply = await self._append(rollout_id, custody_id_field(call_id), text, custody_entry(text))
        if reply[0] == APPEND_FENCED:
            warn_discarded_call(rollout_id, commit)
        elif reply[0] == APPEND_CONFLICT:
            raise LedgerConflictError(conflict_message(rollout_id, call_id, _text(reply[1]), text))

    async def record_failure(self, rollout_id: str, model_call_id: str, reason: str) -> None:
        """Append a failure row; an identical ``(call, reason)`` is a no-op, a retired rollout discards it.

        :raises ValueError: invalid rollout id, or an empty call id or reason.
        """
        check_failure_args(rollout_id, model_call_id, reason)
        reply = await self._append(
            rollout_id, failure_id_field(model_call_id, reason), "1", failure_entry(model_call_id, reason)
        )
        if reply[0] == APPEND_FENCED:
            warn_discarded_failure(rollout_id, model_call_id, reason)

    # --- reads ------------------------------------------------------------

    async def manifest(self, rollout_id: str) -> RolloutManifest:
        """The rollout's manifest in append order (contract §6.7); empty for a never-touched rollout.

        :raises RolloutRetiredError: the rollout is retired.
        :raises CodecError: a stored row is corrupt.
        """
        validate_rollout_id(rollout_id)
        entries = await self._read_entries(rollout_id)
        if entries is None:
            raise RolloutRetiredError(rollout_id)
        return manifest_from_entries(rollout_id, entries)

    async def has_rows(self, rollout_id: str) -> bool:
        """Whether committed or failure rows exist.

        :raises RolloutRetiredError: the rollout is retired.
        """
        validate_rollout_id(rollout_id)
        fenced, has_rows = await self._is_fenced(rollout_id)
        if fenced:
            raise RolloutRetiredError(rollout_id)
        return has_rows

    async def resolve(self, rollout_id: str, request_items: Sequence[dict[str, Any]]) -> LineageResolution:
        """Resolve the parent call a request continues (contract §6.5).

        :raises ValueError: invalid rollout id, or unfingerprintable items.
        :raises CodecError: a stored row is corrupt.
        """
        validate_rollout_id(rollout_id)
        items = list(request_items)
        if assistant_fingerprint(items) == "":
            # A root needs no rows, only the fence.
            fenced, _ = await self._is_fenced(rollout_id)
            if fenced:
                return LineageResolution(LineageStatus.UNRESOLVED, reason=RETIRED_REASON)
            return LineageResolution(LineageStatus.ROOT)
        entries = await self._read_entries(rollout_id)
        if entries is None:
            return LineageResolution(LineageStatus.UNRESOLVED, reason=RETIRED_REASON)
        return resolve_from_rows(items, decode_custody_rows(entries))

    # --- retire / delete --------------------------------------------------

    async def _per_id(
        self, rollout_ids: Iterable[str], script: ServerScript, args: list[str], verb: str
    ) -> RolloutRemoval:
        ids = normalize_rollout_batch(rollout_ids)
        self._check_open()
        outcomes: list[bool] = [False] * len(ids)
        errors: list[StagingConnectionError] = []
        limiter = anyio.CapacityLimiter(_BATCH_CONCURRENCY)

        async def run_one(index: int, rollout_id: str) -> None:
            async with limiter:
                try:
                    reply = await self._run(script, self._keys(rollout_id), args, f"{verb} {rollout_id!r}")
                    outcomes[index] = reply[0] == REMOVED
                except StagingConnectionError as exc:
                    errors.append(exc)  # reported after the batch; the other ids still complete

        async with anyio.create_task_group() as group:
            for index, rollout_id in enumerate(ids):
                group.start_soon(run_one, index, rollout_id)
        if errors:
            raise StagingConnectionError(
                f"could not {verb} {len(errors)} of {len(ids)} rollout ids (the others were applied): {errors[0]}"
            ) from errors[0]
        return RolloutRemoval(
            removed=[rid for rid, hit in zip(ids, outcomes, strict=True) if hit],
            absent=[rid for rid, hit in zip(ids, outcomes, strict=True) if not hit],
        )

    async def retire(self, rollout_ids: Iterable[str]) -> RolloutRemoval:
        """Fence each rollout and remove its ledger (contract §6.9); atomic per id.

        ``removed``: had rows, now removed; ``absent``: no rows (never started or
        already retired). The whole batch is validated before any change;
        duplicates keep their first occurrence.

        :raises TypeError: *rollout_ids* is a bare ``str``/``bytes``.
        :raises ValueError: any id is invalid (nothing changed).
        """
        return await self._per_id(rollout_ids, LEDGER_RETIRE_SCRIPT, [repr(time.time())], "retire")

    async def delete(self, rollout_ids: Iterable[str]) -> RolloutRemoval:
        """Remove each rollout's ledger and fence; the ids become reusable (contract §6.9).

        ``removed``: had a live ledger; fence-only and unknown ids are ``absent``.

        :raises TypeError: *rollout_ids* is a bare ``str``/``bytes``.
        :raises ValueError: any id is invalid (nothing changed).
        """
        return await self._per_id(rollout_ids, LEDGER_DELETE_SCRIPT, [], "delete")
