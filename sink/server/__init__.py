"""Private, durable Redis/Valkey servers: the embedded default, the test fixtures and ``staging-sink server``."""

from __future__ import annotations

from .durable import (
    LOOPBACK_HOST,
    DurableServer,
    ServerNotFoundError,
    ServerProcessError,
    durable_server,
    find_server_binary,
    free_port,
    serve_forever,
    server_client,
    server_version,
)

__all__ = (
    "LOOPBACK_HOST",
    "DurableServer",
    "ServerNotFoundError",
    "ServerProcessError",
    "durable_server",
    "find_server_binary",
    "free_port",
    "serve_forever",
    "server_client",
    "server_version",
)
