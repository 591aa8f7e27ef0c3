"""Loopback networking of local servers: the bind address, free ports and a plain client."""

from __future__ import annotations

import os
import socket
import threading
from collections import deque

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from sink.errors import ServerProcessError

__all__ = ("LOOPBACK_HOST", "free_port", "server_client")

LOOPBACK_HOST = "127.0.0.1"


_RECENT_PORTS = 1024
"""How many of the ports it handed out :func:`free_port` remembers and does not hand out again."""
_handed_out: deque[int] = deque(maxlen=_RECENT_PORTS)
_handed_out_lock = threading.Lock()


def free_port(*, with_cluster_bus: bool = False) -> int:
    """A loopback TCP port that is free right now, in 12000-21999: below the kernel's ephemeral range (from 32768
    by default), so no outgoing connection takes it between this call and the caller's bind. With
    ``with_cluster_bus`` the port + 10000 (the cluster bus, below that range too) is free as well. A port this
    process was handed out recently is never handed out again, bound yet or not: a caller that takes several ports
    before starting the servers that bind them gets distinct ones.

    :raises ServerProcessError: when no such port (or port pair) is free.
    """
    rng = int.from_bytes(os.urandom(2), "big")
    with _handed_out_lock:
        for offset in range(2000):
            port = 12000 + (rng + offset * 7) % 10000
            if port in _handed_out or (with_cluster_bus and port + 10000 in _handed_out):
                continue
            if _port_is_free(port) and (not with_cluster_bus or _port_is_free(port + 10000)):
                _handed_out.extend((port, port + 10000) if with_cluster_bus else (port,))
                return port
    wanted = "port pair (port, port + 10000) for a cluster node" if with_cluster_bus else "loopback port"
    raise ServerProcessError(f"no free {wanted} in 12000-21999")


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
