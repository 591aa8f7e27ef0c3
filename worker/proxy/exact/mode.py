"""Exact-prefix mode in the capture proxy: the chosen mode, and chat calls served over render/generate/derender.

At start the proxy probes the engine (:func:`worker.proxy.exact.probe.probe_exact_prefix`) through the app it wraps (the
forwarder, or vLLM's own app in-process) and logs one line saying which mode it uses and why. ``prefix_mode``:
``auto`` (default) uses exact where the engine supports it, ``exact`` refuses to start without it, ``verify``
keeps verify mode. In exact mode a captured chat call goes through :func:`worker.proxy.exact.chat.exact_chat`: a
continuation's prompt is the parent's exact staged sequence plus the rendered suffix, so history is never
re-templated; the answer has vLLM's ``return_token_ids`` shape, so it is staged like any vLLM answer, and its
``weight_versions`` spans stamp the call's weight version (:mod:`worker.weight_version`) when a label rule is set.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Literal

import anyio
import orjson

from worker.asgi import ASGIApp, Message
from worker.errors import StagingModeError
from worker.proxy.call_timing import engine_span
from worker.proxy.exact.chat import EngineTraits, ExactAnswer, Parent, Rendering, exact_chat, render_chat
from worker.proxy.exact.probe import ExactProbe, probe_exact_prefix
from worker.proxy.metrics import ProxyMetrics
from worker.weight_version import WeightLabelRule, WeightVersionError, version_of_spans

__all__ = ("ExactMode", "PrefixMode", "PrefixModeChoice", "sub_request", "without_spans")

logger = logging.getLogger(__name__)

PrefixMode = Literal["auto", "exact", "verify"]


async def sub_request(app: ASGIApp, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    """Call *app* with one JSON request (no client connection); returns the status and the parsed JSON body."""
    raw = b"" if body is None else orjson.dumps(body)
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json"), (b"accept-encoding", b"identity")],
        "client": ("127.0.0.1", 0),
        "server": ("127.0.0.1", 0),
    }
    sent = False
    status = 502
    chunks: list[bytes] = []

    async def receive() -> Message:
        nonlocal sent
        if sent:
            return {"type": "http.disconnect"}
        sent = True
        return {"type": "http.request", "body": raw, "more_body": False}

    async def send(message: Message) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))

    await app(scope, receive, send)
    data = b"".join(chunks)
    try:
        return status, orjson.loads(data) if data else None
    except orjson.JSONDecodeError:
        return status, {"error": {"message": data[:200].decode(errors="replace"), "code": status}}


def without_spans(payload: dict[str, Any]) -> dict[str, Any]:
    """*payload* without ``weight_versions`` on its choices and without its token fields: nothing to stage."""
    for choice in payload.get("choices") or ():
        if isinstance(choice, dict):
            choice.pop("weight_versions", None)
            choice.pop("token_ids", None)
    return payload


@dataclass(frozen=True)
class ExactMode:
    """Exact-prefix chat calls on one engine app."""

    app: ASGIApp
    probe: ExactProbe
    labels: WeightLabelRule | None = None
    """How the engine's weight labels map to versions; ``None``: the proxy's configured version stamps calls."""
    metrics: ProxyMetrics | None = None
    """Where every engine round trip's latency is observed (``staging_proxy_upstream_seconds{route}``)."""

    @property
    def traits(self) -> EngineTraits:
        """What the probe learned of the engine."""
        return self.probe.traits or EngineTraits(self.probe.eot_ids)

    async def call(self, path: str, body: dict[str, Any]) -> tuple[int, Any]:
        """``POST`` *body* to *path* on the engine: its status and parsed JSON body (its latency observed)."""
        with engine_span() as span:
            answer = await sub_request(self.app, "POST", path, body)
        if self.metrics is not None:
            self.metrics.observe(upstream_s=span.seconds, route=path)
        return answer

    async def render(self, request: dict[str, Any]) -> Rendering:
        """Render *request* and its history with the engine's template (an error: nothing can be generated)."""
        return await render_chat(self.call, request, self.probe.eot_ids)

    async def chat(self, request: dict[str, Any], rendering: Rendering, parent: Parent | None) -> ExactAnswer:
        """Finish one rendered chat request exactly (:func:`worker.proxy.exact.chat.exact_chat`).

        :raises worker.errors.ContextChangedError: *parent* was rendered from another context.
        :raises worker.errors.SpliceError: the request cannot be spliced onto *parent*.
        """
        return await exact_chat(self.call, request, parent=parent, traits=self.traits, rendering=rendering)

    def weight_version_of(self, payload: dict[str, Any]) -> int | None:
        """The call's weight version from the answer's spans (the oldest), or ``None`` without a label rule.

        :raises worker.weight_version.WeightVersionError: spans that do not tile the output, or a refused label.
        """
        if self.labels is None:
            return None
        choice = payload["choices"][0]
        return version_of_spans(choice.get("weight_versions") or [], len(choice["token_ids"]), self.labels)


async def _decide(
    app: ASGIApp, mode: PrefixMode, labels: WeightLabelRule | None, metrics: ProxyMetrics | None
) -> ExactMode | None | ExactProbe:
    """The mode for the engine behind *app*: an :class:`ExactMode`, ``None`` (verify), or the probe when the engine
    did not answer. One log line says which and why.

    :raises StagingModeError: ``mode == "exact"`` without engine support; ``labels`` set (weights from the engine)
        without exact mode, or refusing the engine's current weight label (``GET /weight_info``).
    """
    if mode == "verify":
        if labels is not None:
            raise StagingModeError("weight_source=engine needs exact-prefix mode, but prefix_mode=verify")
        logger.info("prefix mode: verify (forced by prefix_mode=verify)")
        return None

    async def post(path: str, body: dict[str, Any]) -> tuple[int, Any]:
        return await sub_request(app, "POST", path, body)

    async def get(path: str) -> tuple[int, Any]:
        return await sub_request(app, "GET", path)

    probe = await probe_exact_prefix(post, get)
    if probe.mode == "unreachable":
        return probe
    if probe.mode != "exact":
        if mode == "exact" or labels is not None:
            why = "prefix_mode=exact" if mode == "exact" else "weight_source=engine"
            raise StagingModeError(f"{why}, but the engine does not support exact-prefix mode: {probe.reason}")
        logger.warning("prefix mode: verify (%s)", probe.reason)
        return None
    if labels is not None:
        status, info = await get("/weight_info")
        if status == 200 and isinstance(info, dict):
            try:
                labels.version_of(info.get("weight_version"))
            except WeightVersionError as exc:
                raise StagingModeError(f"GET /weight_info: {exc}") from exc
    logger.info("prefix mode: exact (%s; end-of-turn ids %s)", probe.reason, sorted(probe.eot_ids))
    return ExactMode(app, probe, labels, metrics)


class PrefixModeChoice:
    """The proxy's prefix mode: probed at start, or on the first chat call when the engine was not up yet.

    ``prefix_mode="exact"`` (or weights from the engine) needs the engine up at start: it is refused otherwise. With
    ``auto`` an engine that did not answer at start is probed again on each chat call until it answers; those calls
    are served in verify mode. Once decided, the mode never changes.
    """

    def __init__(
        self,
        app: ASGIApp | None,
        mode: PrefixMode = "verify",
        labels: WeightLabelRule | None = None,
        metrics: ProxyMetrics | None = None,
    ):
        self._app, self._mode, self._labels, self._metrics = app, mode, labels, metrics
        self._decided = app is None
        self._exact: ExactMode | None = None
        self._lock = anyio.Lock()

    @property
    def exact(self) -> ExactMode | None:
        """The exact mode once decided (``None``: verify mode, or not decided yet)."""
        return self._exact

    async def start(self) -> None:
        """The start-up probe.

        :raises StagingModeError: see :func:`_decide`; also ``exact`` (or engine weights) with the engine unreachable.
        """
        assert self._app is not None
        outcome = await _decide(self._app, self._mode, self._labels, self._metrics)
        if isinstance(outcome, ExactProbe):
            if self._mode == "exact" or self._labels is not None:
                raise StagingModeError(f"the engine did not answer the start-up probe ({outcome.reason})")
            logger.warning("prefix mode: undecided (%s); probed again on the next chat call", outcome.reason)
            return
        self._exact, self._decided = outcome, True

    async def current(self) -> ExactMode | None:
        """The mode for one chat call (probing first if not decided; ``None`` while the engine does not answer).

        Only ``auto`` without engine weights is ever deferred, and :func:`_decide` never refuses that.
        """
        if self._decided:
            return self._exact
        async with self._lock:
            if not self._decided and self._app is not None:
                outcome = await _decide(self._app, self._mode, self._labels, self._metrics)
                if not isinstance(outcome, ExactProbe):
                    self._exact, self._decided = outcome, True
        return self._exact
