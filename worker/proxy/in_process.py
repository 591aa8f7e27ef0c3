"""Capture inside the inference server process: ``vllm serve ... --middleware worker.proxy.in_process.EnvCaptureMiddleware``.

vLLM builds each ``--middleware`` class with the app alone, so :class:`EnvCaptureMiddleware` reads its settings
from the environment and opens its Redis resources on the first request (in the server's event loop):

* ``STAGING_SINK_REDIS_URL`` (required), ``STAGING_SINK_NAMESPACE`` (default ``stg``);
* ``STAGING_SINK_UPSTREAM_KIND`` (``vllm`` or ``nemo-rl``), ``STAGING_SINK_FAIL_CLOSED`` (``1`` for 503s);
* ``STAGING_SINK_WEIGHT_VERSION`` (default 0);
* ``STAGING_SINK_PREFIX_MODE`` (``auto``, the default, ``exact`` or ``verify``): on the first request the wrapped app
  itself is probed for exact-prefix mode (vLLM 0.32 with ``--enable-scale-out``), as the forwarding proxy probes its
  engine; the probe's requests go to the wrapped app directly, never through capture.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import cast, get_args

import anyio
from anyio.abc import TaskGroup, TaskStatus

from sink.keys import DEFAULT_NAMESPACE
from sink.settings import ProxySettings, UpstreamKind
from worker.asgi import ASGIApp, Message, Receive, Scope, Send
from worker.proxy.app import ProxyApp
from worker.proxy.exact.mode import PrefixMode

__all__ = ("EnvCaptureMiddleware", "config_from_environment")


def config_from_environment(env: Mapping[str, str]) -> ProxySettings:
    """The capture settings of *env* (the upstream is the wrapped app itself, so ``upstream_url`` is unused).

    :raises ValueError: ``STAGING_SINK_REDIS_URL`` is missing or a value is invalid.
    """
    url = env.get("STAGING_SINK_REDIS_URL")
    if not url:
        raise ValueError("EnvCaptureMiddleware needs STAGING_SINK_REDIS_URL")
    kind = env.get("STAGING_SINK_UPSTREAM_KIND", "vllm")
    if kind not in get_args(UpstreamKind):
        raise ValueError(f"STAGING_SINK_UPSTREAM_KIND must be vllm or nemo-rl, got {kind!r}")
    prefix_mode = env.get("STAGING_SINK_PREFIX_MODE", "auto")
    if prefix_mode not in ("auto", "exact", "verify"):
        raise ValueError(f"STAGING_SINK_PREFIX_MODE must be auto, exact or verify, got {prefix_mode!r}")
    return ProxySettings(
        upstream_url="http://in-process",
        redis_url=url,
        namespace=env.get("STAGING_SINK_NAMESPACE") or DEFAULT_NAMESPACE,
        upstream_kind=cast(UpstreamKind, kind),
        fail_closed=env.get("STAGING_SINK_FAIL_CLOSED", "0") == "1",
        weight_version=int(env.get("STAGING_SINK_WEIGHT_VERSION", "0")),
        prefix_mode=cast(PrefixMode, prefix_mode),
    )


class EnvCaptureMiddleware:
    """Capture middleware around *app* (vLLM's OpenAI server), configured from the environment.

    The Redis resources open on the first request and close at lifespan shutdown. Both happen in one task of the
    lifespan's task group (resources that run tasks of their own must close in the task that opened them); a server
    without lifespan events opens them in the first request's task and never closes them before the process ends.
    """

    def __init__(self, app: ASGIApp, env: Mapping[str, str] | None = None) -> None:
        self.app = app
        self._proxy = ProxyApp(config_from_environment(os.environ if env is None else env))
        self._lock = anyio.Lock()
        self._owner: TaskGroup | None = None  # the lifespan's task group, where the resources live
        self._held = False  # the resources are open in a task of the lifespan's task group
        self._stop = anyio.Event()
        self._stopped = anyio.Event()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Capture ``http`` calls around the wrapped app; the Redis resources close at lifespan shutdown."""
        if scope["type"] == "lifespan":
            await self._lifespan(scope, receive, send)
            return
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self._proxy.middleware is None:
            async with self._lock:
                if self._proxy.middleware is None:
                    await self._open()
        middleware = self._proxy.middleware
        assert middleware is not None
        await middleware(scope, receive, send)

    async def _lifespan(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def closing_send(message: Message) -> None:
            if message["type"] == "lifespan.shutdown.complete":
                await self._close()
            await send(message)

        async with anyio.create_task_group() as owner:
            self._owner = owner
            try:
                await self.app(scope, receive, closing_send)
            finally:
                self._owner = None
                self._stop.set()  # the app's lifespan ended (or failed): let the resources close

    async def _open(self) -> None:
        if self._owner is None:  # no lifespan events: opened here, for the life of the process
            await self._proxy.open(inner=self.app)
            return
        await self._owner.start(self._hold)

    async def _hold(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Open the resources, then keep them until shutdown and close them, all in this one task."""
        try:
            await self._proxy.open(inner=self.app)
            self._held = True
            task_status.started()
            await self._stop.wait()
        finally:  # not shielded: a task group the resources entered must exit in this task's own cancel scope
            await self._proxy.aclose()
            self._stopped.set()

    async def _close(self) -> None:
        """Close the resources before the server hears that shutdown is complete."""
        self._stop.set()
        if self._held:
            await self._stopped.wait()
