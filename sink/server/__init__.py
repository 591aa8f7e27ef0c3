"""Private, durable Redis/Valkey servers: the embedded default, the test fixtures and ``staging-sink server``.

One module per role: :mod:`~sink.server.binary` finds the server and client binaries and their version,
:mod:`~sink.server.loopback` picks free loopback ports and makes plain clients, :mod:`~sink.server.children`
makes sure no child process outlives its owner, and :mod:`~sink.server.durable` runs one durable server
process (:class:`DurableServer`). This package re-exports their public names; :mod:`sink_tools.cluster` builds a
local cluster of such servers.
"""

from __future__ import annotations

from sink.errors import ServerNotFoundError, ServerProcessError
from sink.server.binary import find_cli_binary, find_server_binary, server_version
from sink.server.durable import DurableServer, serve_forever
from sink.server.loopback import LOOPBACK_HOST, free_port, server_client

__all__ = (
    "LOOPBACK_HOST",
    "DurableServer",
    "ServerNotFoundError",
    "ServerProcessError",
    "find_cli_binary",
    "find_server_binary",
    "free_port",
    "serve_forever",
    "server_client",
    "server_version",
)
