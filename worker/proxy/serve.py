"""Run an ASGI app under uvicorn on loopback in a background thread (tests, the benchmark, ``demo --http``)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import uvicorn

from worker.asgi import ASGIApp
from worker.errors import ServerStartError

__all__ = ("running_server",)


@contextlib.contextmanager
def running_server(
    app: ASGIApp, *, host: str = "127.0.0.1", port: int = 0, start_timeout_s: float = 15.0, **options: Any
) -> Iterator[str]:
    """Serve *app* with uvicorn in a daemon thread; yields its base URL (``http://host:port``); stops on exit.

    :raises ServerStartError: the server did not come up within *start_timeout_s*.
    """
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level="warning",
        lifespan="on",
        access_log=False,
        timeout_graceful_shutdown=2,
        **options,
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name=f"uvicorn-{port}", daemon=True)
    thread.start()
    deadline = time.monotonic() + start_timeout_s
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            thread.join(5)
            raise ServerStartError(f"uvicorn did not start on {host}:{port}")
        time.sleep(0.01)
    bound = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://{host}:{bound}"
    finally:
        server.should_exit = True
        thread.join(10)
