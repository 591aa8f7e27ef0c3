"""ASGI capture middleware: the contract's gate and worker flow around an OpenAI-compatible app (contract §5, §6.6, §12).

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

import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import orjson

from sink.errors import StagingError
from sink.ledger.gate import CaptureGate
from sink.ledger.redis import RedisCaptureLedger
from sink.settings import ProxySettings
from sink.trainer.weights import WeightVersionKeyError
from worker.asgi import (
    ASGIApp,
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
from worker.capture import RolloutTokenCapture
from worker.errors import BodyTooLargeError
from worker.proxy.call_timing import call_clock
from worker.proxy.captured_call import CapturedCall
from worker.proxy.exact.completions import ExactCompletions
from worker.proxy.exact.mode import PrefixModeChoice
from worker.proxy.metrics import ProxyMetrics
from worker.proxy.routes import (
    CAPTURE_ROUTES,
    PASSTHROUGH_POSTS,
    ROLLOUT_HEADER,
    ClientAsked,
    RouteKind,
    Target,
    canonical_path,
    chains_of,
    disguised_capture_route,
    parse_target,
    request_items,
    strip_token_fields,
)
from worker.proxy.upstream import call_inner
from worker.weight_version import PublishedWeightVersion

__all__ = ("METRICS_PATH", "Announce", "CaptureMiddleware")

logger = logging.getLogger(__name__)

METRICS_PATH = "/staging-sink/metrics"
Announce = Callable[[str, dict[str, Any]], Awaitable[str]]
"""``(rollout_id, fields) -> event id``: :func:`sink.rollout.done_event.finished` bound, *fields* its keyword
arguments (``reward``, and any of ``response``, ``declared_response_id``, ``group_id``, ``group_size``)."""
_FINISHED_FIELDS = frozenset({"reward", "response", "declared_response_id", "group_id", "group_size"})


class CaptureMiddleware:
    """Capture around *app* (a forwarding app, or vLLM's own OpenAI server via ``--middleware``)."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        capture: RolloutTokenCapture,
        gate: CaptureGate,
        settings: ProxySettings,
        announce: Announce | None = None,
        metrics: ProxyMetrics | None = None,
    ) -> None:
        self.app = app
        self.capture = capture
        self.gate = gate
        self.settings = settings
        self.announce = announce
        self.metrics = metrics or ProxyMetrics()
        self.prefix_mode = PrefixModeChoice(None)
        """Verify mode, unless the proxy sets the outcome of its start-up probe (exact-prefix chat calls)."""
        self.exact_completions: ExactCompletions | None = None
        """The exact-text index of ``/v1/completions`` calls, set by the proxy (exact-prefix completions)."""
        self.rows_behind_stages: RedisCaptureLedger | None = None
        """Set by the proxy when the gate's ledger and the sink share a connection user: each call's ledger row is
        sent behind its stage, in the same round trip (one durable round per captured call, contract §6.6)."""
        self.published: PublishedWeightVersion | None = None
        """The trainer's published weight version, when calls are stamped with it (``weight_source="published"``)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Route one ASGI event: finished, metrics, a captured call, or pass-through."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if scope["method"] == "GET" and scope["path"] == METRICS_PATH:
            await send_body(send, 200, self.metrics.exposition(), b"text/plain; version=0.0.4")
            return
        path = canonical_path(scope["path"])  # route what the engine will see, whatever the spelling
        try:
            target = parse_target(path, header(scope, ROLLOUT_HEADER))
        except ValueError as exc:
            await send_body(send, 400, error_body(400, str(exc), "InvalidRolloutId"))
            return
        try:
            chains_of(scope)  # read again at admission; refused here, before anything is forwarded
        except ValueError as exc:
            await send_body(send, 400, error_body(400, str(exc), "InvalidChainPolicy"))
            return
        if target.path not in CAPTURE_ROUTES and disguised_capture_route(target.path):
            await send_body(send, 400, error_body(400, f"path {scope['path']!r} is ambiguously encoded", "InvalidPath"))
            return
        if target.finished and target.rollout_id is not None and scope["method"] == "POST":
            await self._finished(target.rollout_id, receive, send)
            return
        inner = (
            scope if target.path == scope["path"] else {**scope, "path": target.path, "raw_path": target.path.encode()}
        )
        route = CAPTURE_ROUTES.get(target.path) if scope["method"] == "POST" else None
        if route is None:
            tagged = target.rollout_id is not None and scope["method"] == "POST"
            if tagged and target.path not in PASSTHROUGH_POSTS and await self._uncaptured_route(target, send):
                return
            await self.app(inner, receive, send)
            return
        if target.rollout_id is None:
            self.metrics.count("uncaptured")
            await self.app(inner, receive, send)
            return
        with call_clock() if self.settings.server_timing else contextlib.nullcontext():  # the Server-Timing header
            await self._captured(route, target.rollout_id, inner, receive, send)

    # --- finished -----------------------------------------------------------

    async def _finished(self, rollout_id: str, receive: Receive, send: Send) -> None:
        if self.announce is None:
            await send_body(send, 501, error_body(501, "this proxy cannot announce finished rollouts", "NotConfigured"))
            return
        try:
            body = orjson.loads(await read_body(receive, 1 << 20))
            if not isinstance(body, dict) or set(body) - _FINISHED_FIELDS:
                raise ValueError(
                    'body must be {"reward": number|null[, "response": ..., "declared_response_id": str, '
                    '"group_id": str, "group_size": int]}'
                )
            event = await self.announce(rollout_id, {"reward": None, **body})
        except (ValueError, TypeError, BodyTooLargeError) as exc:
            await send_body(send, 422, error_body(422, str(exc), "InvalidFinished"))
            return
        except StagingError as exc:  # the store failed: answer 503 so the harness retries
            logger.error("cannot announce that rollout %s finished: %r", rollout_id, exc)
            await send_body(send, 503, error_body(503, f"cannot announce finished: {exc!r}", "StoreUnavailable"))
            return
        logger.info("rollout %s finished (event %s)", rollout_id, event)
        await send_json(send, 200, {"rollout_id": rollout_id, "event_id": event})

    async def _uncaptured_route(self, target: Target, send: Send) -> bool:
        """A rollout's POST to a route capture does not cover (``/inference/v1/generate``, a render route, audio...):
        refused under ``fail_closed`` (returns ``True``: it may generate, and nothing of it would be staged), else
        counted uncaptured and forwarded."""
        rollout_id, path = target.rollout_id, target.path
        self.metrics.count("capture_failed" if self.settings.fail_closed else "uncaptured")
        if not self.settings.fail_closed:
            logger.warning("rollout %s: POST %s is not a captured route; forwarded uncaptured", rollout_id, path)
            return False
        logger.warning("rollout %s: POST %s is not a captured route; refused (fail-closed)", rollout_id, path)
        message = f"POST {path} is not captured by the proxy; --fail-closed refuses it for a rollout"
        await send_body(send, 503, error_body(503, message, "UncapturedRoute"))
        return True

    # --- captured calls -------------------------------------------------------

    async def _uncaptured(self, scope: Scope, body: bytes, receive: Receive, send: Send) -> None:
        self.metrics.count("uncaptured")
        await self.app(scope, replay_receive(body, receive), send)

    async def _unparsed(
        self, route: RouteKind, rollout_id: str, scope: Scope, body: bytes, receive: Receive, send: Send, exc: Exception
    ) -> None:
        """Fail-open for a body the proxy cannot parse: the rollout records the capture failure, the engine answers
        the body, and the agent gets that answer without token fields (a 200 that is not one JSON object, e.g. a
        stream, may carry them: 502 instead)."""
        self.metrics.count("capture_failed")
        try:
            await self.gate.fail_unadmitted(
                rollout_id, f"request not captured ({exc}); forwarded uncaptured"
            )
        except StagingError as error:  # the ledger is unreachable: still served (fail-open)
            logger.error("rollout %s: cannot record the unparsed request: %r", rollout_id, error)
        answer = await call_inner(self.app, scope, body, receive, self.settings.max_response_bytes)
        if answer.status != 200:
            await send({"type": "http.response.start", "status": answer.status, "headers": answer.headers})
            await send({"type": "http.response.body", "body": answer.body, "more_body": False})
            return
        try:
            payload = orjson.loads(answer.body)
        except ValueError:
            payload = None
        if not isinstance(payload, dict) or answer.oversized:
            message = "the engine's answer to an unparsed request may carry token fields; not served"
            await send_body(send, 502, error_body(502, message, "UpstreamUnparseable"))
            return
        strip_token_fields(route, payload, ClientAsked(token_ids=False, logprobs=False))
        await send_json(send, 200, payload)

    async def refuse(self, send: Send, reason: str) -> None:
        """Answer 503 for a call that could not be captured (``fail_closed``)."""
        await send_body(
            send, 503, error_body(503, f"capture failed ({reason}); --fail-closed refuses", "CaptureFailed")
        )

    async def refused_for_weight_version(self, ids: str, send: Send) -> bool:
        """With ``weight_source="published"``: when the published key holds what the record cannot carry, refuse the
        call (503 ``WeightVersionUnusable``, counted ``capture_failed``) before anything is admitted or generated, so
        it poisons nothing and the agent's retry is captured once a valid version is published; return whether it
        was refused. An unreachable key is left to the admission, which records the call failed."""
        if self.published is None:
            return False
        try:
            await self.published.current()
        except WeightVersionKeyError as exc:
            fix = "publish a valid version: staging-sink weights set N"
            message = f"{exc}; the call is refused before it is generated ({fix})"
            logger.error("%s: %s", ids, message)
            self.metrics.count("capture_failed")
            await send_body(send, 503, error_body(503, message, "WeightVersionUnusable"))
            return True
        except StagingError:
            return False
        return False

    async def stamped_version(self) -> int | None:
        """The published version to stamp on an admitted call (``None``: the fallback ``weight_version``); a call
        stamped with the fallback while the published version is deleted is counted.

        :raises StagingError: the key cannot be read, or holds what the record cannot carry.
        """
        if self.published is None:
            return None
        version = await self.published.current()
        if version is None and self.published.deleted is not None:
            self.metrics.count_deleted_weight_version()
        return version

    async def _captured(self, route: RouteKind, rollout_id: str, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            body = await read_body(receive, self.settings.max_request_bytes)
        except BodyTooLargeError as exc:
            await send_body(send, 413, error_body(413, str(exc), "RequestTooLarge"))
            return
        request: Any = None
        try:
            request = orjson.loads(body)
            if not isinstance(request, dict):
                raise TypeError("not a JSON object")
            items = request_items(route, request)
            if request.get("n", 1) != 1:
                raise ValueError("capture needs n == 1")
        except (TypeError, ValueError) as exc:  # fail-open: the upstream answers the malformed request itself
            if self.settings.fail_closed:  # never forward what cannot be captured (the engine may parse it)
                logger.warning("rollout %s: request not capturable (%s); refused (fail-closed)", rollout_id, exc)
                self.metrics.count("capture_failed")
                if isinstance(request, dict):  # well-formed, but not capturable (n > 1)
                    await self.refuse(send, str(exc))
                else:
                    message = f"the proxy cannot parse this body ({exc}); --fail-closed does not forward it"
                    await send_body(send, 400, error_body(400, message, "InvalidRequest"))
                return
            if isinstance(request, dict):  # well-formed, but out of capture's scope (n > 1)
                logger.warning("rollout %s: request not captured (%s); forwarded as is", rollout_id, exc)
                await self._uncaptured(scope, body, receive, send)
                return
            await self._unparsed(route, rollout_id, scope, body, receive, send, exc)
            return
        await CapturedCall(self, route, scope, request, items, rollout_id).run(receive, send)
