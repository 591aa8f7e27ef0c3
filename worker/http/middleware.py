"""ASGI capture middleware: the contract's gate and worker flow around an OpenAI-compatible app (§5, §6.6).

Per captured call (``POST /v1/chat/completions``, ``/v1/completions``, ``/v1/responses`` with a rollout id from
``/r/{rollout_id}/...`` or ``X-Staging-Rollout-Id``): admission with parent resolution from the request items,
``begin`` (the parent's exact prefix fetched from the staging chain), the inner app called with the fields that
return exact ids and log-probs, the delta staged durably **before** the response leaves, the ledger row
committed, and the token fields the client did not ask for stripped. A ``token_in`` call whose reported prompt
does not start with the parent's exact ids (re-tokenization drift) becomes a capture failure, never a wrong row.

Failure policy: fail-open (default, INV-4): a capture failure writes a failure row where the ledger can be
reached, logs one line and serves the completion; ``fail_closed=True`` answers 503 instead. Everything that is
not a captured call passes through unchanged; requests without a rollout id are forwarded and counted.
``POST /r/{rollout_id}/finished`` with ``{"reward": ...}`` announces the rollout's end (``finished()``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import anyio
import orjson

from sink.ledger.gate import CaptureGate
from sink.records import CaptureAdmission, CommitCoords

from ..call import ActiveCall
from ..capture import RolloutTokenCapture
from .asgi import (
    ASGIApp,
    BodyTooLargeError,
    Message,
    Receive,
    Scope,
    Send,
    error_body,
    header,
    read_body,
    replay_receive,
    send_body,
    send_json,
)
from .metrics import ProxyMetrics
from .routes import (
    CAPTURE_ROUTES,
    ROLLOUT_HEADER,
    RouteKind,
    UpstreamKind,
    adapter_for,
    parse_target,
    request_items,
    response_items,
    strip_token_fields,
    upstream_request,
)
from .sse import sse_events

__all__ = ("METRICS_PATH", "Announce", "CaptureMiddleware", "CapturePolicy")

logger = logging.getLogger(__name__)

METRICS_PATH = "/staging-sink/metrics"
Announce = Callable[[str, float | None, Any, str | None], Awaitable[str]]
"""``(rollout_id, reward, response, declared_response_id) -> event id``: :func:`sink.done_event.finished` bound."""


@dataclass(frozen=True)
class CapturePolicy:
    """How the middleware captures."""

    upstream_kind: UpstreamKind = "vllm"
    fail_closed: bool = False
    max_request_bytes: int = 64 * 1024 * 1024
    max_response_bytes: int = 64 * 1024 * 1024
    """A larger upstream response is served but not captured (capture failure)."""


@dataclass
class _Upstream:
    status: int
    headers: list[tuple[bytes, bytes]]
    body: bytes
    oversized: bool


class CaptureMiddleware:
    """Capture around *app* (a forwarding app, or vLLM's own OpenAI server via ``--middleware``)."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        capture: RolloutTokenCapture,
        gate: CaptureGate,
        policy: CapturePolicy | None = None,
        announce: Announce | None = None,
        metrics: ProxyMetrics | None = None,
    ) -> None:
        self.app = app
        self.capture = capture
        self.gate = gate
        self.policy = policy or CapturePolicy()
        self.announce = announce
        self.metrics = metrics or ProxyMetrics()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Route one ASGI event: finished, metrics, a captured call, or pass-through."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if scope["method"] == "GET" and scope["path"] == METRICS_PATH:
            await send_body(send, 200, self.metrics.exposition(), b"text/plain; version=0.0.4")
            return
        try:
            target = parse_target(scope["path"], header(scope, ROLLOUT_HEADER))
        except ValueError as exc:
            await send_body(send, 400, error_body(400, str(exc), "InvalidRolloutId"))
            return
        if target.finished and target.rollout_id is not None and scope["method"] == "POST":
            await self._finished(target.rollout_id, receive, send)
            return
        inner = (
            scope if target.path == scope["path"] else {**scope, "path": target.path, "raw_path": target.path.encode()}
        )
        route = CAPTURE_ROUTES.get(target.path) if scope["method"] == "POST" else None
        if route is None:
            await self.app(inner, receive, send)
            return
        if target.rollout_id is None:
            self.metrics.count("uncaptured")
            await self.app(inner, receive, send)
            return
        await self._captured(route, target.rollout_id, inner, receive, send)

    # --- finished -----------------------------------------------------------

    async def _finished(self, rollout_id: str, receive: Receive, send: Send) -> None:
        if self.announce is None:
            await send_body(send, 501, error_body(501, "this proxy cannot announce finished rollouts", "NotConfigured"))
            return
        try:
            body = orjson.loads(await read_body(receive, 1 << 20))
            if not isinstance(body, dict) or set(body) - {"reward", "response", "declared_response_id"}:
                raise ValueError('body must be {"reward": number|null[, "response": ..., "declared_response_id": str]}')
            event = await self.announce(
                rollout_id, body.get("reward"), body.get("response"), body.get("declared_response_id")
            )
        except (ValueError, TypeError, BodyTooLargeError) as exc:
            await send_body(send, 422, error_body(422, str(exc), "InvalidFinished"))
            return
        except Exception as exc:  # noqa: BLE001 -- the store failed: answer 503 so the harness retries
            logger.error("cannot announce that rollout %s finished: %r", rollout_id, exc)
            await send_body(send, 503, error_body(503, f"cannot announce finished: {exc!r}", "StoreUnavailable"))
            return
        logger.info("rollout %s finished (event %s)", rollout_id, event)
        await send_json(send, 200, {"rollout_id": rollout_id, "event_id": event})

    # --- captured calls -------------------------------------------------------

    async def _uncaptured(self, scope: Scope, body: bytes, receive: Receive, send: Send) -> None:
        self.metrics.count("uncaptured")
        await self.app(scope, replay_receive(body, receive), send)

    async def refuse(self, send: Send, reason: str) -> None:
        """Answer 503 for a call that could not be captured (``fail_closed``)."""
        await send_body(
            send, 503, error_body(503, f"capture failed ({reason}); --fail-closed refuses", "CaptureFailed")
        )

    async def _captured(self, route: RouteKind, rollout_id: str, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            body = await read_body(receive, self.policy.max_request_bytes)
        except BodyTooLargeError as exc:
            await send_body(send, 413, error_body(413, str(exc), "RequestTooLarge"))
            return
        try:
            request = orjson.loads(body)
            if not isinstance(request, dict):
                raise TypeError("not a JSON object")
            items = request_items(route, request)
            if request.get("n", 1) != 1:
                raise ValueError("capture needs n == 1")
        except (TypeError, ValueError) as exc:  # the upstream answers the malformed request itself
            logger.warning("rollout %s: request not captured (%s); forwarded as is", rollout_id, exc)
            await self._uncaptured(scope, body, receive, send)
            return
        admitted_at = time.time()
        try:
            admission = await self.gate.admit(rollout_id, items)
        except Exception as exc:  # noqa: BLE001 -- the ledger is unreachable: fail open (or closed) as configured
            logger.error("rollout %s: capture admission failed (ledger unreachable?): %r", rollout_id, exc)
            self.metrics.count("capture_failed")
            if self.policy.fail_closed:
                await self.refuse(send, "ledger unreachable")
            else:
                await self.app(scope, replay_receive(body, receive), send)
            return
        if admission is None:
            logger.warning(
                "rollout %s: no admission (retired rollout or unresolved parent); served uncaptured", rollout_id
            )
            if self.policy.fail_closed:
                self.metrics.count("capture_failed")
                await self.refuse(send, "no admission")
                return
            await self._uncaptured(scope, body, receive, send)
            return
        await _CapturedCall(self, route, scope, request, items, admission, admitted_at).run(receive, send)


async def _client_gone(receive: Receive) -> bool:
    """Whether the client already disconnected (a non-blocking look at ``receive``)."""
    with anyio.move_on_after(0):
        message = await receive()
        return bool(message["type"] == "http.disconnect")
    return False


class _CapturedCall:
    """One admitted call through begin, upstream, stage, commit and the reply."""

    def __init__(
        self,
        owner: CaptureMiddleware,
        route: RouteKind,
        scope: Scope,
        request: dict[str, Any],
        items: list[dict[str, Any]],
        admission: CaptureAdmission,
        admitted_at: float,
    ) -> None:
        self.owner, self.route, self.scope, self.request, self.items = owner, route, scope, request, items
        self.admission, self.admitted_at = admission, admitted_at
        self.ids = f"rollout {admission.rollout_id} call {admission.model_call_id}"
        self.settled = False
        self.captured = False

    async def _settle(
        self, active: ActiveCall | None, coords: CommitCoords | None, payload: dict[str, Any] | None
    ) -> None:
        """Commit *coords* (or a failure) to the ledger; shielded, so a cancelled request never half-writes."""
        with anyio.CancelScope(shield=True):
            try:
                if coords is None:
                    coords = (
                        self.owner.capture.fail_admission(self.admission, reason="no completion")
                        if active is None or active.completed
                        else await self.owner.capture.afail_call(active, reason="the call ended without a completion")
                    )
                response_id = "" if payload is None else str(payload.get("id") or "")
                served = [] if payload is None else response_items(self.route, payload)
                row = await self.owner.gate.commit(
                    self.admission,
                    coords,
                    response_id=response_id,
                    request_items=self.items,
                    response_items=served,
                    admitted_at=self.admitted_at,
                )
                self.captured = row is not None
            except Exception as exc:  # noqa: BLE001 -- the ledger failed after the stage: the call is not captured
                logger.error("%s: ledger commit failed: %r (staged tokens have no ledger row)", self.ids, exc)
                self.captured = False
            finally:
                self.settled = True

    async def _upstream(self, body: bytes, receive: Receive) -> _Upstream:
        result = _Upstream(502, [], b"", oversized=False)
        chunks: list[bytes] = []
        size = 0
        limit = self.owner.policy.max_response_bytes

        async def collect(message: Message) -> None:
            nonlocal size
            if message["type"] == "http.response.start":
                result.status = message["status"]
                result.headers = list(message.get("headers", ()))
            elif message["type"] == "http.response.body":
                chunk = message.get("body", b"")
                size += len(chunk)
                if size > limit:
                    result.oversized = True
                chunks.append(chunk)

        await self.owner.app(self.scope, replay_receive(body, receive), collect)
        result.body = b"".join(chunks)
        return result

    async def run(self, receive: Receive, send: Send) -> None:
        owner, metrics = self.owner, self.owner.metrics
        active: ActiveCall | None = None
        payload: dict[str, Any] | None = None
        try:
            try:
                active = await owner.capture.abegin_call(self.admission)
            except Exception as exc:  # noqa: BLE001 -- e.g. an invalid weight version: serve uncaptured (INV-4)
                logger.error("%s: begin failed: %r; served uncaptured", self.ids, exc)
                await self._settle(None, None, None)
                metrics.count("capture_failed")
                if owner.policy.fail_closed:
                    await owner.refuse(send, "begin failed")
                else:
                    await owner.app(self.scope, replay_receive(orjson.dumps(self.request), receive), send)
                return
            prefix = active.prefix_token_ids if not active.capture_failed else []
            upstream_body, asked = upstream_request(self.route, self.request, owner.policy.upstream_kind, prefix)
            started = time.perf_counter()
            upstream = await self._upstream(orjson.dumps(upstream_body), receive)
            metrics.observe(upstream_s=time.perf_counter() - started)
            staged_at = time.perf_counter()
            coords, payload = await self._complete(active, upstream)
            if payload is not None:
                strip_token_fields(self.route, payload, asked)
            await self._settle(active, coords, payload)
            metrics.observe(stage_s=time.perf_counter() - staged_at)
        finally:
            if not self.settled:
                await self._settle(active, None, None)
                logger.warning("%s: request ended before its capture completed; recorded as failed", self.ids)
        metrics.count("captured" if self.captured else "capture_failed")
        if await _client_gone(receive):
            logger.warning(
                "%s: client disconnected mid-call; the call was %s before the response was dropped",
                self.ids,
                "committed" if self.captured else "recorded as failed",
            )
            return
        if not self.captured and owner.policy.fail_closed:
            await owner.refuse(send, "see the proxy log")
            return
        await self._reply(upstream, payload, receive, send)

    async def _complete(self, active: ActiveCall, upstream: _Upstream) -> tuple[CommitCoords, dict[str, Any] | None]:
        """Stage the call from the upstream response (or fail it); the parsed payload when it is JSON."""
        capture = self.owner.capture
        if upstream.status != 200:
            logger.warning("%s: upstream answered %d; capture failed", self.ids, upstream.status)
            return await capture.afail_call(active, reason=f"upstream status {upstream.status}"), None
        try:
            payload = orjson.loads(upstream.body)
            if not isinstance(payload, dict):
                raise TypeError("not a JSON object")
        except (TypeError, ValueError) as exc:
            logger.warning("%s: upstream response is not a JSON object (%s); capture failed", self.ids, exc)
            return await capture.afail_call(active, reason="upstream response is not JSON"), None
        if upstream.oversized:
            logger.warning(
                "%s: upstream response of %d bytes exceeds max_response_bytes=%d; capture failed",
                self.ids,
                len(upstream.body),
                self.owner.policy.max_response_bytes,
            )
            return await capture.afail_call(active, reason="oversized response"), payload
        adapter = adapter_for(self.route)
        try:
            prompt = adapter.extract_prompt_ids(payload)
            generated, logprobs = adapter.extract_generation(payload)
            extras = adapter.extract_extras(payload)
        except Exception as exc:  # noqa: BLE001 -- any malformed payload poisons, never fails the completion
            logger.warning("%s: malformed engine payload (%s); capture failed", self.ids, exc)
            return await capture.afail_call(active, reason=f"malformed engine payload: {exc}"), payload
        with anyio.CancelScope(shield=True):  # the stage completes or the call is recorded failed, never half
            coords = await capture.acomplete_call(
                active,
                prompt_token_ids=prompt,
                generated_token_ids=generated,
                generated_logprobs=logprobs,
                extras=extras,
            )
        if coords.disposition != "staged":
            logger.warning("%s: not staged (prefix drift, store refusal or invalid ids: see above)", self.ids)
        return coords, payload

    async def _reply(self, upstream: _Upstream, payload: dict[str, Any] | None, receive: Receive, send: Send) -> None:
        if payload is None:  # upstream error or non-JSON: passed through as received
            self.owner.metrics.observe(nbytes=len(upstream.body))
            await send({"type": "http.response.start", "status": upstream.status, "headers": upstream.headers})
            await send({"type": "http.response.body", "body": upstream.body, "more_body": False})
            return
        if self.request.get("stream") is True:
            options = self.request.get("stream_options")
            usage = isinstance(options, dict) and options.get("include_usage") is True
            body, content_type = sse_events(self.route, payload, include_usage=usage), b"text/event-stream"
        else:
            body, content_type = orjson.dumps(payload), b"application/json"
        self.owner.metrics.observe(nbytes=len(body))
        await send_body(send, 200, body, content_type)
