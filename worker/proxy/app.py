"""The capture proxy application: :class:`~worker.proxy.middleware.CaptureMiddleware` over a forwarding app.

:class:`ProxyApp` is an ASGI app whose lifespan opens the Redis resources (staging sink, source for
``staging_chain`` prefixes, capture ledger, a client for ``finished``) and closes them with the upstream pool.
``capture=False`` gives the bare forwarding proxy (same server stack, no capture) the benchmark compares against.
All state lives in Redis, so any number of proxy processes may serve one rollout's calls.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster

from sink.contract.chains import ChainPolicy
from sink.ledger.gate import CaptureGate
from sink.ledger.redis import RedisCaptureLedger
from sink.rollout.done_event import finished
from sink.settings import LedgerSettings, ProxySettings, SinkSettings, SourceSettings
from sink.store.sink import AsyncRedisStagingSink
from sink.store.source import AsyncRedisStagingSource
from worker.asgi import ASGIApp, Receive, Scope, Send, error_body, send_body
from worker.capture import RolloutTokenCapture
from worker.errors import StagingModeError
from worker.proxy.exact.completions import ExactCompletions
from worker.proxy.exact.mode import PrefixModeChoice
from worker.proxy.forward import ForwardingApp
from worker.proxy.metrics import ProxyMetrics
from worker.proxy.middleware import CaptureMiddleware
from worker.proxy.routes import parse_target
from worker.weight_version import PublishedWeightVersion, WeightLabelRule

__all__ = ("ProxyApp",)

logger = logging.getLogger(__name__)


class ProxyApp:
    """ASGI app: the forwarding app, wrapped in capture when configured; lifespan owns the resources."""

    def __init__(self, config: ProxySettings) -> None:
        self.config = config
        self.forward = ForwardingApp(config.upstream_url, timeout_s=config.upstream_timeout_s)
        self.metrics = ProxyMetrics()
        self.middleware: CaptureMiddleware | None = None
        self._stack = contextlib.AsyncExitStack()

    async def open(self, inner: ASGIApp | None = None) -> None:
        """Open the Redis resources and build the middleware around *inner* (default: the forwarder); idempotent."""
        config = self.config
        if not config.capture or self.middleware is not None:
            return
        self.metrics.attach()
        self._stack.callback(self.metrics.detach)
        timeouts: dict[str, Any] = {
            "namespace": config.namespace,
            "cluster": config.cluster,
            "connect_timeout_s": config.redis_timeout_s,
            "command_timeout_s": config.redis_timeout_s,
            "durability": config.durability,  # every acknowledged write: staged records, ledger rows, finished
        }
        stack = self._stack
        sink = await stack.enter_async_context(
            AsyncRedisStagingSink.from_url(config.redis_url, SinkSettings(**timeouts))
        )
        source = await stack.enter_async_context(
            AsyncRedisStagingSource.from_url(config.redis_url, SourceSettings(**timeouts))
        )
        gate_url = config.gate_redis_url or config.redis_url
        ledger = await stack.enter_async_context(RedisCaptureLedger.from_url(gate_url, LedgerSettings(**timeouts)))
        client: aioredis.Redis | RedisCluster = (
            RedisCluster.from_url(gate_url, socket_timeout=config.redis_timeout_s)
            if config.cluster
            else aioredis.Redis.from_url(gate_url, socket_timeout=config.redis_timeout_s)
        )
        stack.push_async_callback(client.aclose)
        weight_version = config.weight_version

        async def announce(rollout_id: str, fields: dict[str, Any]) -> str:
            return await finished(
                client, rollout_id, namespace=config.namespace, durability=config.durability, **fields
            )

        capture = RolloutTokenCapture(sink=sink, weight_version_fn=lambda: weight_version, source=source)
        self.middleware = CaptureMiddleware(
            inner or self.forward,
            capture=capture,
            gate=CaptureGate(ledger, chain_policy=ChainPolicy(config.chain_policy)),
            settings=config,
            announce=announce,
            metrics=self.metrics,
        )
        self.middleware.exact_completions = ExactCompletions(client, config.namespace, ttl_s=config.exact_text_ttl_s)
        if gate_url == config.redis_url:  # one connection user may write both: the row rides behind its stage
            self.middleware.rows_behind_stages = ledger
        if config.weight_source == "published":
            self.middleware.published = PublishedWeightVersion(
                client, config.namespace, max_staleness_s=config.weight_staleness_s
            )
        try:
            await self._choose_prefix_mode(inner or self.forward)
        except BaseException:  # the start fails: nothing opened above stays open
            self.middleware = None
            await stack.aclose()
            await self.forward.aclose()
            raise

    async def _choose_prefix_mode(self, engine: ASGIApp) -> None:
        """Probe *engine* (the forwarder, or vLLM's own app in-process) for exact-prefix mode; one log line says which
        mode and why. A ``nemo-rl`` upstream is not probed: it starts each continuation with the parent's exact ids
        itself (``required_prefix_token_ids``).

        :raises StagingModeError: see :meth:`PrefixModeChoice.start`; ``weight_source="engine"`` with ``nemo-rl``.
        """
        config, middleware = self.config, self.middleware
        assert middleware is not None
        if config.upstream_kind == "nemo-rl":
            if config.weight_source == "engine":
                raise StagingModeError("weight_source=engine needs exact-prefix mode, not upstream_kind=nemo-rl")
            logger.info(
                "prefix mode: required_prefix_token_ids (upstream_kind=nemo-rl: the engine starts each continuation "
                "with its parent's exact ids; prefix_mode=%s not probed)",
                config.prefix_mode,
            )
            return
        labels = WeightLabelRule(default_version=config.weight_version) if config.weight_source == "engine" else None
        choice = PrefixModeChoice(engine, config.prefix_mode, labels, middleware.metrics)
        await choice.start()
        middleware.prefix_mode = choice
        if choice.exact is not None:
            logger.info("prefix mode: /v1/responses stays in verify mode (vLLM 0.32 has no responses derender route)")

    async def aclose(self) -> None:
        """Close the Redis resources and the upstream pool."""
        self.middleware = None
        await self._stack.aclose()
        await self.forward.aclose()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Serve one ASGI event."""
        if scope["type"] == "lifespan":
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    await self.open()
                except Exception as exc:  # noqa: BLE001 -- reported to the server, which exits
                    await send({"type": "lifespan.startup.failed", "message": repr(exc)})
                    return
                await send({"type": "lifespan.startup.complete"})
                message = await receive()
            if message["type"] == "lifespan.shutdown":
                await self.aclose()
                await send({"type": "lifespan.shutdown.complete"})
            return
        if self.middleware is not None:
            await self.middleware(scope, receive, send)
            return
        if scope["type"] == "http" and scope["path"].startswith("/r/"):
            # Capture off: agents configured with rollout routes still reach the engine.
            try:
                target = parse_target(scope["path"], None)
            except ValueError as exc:
                await send_body(send, 400, error_body(400, str(exc), "InvalidRolloutId"))
                return
            scope = {**scope, "path": target.path, "raw_path": target.path.encode()}
        await self.forward(scope, receive, send)
