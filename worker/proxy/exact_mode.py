"""Exact-prefix mode in the capture proxy: the chosen mode, and chat calls served over render/generate/derender.

At start the proxy probes the engine (:func:`worker.exact_probe.probe_exact_prefix`) through the app it wraps (the
forwarder, or vLLM's own app in-process) and logs one line saying which mode it uses and why. ``prefix_mode``:
``auto`` (default) uses exact where the engine supports it, ``exact`` refuses to start without it, ``verify``
keeps verify mode. In exact mode a captured chat call goes through :func:`worker.exact_chat.exact_chat`: a
continuation's prompt is the parent's exact staged sequence plus the rendered suffix, so history is never
re-templated; the answer has vLLM's ``return_token_ids`` shape, so it is staged like any vLLM answer, and its
``weight_versions`` spans stamp the call's weight version (:mod:`worker.weight_version`) when a label rule is set.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Literal

import orjson

from worker.asgi import ASGIApp, Message
from worker.errors import StagingModeError
from worker.exact_chat import ExactAnswer, Rendering, exact_chat, render_chat
from worker.exact_probe import ExactProbe, probe_exact_prefix
from worker.weight_version import WeightLabelRule, WeightVersionError, version_of_spans

__all__ = ("ExactMode", "PrefixMode", "choose_mode", "sub_request")

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


@dataclass(frozen=True)
class ExactMode:
    """Exact-prefix chat calls on one engine app."""

    app: ASGIApp
    probe: ExactProbe
    labels: WeightLabelRule | None = None
    """How the engine's weight labels map to versions; ``None``: the proxy's configured version stamps calls."""

    async def _call(self, path: str, body: dict[str, Any]) -> tuple[int, Any]:
        return await sub_request(self.app, "POST", path, body)

    async def render(self, request: dict[str, Any]) -> Rendering:
        """Render *request* and its history with the engine's template (an error: nothing can be generated)."""
        return await render_chat(self._call, request, self.probe.eot_ids)

    async def chat(self, request: dict[str, Any], rendering: Rendering, parent_ids: list[int] | None) -> ExactAnswer:
        """Finish one rendered chat request exactly (:func:`worker.exact_chat.exact_chat`).

        :raises worker.errors.SpliceError: the request cannot be spliced onto *parent_ids*.
        """
        eot_ids = self.probe.eot_ids
        return await exact_chat(self._call, request, parent_ids=parent_ids, eot_ids=eot_ids, rendering=rendering)

    def weight_version_of(self, payload: dict[str, Any]) -> int | None:
        """The call's weight version from the answer's spans (the oldest), or ``None`` without a label rule.

        :raises worker.weight_version.WeightVersionError: spans that do not tile the output, or a refused label.
        """
        if self.labels is None:
            return None
        choice = payload["choices"][0]
        return version_of_spans(choice.get("weight_versions") or [], len(choice["token_ids"]), self.labels)


async def choose_mode(app: ASGIApp, mode: PrefixMode, labels: WeightLabelRule | None = None) -> ExactMode | None:
    """Probe the engine behind *app* and pick the mode (one log line says which and why).

    :raises StagingModeError: ``mode == "exact"`` and the engine does not support it, or *labels* refuses the
        engine's current weight label (``GET /weight_info``).
    """
    if mode == "verify":
        logger.info("prefix mode: verify (forced by prefix_mode=verify)")
        return None

    async def post(path: str, body: dict[str, Any]) -> tuple[int, Any]:
        return await sub_request(app, "POST", path, body)

    async def get(path: str) -> tuple[int, Any]:
        return await sub_request(app, "GET", path)

    probe = await probe_exact_prefix(post, get)
    if probe.mode != "exact":
        if mode == "exact":
            raise StagingModeError(f"prefix_mode=exact, but the engine does not support it: {probe.reason}")
        logger.warning("prefix mode: verify (%s)", probe.reason)
        return None
    if labels is not None:
        status, info = await get("/weight_info")
        if status == 200 and isinstance(info, dict):
            try:
                labels.version_of(info.get("weight_version"))
            except WeightVersionError as exc:  # a label the rule refuses stops the start here
                raise StagingModeError(f"GET /weight_info: {exc}") from exc
    logger.info("prefix mode: exact (%s; end-of-turn ids %s)", probe.reason, sorted(probe.eot_ids))
    return ExactMode(app, probe, labels)
