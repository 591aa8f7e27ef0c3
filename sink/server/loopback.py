"""Loopback networking of local servers: the bind address, free ports and a plain client."""

from __future__ import annotations

import os
import socket

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from sink.errors import ServerProcessError

__all__ = ("LOOPBACK_HOST", "free_port", "server_client")

LOOPBACK_HOST = "127.0.0.1"


def free_port(*, with_cluster_bus: bool = False) -> int:
    """A loopback TCP port that is free right now. With ``with_cluster_bus`` the port + 10000 (the cluster
    bus) is free too, and both lie below the kernel's ephemeral range.

    :raises ServerProcessError: when no such port pair is free.
    """
    if not with_cluster_bus:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind((LOOPBACK_HOST, 0))
            return int(probe.getsockname()[1])
    rng = int.from_bytes(os.urandom(2), "big")
    for offset in range(2000):
        port = 12000 + (rng + offset * 7) % 10000
        if _port_is_free(port) and _port_is_free(port + 10000):
            return port
    raise ServerProcessError("no free port pair (port, port + 10000) for a cluster node")


def _port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((LOOPBACK_HOST, port))
        except OSError:
            return False
    return True


def server_client(port: int, *, timeout_s: float = 5.0) -> redis.Redis:
    """A synchronous, non-retrying client of the local server on ``port`` (close it, or use ``with``)."""
    return redis.Redis(
        host=LOOPBACK_HOST,
        port=port,
        socket_connect_timeout=min(timeout_s, 1.0),
        socket_timeout=timeout_s,
        retry=Retry(NoBackoff(), 0),
    )
