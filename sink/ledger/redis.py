"""The capture ledger on Redis/Valkey (contract §6, §11.1).

Per rollout ``R`` three keys share the hash tag ``{R}``: the ledger stream
``ns:{R}:ledger`` (custody and failure rows, append order), the idempotency
hash ``ns:{R}:ledger:ids`` and the retire fence ``ns:{R}:fence``. Every
operation is one Lua script on those keys (see :mod:`sink.store.scripts`),
so it is atomic per rollout, runs on one cluster slot, and its effect is
visible to every process once the script returned. Durability is the
server's (``appendfsync always``, contract §11.2), and a writing script is
acknowledged only once its own round trip confirmed it durable
(:func:`~sink.store.batch.write_durably`: ``WAITAOF`` and the
persistence settings read back; :class:`~sink.errors.NotDurableError`
otherwise). The orchestration
(validation, rows, conflicts, manifests, resolution) is the front class's,
:class:`~sink.ledger.ledger.CaptureLedger`; this module is its storage.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from typing import Any, Self

import anyio
import redis.asyncio as aioredis
import redis.exceptions as redis_errors
from redis.asyncio.cluster import RedisCluster

from sink.contract.codec import DIGEST_HEAD_BYTES
from sink.contract.records import CaptureLedgerCommit, RolloutRemoval
from sink.errors import CodecError, StagingConnectionError, StagingUnavailableError
from sink.keys import calls_stream, claim_key, fence_key, ledger_ids_key, ledger_stream, receipt_key, record_key
from sink.ledger.ledger import AppendOutcome, CaptureLedger
from sink.ledger.ownership import keys_owned_by
from sink.settings import ConnectionSettings, LedgerSettings
from sink.store.batch import BatchCall, run_batch, write_durably
from sink.store.commit import FollowUp
from sink.store.connection import Topology, connect, reply_text, translate_redis_error
from sink.store.resource import settings_or_fields
from sink.store.scripts import (
    APPEND_AFTER_STAGE_SCRIPT,
    APPEND_SCRIPT,
    HAS_ROWS_SCRIPT,
    LEDGER_DELETE_SCRIPT,
    LEDGER_RETIRE_SCRIPT,
    READ_SCRIPT,
    AppendStatus,
    LedgerStatus,
    RemovalStatus,
    ServerScript,
)

__all__ = ("RedisCaptureLedger",)

# Concurrent per-id deletes of one batch (a delete reads, then writes: it cannot be pipelined); several
# connections in flight let one AOF fsync cover many of them (group commit).
_BATCH_CONCURRENCY = 16
# Scripts in flight per ledger. redis-py's asyncio pool raises
# MaxConnectionsError (it does not wait) once max_connections (default 100)
# are checked out, so a gate with hundreds of concurrent requests must queue
# here instead of failing.
_MAX_IN_FLIGHT = 64
# A delete reads the calls stream, then deletes in one script that checks the stream is unchanged.
_DELETE_ATTEMPTS = 8


def _in_flight_limit(client: aioredis.Redis | RedisCluster) -> int:
    if isinstance(client, aioredis.Redis):
        pool_size = getattr(client.connection_pool, "max_connections", _MAX_IN_FLIGHT)
        return max(1, min(_MAX_IN_FLIGHT, int(pool_size)))
    return _MAX_IN_FLIGHT  # the cluster client has one pool per node


def _entries(xrange_reply: object) -> list[dict[str, str]]:
    """Field maps of a raw ``XRANGE`` reply returned from a script."""
    if not isinstance(xrange_reply, list):
        raise CodecError("unexpected ledger reply shape")
    entries: list[dict[str, str]] = []
    for _entry_id, flat in xrange_reply:
        values = [reply_text(value, "ledger entry") for value in flat]
        entries.append(dict(zip(values[::2], values[1::2], strict=True)))
    return entries


_OUTCOMES = {
    AppendStatus.APPENDED: AppendOutcome.APPENDED,
    AppendStatus.DUPLICATE: AppendOutcome.DUPLICATE,
    AppendStatus.FENCED: AppendOutcome.FENCED,
    AppendStatus.CONFLICT: AppendOutcome.CONFLICT,
}


def _restate(error: StagingConnectionError, failed: int, total: int, verb: str) -> StagingConnectionError:
    """*error* (of the first of *failed* ids of *total*) said as the batch's: the same kind of error (a
    :class:`~sink.errors.NotDurableError` stays one)."""
    return error.restated(
        f"could not {verb} {failed} of {total} rollout ids (each id is all-or-nothing; the others were applied): "
        f"{error}"
    )


class RedisCaptureLedger(CaptureLedger):
    """Async capture ledger shared by every gate process through one Redis/Valkey deployment.

    ``RedisCaptureLedger(client, settings)`` borrows a ``redis.asyncio`` client
    (plain or cluster) and leaves it open (*settings*: any connection settings,
    e.g. the owning component's; default :class:`~sink.settings.LedgerSettings`); :meth:`from_url` owns its client and
    :meth:`aclose` closes it. Use it as an async context manager. Every
    method validates rollout ids (``ValueError("Invalid rollout id: …")``) and
    raises :class:`~sink.errors.StagingConnectionError` when the server
    cannot be reached or refuses the command.
    """

    def __init__(
        self,
        client: aioredis.Redis | RedisCluster,
        settings: ConnectionSettings | None = None,
        *,
        owns_client: bool = False,
    ) -> None:
        """*owns_client*: :meth:`aclose` closes *client* (by default the caller keeps it open)."""
        settings = settings or LedgerSettings()
        topology = Topology(client, settings, owned=owns_client)
        self._topology = topology
        self._ns = settings.namespace
        self._durability = settings.durability
        self._confirm_timeout_s = settings.command_timeout_s / 2  # WAITAOF's deadline, inside the socket's
        self._redirect_budget_s = settings.command_timeout_s  # how long a redirected script is sent again
        client = topology.client
        self._in_flight = anyio.CapacityLimiter(_in_flight_limit(client))

    @classmethod
    def from_url(cls, url: str, settings: LedgerSettings | None = None, **fields: Any) -> Self:
        """Connect to *url*; pass *settings* or :class:`~sink.settings.LedgerSettings` fields as keywords.

        The ledger owns the client; :meth:`aclose` closes it.

        :raises pydantic.ValidationError: an unknown or invalid setting.
        """
        parsed = settings_or_fields(LedgerSettings, settings, fields)
        return cls(connect(url, parsed), parsed, owns_client=True)

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return (
            f"<RedisCaptureLedger ns={self._ns!r} {state} appended={self._appended} "
            f"duplicates={self._duplicates} discarded={self._discarded}>"
        )

    async def _close_resources(self) -> None:
        await self._topology.aclose()

    def is_process_shared(self) -> bool:
        """``True``: every process connected to the same server sees the same ledger."""
        return True

    # --- storage primitives -------------------------------------------------------

    def _keys(self, rollout_id: str) -> tuple[str, str, str]:
        return (
            ledger_stream(self._ns, rollout_id),
            ledger_ids_key(self._ns, rollout_id),
            fence_key(self._ns, rollout_id),
        )

    async def _run(self, script: ServerScript, keys: Sequence[str], args: Sequence[str], action: str) -> Any:
        """Run a script; one the cluster redirected (a failover, a migration) is sent again (see :meth:`_write`)."""
        self._check_open()
        async with self._in_flight, self._topology.translated(action):
            run = partial(script.run, self._topology.client, keys, args)
            return await self._topology.retry_redirected(run, budget_s=self._redirect_budget_s)

    async def _write(self, script: ServerScript, keys: Sequence[str], args: Sequence[str], action: str) -> Any:
        """Run a writing script; answer only once the write is durable (:class:`~sink.errors.NotDurableError`).

        A script the cluster did not run because its topology changed (``MOVED``, ``ASK``, ``READONLY``,
        ``TRYAGAIN``, ``CLUSTERDOWN``) is sent again to the slot's owner once the slot map is reloaded, for up to
        ``command_timeout_s``; any other outage reloads the map before it is raised.
        """
        self._check_open()
        async with self._in_flight, self._topology.translated(action):
            return await write_durably(
                self._topology,
                BatchCall(keys, args, script),
                durability=self._durability,
                timeout_s=self._confirm_timeout_s,
                action=action,
                redirect_budget_s=self._redirect_budget_s,
            )

    async def _append(
        self, rollout_id: str, id_field: str, id_value: str, entry: dict[str, str]
    ) -> tuple[AppendOutcome, str | None]:
        flat = [part for pair in entry.items() for part in pair]
        reply = await self._write(
            APPEND_SCRIPT, self._keys(rollout_id), [id_field, id_value, *flat], "append a ledger row"
        )
        outcome = _OUTCOMES[reply[0]]
        return outcome, reply_text(reply[1], "ledger entry") if outcome is AppendOutcome.CONFLICT else None

    # --- the row behind its stage (one durable round per captured call, contract §6.6) ---------------

    def row_after_stage(self, commit: CaptureLedgerCommit) -> FollowUp:
        """*commit*'s custody row as a write to send right behind its record's stage, in the same round trip and under
        the same durable confirmation (an :class:`~sink.store.sink.AsyncRedisStagingSink` of this namespace, on a
        connection allowed both writes: ``stage(record, then=...)``). The row is appended only when the record it
        names is stored with its digest; read the outcome with :meth:`appended_after_stage`.

        :raises TypeError, ValueError: as :meth:`record` (nothing is sent).
        """
        self._check_open()
        rollout_id, id_field, text, entry = self._custody(commit)
        keys = [*self._keys(rollout_id), record_key(self._ns, commit.record.staging_key)]
        flat = [part for pair in entry.items() for part in pair]
        args = [DIGEST_HEAD_BYTES, commit.record.digest, id_field, text, *flat]
        return FollowUp(BatchCall(keys, args, APPEND_AFTER_STAGE_SCRIPT))

    def appended_after_stage(self, follow_up: FollowUp) -> bool:
        """Whether the row of :meth:`row_after_stage` is in the ledger, confirmed durable (appended now, or found
        identical). ``False`` (not sent, refused, not staged, fenced, conflicting, unconfirmed, an error): the caller
        records the commit as without the shared round (:meth:`record`, through the gate), which sees the same
        ledger and answers for it; an appended but unconfirmed row makes that a no-op, confirmed by its own round.
        """
        reply = follow_up.reply
        if not follow_up.sent or follow_up.unconfirmed is not None or not isinstance(reply, list) or not reply:
            return False
        if reply[0] == AppendStatus.APPENDED:
            self._appended += 1
            return True
        if reply[0] == AppendStatus.DUPLICATE:
            self._duplicates += 1
            return True
        return False

    async def _read_entries(self, rollout_id: str) -> list[dict[str, str]] | None:
        stream, _ids, fence = self._keys(rollout_id)
        reply = await self._run(READ_SCRIPT, [stream, fence], [], "read a rollout ledger")
        return None if reply[0] == LedgerStatus.FENCED else _entries(reply[1])

    async def _fence_state(self, rollout_id: str) -> tuple[bool, bool]:
        stream, _ids, fence = self._keys(rollout_id)
        reply = await self._run(HAS_ROWS_SCRIPT, [stream, fence], [], "check a rollout ledger")
        return (True, False) if reply[0] == LedgerStatus.FENCED else (False, bool(reply[1]))

    async def _per_id(self, ids: list[str], run: Callable[[str], Awaitable[bool]], verb: str) -> RolloutRemoval:
        outcomes: list[bool] = [False] * len(ids)
        errors: list[StagingConnectionError] = []
        limiter = anyio.CapacityLimiter(_BATCH_CONCURRENCY)

        async def run_one(index: int, rollout_id: str) -> None:
            async with limiter:
                try:
                    outcomes[index] = await run(rollout_id)
                except StagingConnectionError as exc:
                    errors.append(exc)  # reported after the batch; the other ids still complete

        async with anyio.create_task_group() as group:
            for index, rollout_id in enumerate(ids):
                group.start_soon(run_one, index, rollout_id)
        if errors:
            raise _restate(errors[0], len(errors), len(ids), verb) from errors[0]
        return RolloutRemoval(
            removed=[rid for rid, hit in zip(ids, outcomes, strict=True) if hit],
            absent=[rid for rid, hit in zip(ids, outcomes, strict=True) if not hit],
        )

    async def _delete_one(self, rollout_id: str) -> bool:
        """Remove every key under the rollout's hash tag (ledger, fence, receipt, claim, records, calls)."""
        ns = self._ns
        calls = calls_stream(ns, rollout_id)
        fixed = [*self._keys(rollout_id), receipt_key(ns, rollout_id), claim_key(ns, rollout_id), calls]
        for _attempt in range(_DELETE_ATTEMPTS):
            self._check_open()
            async with self._in_flight, self._topology.translated(f"read the calls of {rollout_id!r}"):
                client = self._topology.client
                raw = await client.xrange(calls) if await client.type(calls) == b"stream" else []
            staged = [reply_text((fields or {}).get(b"key", b""), "ledger entry") for _entry_id, fields in raw or []]
            records = [record_key(ns, key) for key in keys_owned_by(rollout_id, staged)]
            reply = await self._write(
                LEDGER_DELETE_SCRIPT, [*fixed, *records], [str(len(raw or []))], f"delete {rollout_id!r}"
            )
            if reply[0] != RemovalStatus.DELETE_STALE:
                return bool(reply[0] == RemovalStatus.REMOVED)
        raise StagingUnavailableError(  # contention, not a refusal: trying again later may succeed
            f"could not delete {rollout_id!r}: records kept being staged during {_DELETE_ATTEMPTS} attempts"
        )

    async def _retire_ids(self, rollout_ids: list[str]) -> RolloutRemoval:
        """One retire script per id, all in one pipeline per node, each node's confirmed durable in it
        (:func:`~sink.store.batch.run_batch`)."""
        self._check_open()
        args = [repr(time.time())]
        calls = [BatchCall(self._keys(rollout_id), args, LEDGER_RETIRE_SCRIPT) for rollout_id in rollout_ids]
        action = f"retire the ledgers of {len(rollout_ids)} rollouts"
        async with self._in_flight, self._topology.translated(action):
            replies = await run_batch(
                    self._topology,
                    calls,
                    durability=self._durability,
                    timeout_s=self._confirm_timeout_s,
                    action=action,
                )
        refused = [
            (rid, r) for rid, r in zip(rollout_ids, replies, strict=True) if isinstance(r, redis_errors.RedisError)
        ]
        if refused:
            rollout_id, exc = refused[0]
            error = translate_redis_error(exc, f"retire {rollout_id!r}")
            raise _restate(error, len(refused), len(rollout_ids), "retire") from exc
        hits = [reply[0] == RemovalStatus.REMOVED for reply in replies]
        return RolloutRemoval(
            removed=[rid for rid, hit in zip(rollout_ids, hits, strict=True) if hit],
            absent=[rid for rid, hit in zip(rollout_ids, hits, strict=True) if not hit],
        )

    async def _delete_ids(self, rollout_ids: list[str]) -> RolloutRemoval:
        return await self._per_id(rollout_ids, self._delete_one, "delete")
