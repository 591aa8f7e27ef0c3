"""One captured call through admission, begin, upstream, stage, commit and the reply (contract §5, §6.6, §12.2).

For a ``vllm`` upstream the admission (a ledger read, plus the parent's ``staging_chain`` fetch for a
continuation) runs concurrently with the generation: the engine request does not depend on it, and the parent
was committed before the agent could send this request (INV-2). A ``nemo-rl`` upstream needs the parent's exact
prefix in the request, so admission comes first there. Either way the delta is staged and the ledger row
committed before the first byte of the response leaves (INV-1, INV-2).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Literal, Protocol

import anyio
import orjson

from sink.contract.records import CaptureAdmission, CommitCoords
from sink.contract.sampling import SAMPLING_EXTRAS_KEY
from sink.errors import StagingError
from sink.ledger.gate import CaptureGate
from sink.ledger.redis import RedisCaptureLedger
from sink.settings import ProxySettings
from sink.store.commit import FollowUp
from worker.asgi import ASGIApp, Message, Receive, Scope, Send, error_body, send_body
from worker.call import ActiveCall
from worker.capture import RolloutTokenCapture, StageFollowUp
from worker.capture_adapter import ExtrasAdded
from worker.errors import ContextChangedError, EnginePayloadError
from worker.proxy.call_timing import engine_span, note_capture, timing_headers
from worker.proxy.exact.answers import JSON_HEADERS, ExactOutcome, exact_chat_answer, parent_of
from worker.proxy.exact.chat import Rendering
from worker.proxy.exact.completions import ExactCompletions
from worker.proxy.exact.mode import ExactMode, PrefixModeChoice
from worker.proxy.exact.text import ExactText
from worker.proxy.metrics import ProxyMetrics
from worker.proxy.routes import (
    ClientAsked,
    RouteKind,
    adapter_for,
    chains_of,
    client_asked,
    response_items,
    served_items,
    strip_token_fields,
    upstream_request,
)
from worker.proxy.sse import sse_events
from worker.proxy.upstream import UpstreamAnswer, call_inner, client_gone, error_message, refused
from worker.sampling import sampling_from_request

__all__ = ("CallOwner", "CapturedCall")

logger = logging.getLogger(__name__)


class CallOwner(Protocol):
    """What a captured call uses of the middleware that runs it (:class:`~worker.proxy.middleware.CaptureMiddleware`)."""

    app: ASGIApp
    capture: RolloutTokenCapture
    gate: CaptureGate
    settings: ProxySettings
    metrics: ProxyMetrics
    prefix_mode: PrefixModeChoice
    """Whether chat calls go in exact-prefix mode."""
    exact_completions: ExactCompletions | None
    """The exact-text index of ``/v1/completions`` calls (exact-prefix mode)."""
    rows_behind_stages: RedisCaptureLedger | None
    """The gate's ledger when its rows ride behind their stages (one durable round per call: the sink and the
    ledger share a connection user); ``None``: the row is committed in its own round after the stage."""

    async def refuse(self, send: Send, reason: str) -> None:
        """Answer 503 for a call that could not be captured (``fail_closed``)."""
        ...

    async def refused_for_weight_version(self, ids: str, send: Send) -> bool:
        """Refuse the call (503) when the published weight version is unusable; whether it was refused."""
        ...

    async def stamped_version(self) -> int | None:
        """The published weight version to stamp on an admitted call (``None``: the fallback)."""
        ...


_AdmitFailure = Literal["ledger unreachable", "no admission", "begin failed"]


class CapturedCall:
    """One call with a rollout id on a capture route (see the module docstring)."""

    def __init__(
        self,
        owner: CallOwner,
        route: RouteKind,
        scope: Scope,
        request: dict[str, Any],
        items: list[dict[str, Any]],
        rollout_id: str,
    ) -> None:
        self.owner, self.route, self.scope, self.request, self.items = owner, route, scope, request, items
        self.rollout_id = rollout_id
        self.ids = f"rollout {rollout_id}"
        self.admitted_at = time.time()
        self.admission: CaptureAdmission | None = None
        self.active: ActiveCall | None = None
        self.admit_failure: _AdmitFailure | None = None
        self.settled = False
        self.captured = False
        self.refused = False
        """The engine refused the request (nothing generated): no failure row, its error passed through."""
        self.answer: tuple[UpstreamAnswer, dict[str, Any] | None, ClientAsked] | None = None  # once known
        self.extras: dict[str, Any] = {SAMPLING_EXTRAS_KEY: sampling_from_request(request)}
        """Staged beside the engine's own extras: how the tokens were sampled (exact mode: the engine's own
        parameters and the rendered context)."""
        self.failure: str | None = None
        """Why a call served with an engine answer must not be staged (its context changed under ``single``)."""
        self.row_behind: FollowUp | None = None
        """The ledger row sent behind the stage, with its outcome (one durable round)."""
        self.as_received = False
        """The answer to serve is the engine's body as it came: parsed from it, and the client asked for every token
        field it holds, so nothing was stripped. It is then served as the engine's own bytes, not serialised again."""

    # --- admission ------------------------------------------------------------

    async def _admit(self) -> None:
        """Admit and begin the call; never raises (a failure is remembered in ``admit_failure``)."""
        owner = self.owner
        try:
            self.admission = await owner.gate.admit(self.rollout_id, self.items, **chains_of(self.scope))
        except StagingError as exc:  # the ledger is unreachable: fail open (or closed) as configured
            logger.error("%s: capture admission failed (ledger unreachable?): %r", self.ids, exc)
            self.admit_failure = "ledger unreachable"
            return
        if self.admission is None:
            logger.warning("%s: no admission (retired rollout or unresolved parent); served uncaptured", self.ids)
            self.admit_failure = "no admission"
            return
        await self._begin(self.admission)

    async def _begin(self, admission: CaptureAdmission) -> None:
        """Begin the admitted call (the parent's chain fetched); a failure is remembered in ``admit_failure``."""
        owner = self.owner
        self.admission = admission
        self.ids = f"rollout {self.rollout_id} call {admission.model_call_id}"
        try:
            version = await owner.stamped_version()
            self.active = await owner.capture.abegin_call(admission, weight_version=version)
        except StagingError as exc:  # an invalid weight version (CaptureError), an unreadable published one
            logger.error("%s: begin failed: %r; served uncaptured", self.ids, exc)
            self.admit_failure = "begin failed"
            await self._settle(None, None)

    # --- ledger -----------------------------------------------------------------

    async def _settle(self, coords: CommitCoords | None, payload: dict[str, Any] | None) -> None:
        """Commit *coords* (or a failure) to the ledger; shielded, so a cancelled request never half-writes (a bug
        propagates to :meth:`run` with the call unsettled: the boundary records it failed)."""
        admission, active, capture = self.admission, self.active, self.owner.capture
        if admission is None or self.settled:
            return
        with anyio.CancelScope(shield=True):
            if coords is None:
                coords = (
                    capture.fail_admission(admission, reason="no completion")
                    if active is None or active.completed
                    else capture.fail_call(active, reason="the call ended without a completion")
                )
            ledger, behind = self.owner.rows_behind_stages, self.row_behind
            staged = coords.disposition == "staged"
            if staged and ledger is not None and behind is not None and ledger.appended_after_stage(behind):
                self.captured = self.settled = True  # committed in the stage's round
                return
            try:
                row = await self.owner.gate.commit(
                    admission,
                    coords,
                    response_id="" if payload is None else str(payload.get("id") or ""),
                    request_items=self.items,
                    response_items=[] if payload is None else response_items(self.route, payload),
                    admitted_at=self.admitted_at,
                )
            except StagingError as exc:  # the ledger failed after the stage: the call is not captured
                logger.error("%s: ledger commit failed: %r (staged tokens have no ledger row)", self.ids, exc)
                row = None
            self.captured, self.settled = row is not None, True

    async def _abandon(self) -> None:
        """The request ended (cancelled or failed) before its capture completed: record it failed (§6.6 step 12)."""
        admission, active = self.admission, self.active
        assert admission is not None
        with anyio.CancelScope(shield=True):
            try:
                if active is not None and not active.completed:
                    self.owner.capture.fail_call(active, reason="the request ended before its completion")
                await self.owner.gate.abandon(admission)
            except StagingError as exc:  # the ledger is unreachable too: nothing more can be recorded
                logger.error("%s: cannot record the abandoned call: %r", self.ids, exc)
            finally:
                self.settled = True
        logger.warning("%s: request ended before its capture completed; recorded as failed", self.ids)

    # --- upstream ------------------------------------------------------------------

    async def _upstream(self, body: bytes, receive: Receive) -> UpstreamAnswer:
        with engine_span() as span:
            result = await call_inner(self.owner.app, self.scope, body, receive, self.owner.settings.max_response_bytes)
        self.owner.metrics.observe(upstream_s=span.seconds, route=self.scope["path"])
        return result

    def _parsed(self, upstream: UpstreamAnswer) -> dict[str, Any] | None:
        if refused(upstream):
            logger.warning(
                "%s: upstream answered %d (nothing generated): a failed attempt, the rollout is not poisoned; %s",
                self.ids,
                upstream.status,
                error_message(upstream.body),
            )
            return None
        if upstream.status != 200:
            logger.warning("%s: upstream answered %d; capture failed", self.ids, upstream.status)
            return None
        if upstream.payload is not None:  # built by the proxy itself (exact mode)
            return upstream.payload
        try:
            payload = orjson.loads(upstream.body)
        except ValueError as exc:
            logger.warning("%s: upstream response is not JSON (%s); capture failed", self.ids, exc)
            return None
        if not isinstance(payload, dict):
            logger.warning("%s: upstream response is not a JSON object; capture failed", self.ids)
            return None
        return payload

    async def _complete(
        self, active: ActiveCall, upstream: UpstreamAnswer, payload: dict[str, Any] | None
    ) -> CommitCoords:
        """Stage the call from the upstream response, or fail it (§5.5, §5.6)."""
        capture = self.owner.capture
        if payload is None:
            return capture.fail_call(active, reason=f"upstream status {upstream.status} or not JSON")
        if self.failure is not None:
            return capture.fail_call(active, reason=self.failure)
        if upstream.oversized:
            logger.warning(
                "%s: upstream response of %d bytes exceeds max_response_bytes=%d; capture failed",
                self.ids,
                len(upstream.body),
                self.owner.settings.max_response_bytes,
            )
            return capture.fail_call(active, reason="oversized response")
        with anyio.CancelScope(shield=True):  # the stage completes or the call is recorded failed, never half
            adapter = ExtrasAdded(adapter_for(self.route), self.extras)
            then = self._row_behind_stage(payload)
            coords = await capture.acomplete_call_from_response(active, payload, adapter=adapter, then=then)
        if coords.disposition != "staged":
            logger.warning("%s: not staged (prefix drift, store refusal or invalid ids: see above)", self.ids)
        return coords

    def _row_behind_stage(self, payload: dict[str, Any]) -> StageFollowUp | None:
        """The ledger row to send behind the call's stage, in its round trip (contract §6.6), or ``None``: the row is
        committed after the stage (:meth:`_settle`), as it is whenever the row sent here was not confirmed."""
        ledger, admission, answer = self.owner.rows_behind_stages, self.admission, self.answer
        if ledger is None or admission is None or answer is None:
            return None
        asked = answer[2]

        def then(coords: CommitCoords) -> FollowUp | None:
            planned = self.owner.gate.planned_commit(
                admission,
                coords,
                response_id=str(payload.get("id") or ""),
                request_items=self.items,
                response_items=served_items(self.route, payload, asked),
                admitted_at=self.admitted_at,
            )
            if planned is None:
                return None
            try:
                follow_up = ledger.row_after_stage(planned)
            except (TypeError, ValueError):  # the commit that follows records the failure
                return None
            self.row_behind = follow_up
            return follow_up

        return then

    # --- the whole call ---------------------------------------------------------------

    def _body(self) -> tuple[bytes, ClientAsked]:
        active = self.active
        prefix = active.prefix_token_ids if active is not None and not active.capture_failed else []
        body, asked = upstream_request(self.route, self.request, self.owner.settings.upstream_kind, prefix)
        return orjson.dumps(body), asked

    def _parent_ids(self) -> list[int] | None:
        """The parent's exact sequence of an admitted continuation (``None``: a root, or not capturable)."""
        parent = parent_of(self.active)
        return None if parent is None else parent.ids

    async def _exact_completion(self, exact: ExactMode, text: ExactText, receive: Receive) -> UpstreamAnswer:
        """An exact-prefix completion (:mod:`worker.proxy.exact.completions`): admitted from the exact-text items."""
        self.items = text.items()
        await self._admit()
        assert self.owner.exact_completions is not None
        completions, kind = self.owner.exact_completions, self.owner.settings.upstream_kind
        try:
            status, error, request = await completions.request(exact, text, self.request, self._parent_ids())
        except EnginePayloadError as exc:
            logger.warning("%s: exact-prefix engine answer malformed (%s); capture failed", self.ids, exc)
            return UpstreamAnswer(502, JSON_HEADERS, error_body(502, str(exc), "EnginePayloadError"), False)
        if status != 200:
            return UpstreamAnswer(status, JSON_HEADERS, orjson.dumps(error), False)
        return await self._upstream(orjson.dumps(upstream_request(self.route, request, kind, [])[0]), receive)

    async def _exact_upstream(
        self, exact: ExactMode, rendering: Rendering, receive: Receive
    ) -> tuple[UpstreamAnswer, ClientAsked]:
        """An exact-prefix chat call (:func:`~worker.proxy.exact.answers.exact_chat_answer`), in verify mode when it
        cannot be spliced."""
        limit = self.owner.settings.max_response_bytes
        try:
            outcome = await exact_chat_answer(
                exact,
                self.request,
                rendering,
                parent=parent_of(self.active),
                active=self.active,
                ids=self.ids,
                max_response_bytes=limit,
            )
        except ContextChangedError as exc:
            outcome = await self._context_changed(exact, rendering, exc)
        if outcome.upstream is None:
            body, asked = self._body()
            return await self._upstream(body, receive), asked
        if outcome.extras is not None:
            self.extras = outcome.extras
        return outcome.upstream, client_asked(self.request)

    async def _context_changed(self, exact: ExactMode, rendering: Rendering, exc: ContextChangedError) -> ExactOutcome:
        """A continuation whose context changed is no continuation of its parent: under a multi-chain policy it starts
        a new chain, else its capture fails (the rollout is poisoned). Either way the engine sees what the agent sent."""
        admission = self.admission
        assert admission is not None
        parent = admission.parent_call_id
        root = await self.owner.gate.admit_new_chain(self.rollout_id, **chains_of(self.scope))
        if root is None:
            logger.warning("%s: %s: not a continuation of call %s; capture failed", self.ids, exc, parent)
            self.failure = f"not a continuation of call {parent}: {exc}"
        else:
            logger.warning("%s: %s: not a continuation of call %s; it starts a new chain", self.ids, exc, parent)
            await self._begin(root)
        limit = self.owner.settings.max_response_bytes
        return await exact_chat_answer(
            exact, self.request, rendering, parent=None, active=self.active, ids=self.ids, max_response_bytes=limit
        )

    async def run(self, receive: Receive, send: Send) -> None:
        """Serve the call: capture it, then reply (or refuse with 503 when fail-closed and not captured). The one
        boundary for the unexpected: the package's own errors are handled where they occur; anything else is a bug,
        logged with its traceback, counted ``capture_error``, recorded failed, then handled by :meth:`_after_bug`."""
        started = False

        async def tracked(message: Message) -> None:
            nonlocal started
            started = True
            await send(message)

        try:
            await self._serve(receive, tracked)
        except Exception:  # the per-request boundary (see above): a bug, logged with its traceback
            logger.exception("%s: the capture failed unexpectedly (a bug); the call is recorded failed", self.ids)
            self.owner.metrics.count("capture_error")
            if started:
                raise
            await self._after_bug(send)

    async def _after_bug(self, send: Send) -> None:
        """The policy after a bug: fail-closed answers 503; fail-open serves the reply stripped (500 if none yet)."""
        if self.owner.settings.fail_closed:
            await self.owner.refuse(send, "an unexpected capture error (see the proxy log)")
        elif (answer := self.answer) is None:
            await send_body(send, 500, error_body(500, "unexpected capture error (see the proxy log)", "CaptureError"))
        else:
            upstream, payload, asked = answer
            if payload is not None:
                strip_token_fields(self.route, payload, asked)
            self.as_received = False  # after a bug, serve only what was just stripped (it may have been stripped before)
            await self._reply(upstream, payload, send)

    async def _serve(self, receive: Receive, send: Send) -> None:
        owner, metrics = self.owner, self.owner.metrics
        if await owner.refused_for_weight_version(self.ids, send):
            return
        try:
            exact = await owner.prefix_mode.current() if self.route != "responses" else None
            xc = owner.exact_completions if exact is not None and self.route == "completions" else None
            text = None if xc is None else await xc.plan(self.rollout_id, self.request)
            if text is not None and exact is not None:
                asked = upstream_request(self.route, self.request, owner.settings.upstream_kind, [])[1]
                upstream = await self._exact_completion(exact, text, receive)
            elif exact is not None and self.route == "chat":
                rendering = await exact.render(self.request)
                if rendering.status != 200:  # the engine refused the request (over the context...): nothing to capture
                    logger.warning(
                        "%s: the engine refused the request (%d); nothing generated, not admitted",
                        self.ids,
                        rendering.status,
                    )
                    owner.metrics.count("uncaptured")
                    await send_body(send, rendering.status, orjson.dumps(rendering.answer))
                    return
                await self._admit()  # a continuation's prompt starts with its parent's exact ids: admit first
                upstream, asked = await self._exact_upstream(exact, rendering, receive)
            elif owner.settings.upstream_kind == "nemo-rl":
                await self._admit()
                body, asked = self._body()
                upstream = await self._upstream(body, receive)
            else:
                body, asked = self._body()
                async with anyio.create_task_group() as group:
                    group.start_soon(self._admit)
                    upstream = await self._upstream(body, receive)
            payload = self._parsed(upstream)
            self.answer = (upstream, payload, asked)
            staged_at = time.perf_counter()
            if payload is None and refused(upstream):
                self.refused = True
                self.settled = True  # nothing to record: no failure row
            elif self.active is not None:
                coords = await self._complete(self.active, upstream, payload)
                served = None if payload is None else [dict(c) for c in payload.get("choices") or () if isinstance(c, dict)]
                if payload is not None:
                    self._strip(upstream, payload, asked)
                await self._settle(coords, payload)
                if self.captured and text is not None and served and xc is not None:
                    await xc.remember(self.rollout_id, text, {"choices": served}, self.request)
                metrics.observe(stage_s=note_capture(time.perf_counter() - staged_at))
            elif payload is not None:
                self._strip(upstream, payload, asked)
        finally:
            if self.admission is not None and not self.settled:
                await self._abandon()
        uncaptured = self.refused or (self.admit_failure == "no admission" and not owner.settings.fail_closed)
        metrics.count("captured" if self.captured else "uncaptured" if uncaptured else "capture_failed")
        if await client_gone(receive):
            logger.warning(
                "%s: client disconnected mid-call; the call was %s before the response was dropped",
                self.ids,
                "committed" if self.captured else "not captured",
            )
            return
        if not self.captured and not self.refused and owner.settings.fail_closed:  # a refusal served nothing
            await owner.refuse(send, self.admit_failure or "see the proxy log")
            return
        await self._reply(upstream, payload, send)

    def _strip(self, upstream: UpstreamAnswer, payload: dict[str, Any], asked: ClientAsked) -> None:
        """Strip the token fields the client did not ask for; note whether the answer is still the engine's body."""
        changed = strip_token_fields(self.route, payload, asked)
        self.as_received = not changed and upstream.payload is None and not upstream.oversized

    async def _reply(self, upstream: UpstreamAnswer, payload: dict[str, Any] | None, send: Send) -> None:
        if payload is None and upstream.status == 200:  # it may carry token fields: never served raw
            body = error_body(502, "the engine's response could not be parsed; not served", "UpstreamUnparseable")
            await send_body(send, 502, body)
            return
        if payload is None:  # an upstream error: passed through as received
            self.owner.metrics.observe(nbytes=len(upstream.body))
            await send({"type": "http.response.start", "status": upstream.status, "headers": upstream.headers})
            await send({"type": "http.response.body", "body": upstream.body, "more_body": False})
            return
        if self.request.get("stream") is True:
            options = self.request.get("stream_options")
            usage = isinstance(options, dict) and options.get("include_usage") is True
            body, content_type = sse_events(self.route, payload, include_usage=usage), b"text/event-stream"
        else:  # the engine's own bytes when nothing was stripped: no second serialisation, vLLM's exact spelling
            body, content_type = upstream.body if self.as_received else orjson.dumps(payload), b"application/json"
        self.owner.metrics.observe(nbytes=len(body))
        await send_body(send, 200, body, content_type, timing_headers())
