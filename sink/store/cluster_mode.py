"""Cluster mode, read from the server instead of trusted from a flag.

The server says whether it is a cluster node: ``INFO cluster`` reports ``cluster_enabled:0|1``. A role whose
ACL denies ``INFO`` can still run ``CLUSTER INFO`` (every role may, :data:`sink.ops.access.render.CONNECTION_COMMANDS`),
which a standalone server refuses with "cluster support disabled".

:func:`resolve_cluster_mode` turns a requested mode (``True``, ``False`` or ``None`` = detect) and the
server's answer into the mode to use, or one :class:`~sink.errors.ClusterModeMismatchError` line.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import redis
import redis.asyncio as aioredis
import redis.exceptions as redis_errors

from sink.errors import ClusterModeMismatchError
from sink.store.connection import map_redis_errors

__all__ = (
    "detect_cluster_mode",
    "resolve_cluster_mode",
    "server_cluster_enabled",
    "server_cluster_enabled_sync",
)

_DISABLED = "cluster support disabled"


def _enabled(info: Mapping[Any, Any]) -> bool:
    return str(info.get("cluster_enabled", info.get(b"cluster_enabled", "0"))) == "1"


def _denied(exc: redis_errors.ResponseError) -> bool:
    return isinstance(exc, redis_errors.NoPermissionError) or str(exc).upper().startswith("NOPERM")


def _disabled(exc: redis_errors.ResponseError) -> bool:
    return _DISABLED in str(exc).lower()


def server_cluster_enabled_sync(client: redis.Redis) -> bool:
    """Whether the server behind the plain (non-cluster) *client* runs in cluster mode.

    :raises redis.exceptions.RedisError: the server cannot be reached or refuses both probes.
    """
    try:
        return _enabled(client.info("cluster"))
    except redis_errors.ResponseError as exc:
        if not _denied(exc):
            raise
    try:
        client.execute_command("CLUSTER INFO")  # type: ignore[no-untyped-call]
    except redis_errors.ResponseError as exc:
        if _disabled(exc):
            return False
        raise
    return True


async def server_cluster_enabled(client: aioredis.Redis) -> bool:
    """Async :func:`server_cluster_enabled_sync`."""
    try:
        return _enabled(await client.info("cluster"))
    except redis_errors.ResponseError as exc:
        if not _denied(exc):
            raise
    try:
        await client.execute_command("CLUSTER INFO")  # type: ignore[no-untyped-call]
    except redis_errors.ResponseError as exc:
        if _disabled(exc):
            return False
        raise
    return True


def resolve_cluster_mode(requested: bool | None, enabled: bool, where: str) -> bool:
    """The mode to use: the server's (*enabled*) when *requested* is ``None``, else *requested* if it agrees.

    :param where: the server, for the message (a masked URL).
    :raises ClusterModeMismatchError: *requested* contradicts the server.
    """
    if requested is None or requested == enabled:
        return enabled
    if requested:
        raise ClusterModeMismatchError(
            f"{where} is a standalone server (INFO cluster: cluster_enabled:0) but cluster mode was requested "
            "(--cluster / cluster=True); drop --cluster"
        )
    raise ClusterModeMismatchError(
        f"{where} is a Redis Cluster node (INFO cluster: cluster_enabled:1) but cluster mode is off "
        "(--no-cluster / cluster=False); drop --no-cluster or pass --cluster"
    )


def detect_cluster_mode(url: str, *, requested: bool | None, connect_timeout_s: float, where: str) -> bool:
    """Ask the server at *url* (one short-lived connection) and :func:`resolve_cluster_mode`.

    :raises StagingConnectionError: the server cannot be reached or refuses both probes.
    :raises ClusterModeMismatchError: *requested* contradicts the server.
    """
    with map_redis_errors(f"connect to {where}"):
        client = redis.Redis.from_url(url, socket_connect_timeout=connect_timeout_s, socket_timeout=connect_timeout_s)
        try:
            enabled = server_cluster_enabled_sync(client)
        finally:
            client.close()
    return resolve_cluster_mode(requested, enabled, where)
