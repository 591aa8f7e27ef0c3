"""The listen check of the HTTP services (``staging-sink proxy`` / ``engine``): fail with one line and
:data:`~sink_cli.context.EXIT_CANNOT_LISTEN` when the address cannot be bound, before uvicorn starts (uvicorn
would exit 3, the CLI's code for "server unreachable")."""

from __future__ import annotations

import socket

from sink_cli.common import EXIT_CANNOT_LISTEN, CommandError

__all__ = ("check_listen",)


def check_listen(host: str, port: int) -> None:
    """Bind *host*:*port* once (as uvicorn will, with ``SO_REUSEADDR``) and let go.

    :raises CommandError: (exit :data:`~sink_cli.context.EXIT_CANNOT_LISTEN`) the address cannot be bound
        (in use, not local, a privileged port) or *host* does not resolve.
    """
    try:
        family, kind, proto, _name, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(address)
    except OSError as exc:
        raise CommandError(
            f"cannot listen on {host}:{port}: {exc.strerror or exc} (another process may hold the port; "
            "pick another with --port)",
            exit_code=EXIT_CANNOT_LISTEN,
        ) from exc
