"""The engine's whole answer to a captured call, and the answer of an exact-prefix chat call
(:meth:`worker.proxy.exact_mode.ExactMode.chat`) in that shape, with its weight version read from the spans."""

from __future__ import annotations

import logging
from typing import Any

import orjson

from worker.asgi import error_body
from worker.call import ActiveCall
from worker.errors import EnginePayloadError, SpliceError
from worker.exact_chat import Rendering
from worker.proxy.exact_mode import ExactMode, without_spans
from worker.proxy.routes import ClientAsked
from worker.proxy.upstream import UpstreamAnswer
from worker.weight_version import WeightVersionError

__all__ = ("JSON_HEADERS", "asked_by", "exact_chat_answer")

logger = logging.getLogger(__name__)

JSON_HEADERS = [(b"content-type", b"application/json")]


def asked_by(request: dict[str, Any]) -> ClientAsked:
    """The token fields the client of *request* asked for itself."""
    return ClientAsked(
        token_ids=request.get("return_token_ids") is True,
        logprobs=request.get("logprobs") not in (None, False),
    )


async def exact_chat_answer(
    exact: ExactMode,
    request: dict[str, Any],
    rendering: Rendering,
    *,
    parent: list[int] | None,
    active: ActiveCall | None,
    ids: str,
    max_response_bytes: int,
) -> UpstreamAnswer | None:
    """The answer of an exact-prefix chat call (admission done): a continuation's prompt is its parent's exact
    sequence plus the rendered suffix; ``None`` when the request cannot be spliced (served in verify mode)."""
    try:
        answer = await exact.chat(request, rendering, parent)
    except SpliceError as exc:
        logger.warning("%s: cannot splice onto the parent (%s); served in verify mode", ids, exc)
        return None
    except EnginePayloadError as exc:
        logger.warning("%s: exact-prefix engine answer malformed (%s); capture failed", ids, exc)
        return UpstreamAnswer(502, JSON_HEADERS, error_body(502, str(exc), "EnginePayloadError"), False)
    payload = answer.payload
    if answer.status == 200 and isinstance(payload, dict):
        choice = payload["choices"][0]
        if active is not None:
            try:
                version = exact.weight_version_of(payload)
            except WeightVersionError as exc:
                logger.warning("%s: %s; capture failed", ids, exc)
                return UpstreamAnswer(200, JSON_HEADERS, orjson.dumps(without_spans(payload)), False)
            if version is not None:
                active.weight_version = version
        choice.pop("weight_versions", None)
    body = orjson.dumps(payload)
    return UpstreamAnswer(answer.status, JSON_HEADERS, body, len(body) > max_response_bytes)
