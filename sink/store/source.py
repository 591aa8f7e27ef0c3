"""Fetching staged records back, verified (contract §5.1 ``StagingSource``).

``fetch(keys)`` returns exactly one validated snapshot per key, in request
order, with one ``MGET`` per cluster slot (one round trip per slot). Every
blob is decoded with its digest recomputed; a missing key is a ``KeyError``
naming every missing key, a corrupt blob a :class:`CodecError`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, Self, TypeVar

import redis.asyncio as aioredis
import redis.exceptions as redis_errors
from redis.asyncio.cluster import RedisCluster

from sink.contract.codec import decode_packed_record, decode_record
from sink.contract.packed import PackedSnapshot
from sink.contract.records import StagedCallSnapshot
from sink.errors import CodecError
from sink.keys import record_key
from sink.settings import SourceSettings
from sink.store.connection import Topology, connect, map_redis_errors
from sink.store.resource import AsyncResource, PortalOwner, settings_or_fields
from sink.tasks import task_group

__all__ = ("AsyncRedisStagingSource", "RedisStagingSource", "check_snapshot_key")

_Decoded = TypeVar("_Decoded", StagedCallSnapshot, PackedSnapshot)


def check_snapshot_key(staging_key: str, snapshot: StagedCallSnapshot | PackedSnapshot) -> None:
    """Reject a record stored under a key that is not its own.

    Keys minted by the sink are ``R/C`` or ``R/C/cut/<checkpoint>/<seq>``.

    :raises CodecError: the record's ids do not match the key.
    """
    own = snapshot.staging_key
    if staging_key != own and not staging_key.startswith(own + "/cut/"):
        raise CodecError(f"record stored under {staging_key!r} belongs to {own!r}")


class AsyncRedisStagingSource(AsyncResource):
    """Verified reads of staged records. ``from_url`` owns its clients; the constructor borrows one.

    Use as an async context manager (entry loads the cluster topology).
    """

    def __init__(
        self, client: aioredis.Redis | RedisCluster, settings: SourceSettings | None = None, *, owns_client: bool = False
    ) -> None:
        """*owns_client*: :meth:`aclose` closes *client* (by default the caller keeps it open)."""
        self._settings = settings or SourceSettings()
        self._topology = Topology(client, self._settings, owned=owns_client)

    @classmethod
    def from_url(cls, url: str, settings: SourceSettings | None = None, **fields: Any) -> Self:
        """Create a source that owns its connection(s); pass *settings* or :class:`SourceSettings` fields.

        :raises pydantic.ValidationError: an unknown or invalid setting.
        """
        parsed = settings_or_fields(SourceSettings, settings, fields)
        return cls(connect(url, parsed), parsed, owns_client=True)

    async def _open(self) -> None:
        with map_redis_errors("load the cluster topology"):
            await self._topology.initialize()

    async def _close_resources(self) -> None:
        await self._topology.aclose()

    async def fetch_blobs(self, staging_keys: Sequence[str]) -> list[bytes | None]:
        """Raw stored blobs in request order (``None`` where absent); one ``MGET`` per slot. An ``MGET`` the
        cluster redirected (a failover, a slot migration) is sent again once the slot map is reloaded, for up to
        ``command_timeout_s``."""
        if isinstance(staging_keys, str):
            raise TypeError("fetch() takes a sequence of staging keys, not a single str")
        redis_keys = [record_key(self._settings.namespace, key) for key in staging_keys]
        blobs: list[bytes | None] = [None] * len(redis_keys)
        groups = self._topology.group_by_slot(redis_keys)

        async def read(keys: list[str]) -> list[Any]:
            return list(await self._topology.node_for_key(keys[0]).mget(keys))  # the slot's owner, after a reload

        async def fetch_group(indices: list[int]) -> None:
            keys = [redis_keys[i] for i in indices]
            values = await self._topology.retry_redirected(partial(read, keys), budget_s=budget_s)
            for i, value in zip(indices, values, strict=True):
                # decode_responses is off, so values are bytes (or None when absent).
                blobs[i] = value.encode() if isinstance(value, str) else value

        budget_s = self._settings.command_timeout_s
        async with self._topology.translated("fetch staged records"):
            if len(groups) == 1:
                await fetch_group(next(iter(groups.values())))
            else:
                async with task_group((redis_errors.RedisError, OSError)) as group:  # one error, then translated
                    for indices in groups.values():
                        group.start_soon(fetch_group, indices)
        return blobs

    async def fetch(self, staging_keys: Sequence[str]) -> list[StagedCallSnapshot]:
        """One verified snapshot per key, in request order, duplicates kept.

        :raises KeyError: any key is missing (the message names every missing key).
        :raises CodecError: a stored blob is corrupt or stored under a foreign key.
        :raises StagingConnectionError: the server could not be reached.
        """
        return await self._fetch_decoded(staging_keys, decode_record)

    async def fetch_packed(self, staging_keys: Sequence[str]) -> list[PackedSnapshot]:
        """Like :meth:`fetch`, as :class:`~sink.packed_snapshot.PackedSnapshot` (columns kept as bytes).

        The same checks; no Python object per token is built, which makes it
        several times cheaper for long chains (the trainer, chain resolution).

        :raises KeyError: as :meth:`fetch`.
        :raises CodecError: as :meth:`fetch`.
        :raises StagingConnectionError: as :meth:`fetch`.
        """
        return await self._fetch_decoded(staging_keys, decode_packed_record)

    async def _fetch_decoded(self, staging_keys: Sequence[str], decode: Callable[..., _Decoded]) -> list[_Decoded]:
        blobs = await self.fetch_blobs(staging_keys)
        missing = [key for key, blob in zip(staging_keys, blobs, strict=True) if blob is None]
        if missing:
            raise KeyError(f"no staged record for {len(missing)} key(s): {missing}")
        snapshots = []
        for key, blob in zip(staging_keys, blobs, strict=True):
            assert blob is not None
            try:
                snapshot = decode(blob, max_record_bytes=self._settings.max_record_bytes)
            except CodecError as exc:
                raise CodecError(f"staged record {key!r}: {exc}") from exc
            check_snapshot_key(key, snapshot)
            snapshots.append(snapshot)
        return snapshots


class RedisStagingSource(PortalOwner[AsyncRedisStagingSource]):
    """Synchronous, thread-safe facade implementing the reference ``StagingSource`` protocol."""

    @classmethod
    def from_url(cls, url: str, settings: SourceSettings | None = None, **fields: Any) -> Self:
        """Open a source on *url*; the arguments are :meth:`AsyncRedisStagingSource.from_url`'s."""
        return cls(AsyncRedisStagingSource.from_url(url, settings, **fields))

    def fetch(self, staging_keys: Sequence[str]) -> list[StagedCallSnapshot]:
        """Thread-safe :meth:`AsyncRedisStagingSource.fetch`."""
        return self._call(self._resource.fetch, list(staging_keys))

    def fetch_packed(self, staging_keys: Sequence[str]) -> list[PackedSnapshot]:
        """Thread-safe :meth:`AsyncRedisStagingSource.fetch_packed`."""
        return self._call(self._resource.fetch_packed, list(staging_keys))
