"""``RedisTokenSink`` and ``RedisTokenSource``: NeMo Gym's ``TokenSink`` / ``TokenSource`` on Redis/Valkey.

Both are structural implementations of Gym's protocols (no ``nemo_gym`` import needed), built the way Gym
builds a configured sink: keyword arguments only, ``RedisTokenSink(redis_url="redis://...", namespace="stg")``
(any further keyword is a :class:`~sink.settings.GymTransportSettings` field). Their methods are coroutines
(asyncio, as Gym's protocols are async); an :class:`~sink.gym.store.AsyncGymStore`, built on first use,
group-commits every operation in the caller's event loop and confirms it durable before the coroutine
returns. An object belongs to one process (Gym builds one per server process; using one across a ``fork``
raises ``RuntimeError``) and to the event loop of its first call (it connects then, not when built; a call
from another loop raises ``RuntimeError``).
"""

from __future__ import annotations

import os
from typing import Any

from sink.gym.codec import encode_entry
from sink.gym.entry import entry_types
from sink.gym.store import AsyncGymStore
from sink.settings import GymTransportSettings

__all__ = ("RedisTokenSink", "RedisTokenSource")


class _Transport:
    """What the sink and the source share: settings, the lazily built store, close."""

    def __init__(self, *, redis_url: str, namespace: str = "stg", **settings: Any) -> None:
        if not isinstance(redis_url, str) or not redis_url:
            raise ValueError(f"redis_url must be a non-empty str, got {redis_url!r}")
        self._url = redis_url
        self._settings = GymTransportSettings(namespace=namespace, **settings)
        self._store: AsyncGymStore | None = None
        self._pid = os.getpid()
        self._closed = False

    @property
    def settings(self) -> GymTransportSettings:
        return self._settings

    def _get_store(self) -> AsyncGymStore:
        if self._closed:
            raise RuntimeError(f"{type(self).__name__} is closed")
        if os.getpid() != self._pid:
            raise RuntimeError(f"{type(self).__name__} was used before a fork: build one in each process")
        if self._store is None:
            self._store = AsyncGymStore(self._url, self._settings, entry_types())
        return self._store

    async def close(self) -> None:
        """Finish queued operations and close the connections (idempotent)."""
        self._closed = True
        store, self._store = self._store, None
        if store is not None:
            await store.aclose()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open" if self._store is not None else "not started"
        return f"<{type(self).__name__} namespace={self._settings.namespace!r} {state}>"


class RedisTokenSink(_Transport):
    """Gym's ``TokenSink``, in each model-server process: ``put`` returns once the entry is durable.

    Gym's config: ``token_id_capture: {sink: "sink.gym:RedisTokenSink", sink_kwargs: {redis_url: ...,
    namespace: ...}}``.
    """

    async def put(self, entry: Any) -> None:
        """Store *entry* (a ``TokenEntry``) durably: every later ``freeze``, from any process, includes it.

        An identical payload under a known ``model_call_id`` is a no-op.

        :raises TokenEntryConflictError: (a ``ValueError``) another payload under a known ``model_call_id``;
            the stored entry is kept and the rollout marked incomplete.
        :raises RolloutFrozenError: (a ``RuntimeError``) the rollout is frozen; nothing was written.
        :raises RolloutRetiredError: (a ``RuntimeError``) the rollout was dropped or retired.
        :raises CaptureWriteError: the write could not be confirmed durable.
        :raises GymInputError: (a ``ValueError``) *entry* breaks the entry's rules: an invalid id, lengths that
            differ, a non-finite log-prob, larger than ``max_record_bytes`` (nothing was written).
        :raises TypeError: *entry* is not a pydantic model.
        """
        encoded = encode_entry(entry)
        await self._get_store().put(encoded)

    async def mark_incomplete(self, rollout_id: str, model_call_id: str = "") -> None:
        """Record durably that a call of *rollout_id* was lost: a later snapshot is ``incomplete``. Works on a
        rollout without entries and after freeze (the snapshot's ``version`` changes).

        :raises RolloutRetiredError: the rollout was dropped or retired.
        :raises CaptureWriteError: the mark could not be confirmed durable.
        :raises GymInputError: an invalid rollout or call id.
        """
        await self._get_store().mark_incomplete(rollout_id, model_call_id)

    async def begin_call(self, rollout_id: str, model_call_id: str) -> None:
        """Record durably that *model_call_id* was dispatched: a freeze without its entry is ``incomplete``.
        Does not change the ``version``.

        :raises RolloutFrozenError: the rollout is frozen.
        :raises RolloutRetiredError: the rollout was dropped or retired.
        :raises CaptureWriteError: the intent could not be confirmed durable.
        :raises GymInputError: an invalid rollout or call id.
        """
        await self._get_store().begin_call(rollout_id, model_call_id)


class RedisTokenSource(_Transport):
    """Gym's ``TokenSource``, in the process that consumes rollouts; same keywords as :class:`RedisTokenSink`."""

    async def freeze(self, rollout_id: str) -> Any:
        """Freeze *rollout_id* atomically and return its ``TokenCaptureSnapshot`` (Gym's class when ``nemo_gym``
        is importable). Idempotent while nothing changes (same ``snapshot_id`` and ``version``); a fence: no
        ``put`` or ``begin_call`` succeeds after it. An unknown rollout freezes to an empty snapshot.

        :raises RolloutRetiredError: the rollout was dropped or retired.
        :raises CodecError: a stored entry is corrupt or has a newer ``schema_version`` than this reader's.
        :raises CaptureWriteError: the freeze could not be confirmed durable.
        :raises GymInputError: an invalid rollout id.
        """
        return await self._get_store().freeze(rollout_id)

    async def drop(self, rollout_id: str, *, snapshot_id: str, version: int) -> bool:
        """Retire the consumed snapshot, only if the rollout is frozen at exactly *snapshot_id* and *version*:
        ``True`` (also for a repeated drop of the same identity), else ``False`` and nothing is deleted (a
        never-frozen rollout, whatever the identity: ``snapshot_id=""``, ``version=0`` included). A tombstone then
        keeps every later operation on the rollout failing for ``tombstone_retention_s``.

        :raises CaptureWriteError: the drop could not be confirmed durable.
        :raises GymInputError: (a ``ValueError``) an invalid rollout id, a ``snapshot_id`` that is not a ``str``
            or a ``version`` that is not an ``int`` (``bool`` included); nothing is deleted.
        """
        return await self._get_store().drop(rollout_id, snapshot_id, version)
