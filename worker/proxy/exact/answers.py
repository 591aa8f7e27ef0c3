"""The engine's whole answer to a captured call, and the answer of an exact-prefix chat call
(:meth:`worker.proxy.exact.mode.ExactMode.chat`) in that shape, with its weight version read from the spans and
what it stages beside the tokens (its extras: sampling provenance, its rendered context)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import orjson

from sink.contract.sampling import SAMPLING_EXTRAS_KEY
from worker.asgi import error_body
from worker.call import ActiveCall
from worker.errors import ContextChangedError, EnginePayloadError, SpliceError
from worker.proxy.exact.chat import Parent, Rendering
from worker.proxy.exact.mode import ExactMode, without_spans
from worker.proxy.upstream import UpstreamAnswer
from worker.weight_version import WeightVersionError

__all__ = (
    "CONTEXT_EXTRAS_KEY",
    "JSON_HEADERS",
    "ExactOutcome",
    "exact_chat_answer",
    "parent_of",
)

logger = logging.getLogger(__name__)

JSON_HEADERS = [(b"content-type", b"application/json")]
CONTEXT_EXTRAS_KEY = "rendered_context"
"""The extras key of an exact-prefix call's :func:`worker.proxy.exact.splice.context_digest`: what its continuations check."""


def parent_of(active: ActiveCall | None) -> Parent | None:
    """The parent of an admitted continuation: its exact sequence and rendered context (``None``: a root, or a call
    that is not captured)."""
    if active is None or active.capture_failed or active.admission.mode != "token_in":
        return None
    context = (active.parent_extras or {}).get(CONTEXT_EXTRAS_KEY)
    return Parent(active.prefix_token_ids, context if isinstance(context, str) else None)


@dataclass(frozen=True)
class ExactOutcome:
    """An exact-prefix chat call's answer (``None``: it cannot be spliced, serve it in verify mode) and its extras."""

    upstream: UpstreamAnswer | None
    extras: dict[str, Any] | None = None


async def exact_chat_answer(
    exact: ExactMode,
    request: dict[str, Any],
    rendering: Rendering,
    *,
    parent: Parent | None,
    active: ActiveCall | None,
    ids: str,
    max_response_bytes: int,
) -> ExactOutcome:
    """The answer of an exact-prefix chat call (admission done): a continuation's prompt is its parent's exact
    sequence plus the rendered suffix.

    :raises ContextChangedError: the conversation before the parent's reply changed (the caller decides: a new
        chain, or a capture failure).
    """
    try:
        answer = await exact.chat(request, rendering, parent)
    except ContextChangedError:
        raise
    except SpliceError as exc:
        logger.warning("%s: cannot splice onto the parent (%s); served in verify mode", ids, exc)
        return ExactOutcome(None)
    except EnginePayloadError as exc:
        logger.warning("%s: exact-prefix engine answer malformed (%s); capture failed", ids, exc)
        return ExactOutcome(UpstreamAnswer(502, JSON_HEADERS, error_body(502, str(exc), "EnginePayloadError"), False))
    payload = answer.payload
    extras = None
    if answer.status == 200 and isinstance(payload, dict):
        extras = {SAMPLING_EXTRAS_KEY: answer.sampling, CONTEXT_EXTRAS_KEY: rendering.context}
        choice = payload["choices"][0]
        if active is not None:
            try:
                version = exact.weight_version_of(payload)
            except WeightVersionError as exc:
                logger.warning("%s: %s; capture failed", ids, exc)
                body = orjson.dumps(without_spans(payload))
                return ExactOutcome(UpstreamAnswer(200, JSON_HEADERS, body, False))
            if version is not None:
                active.weight_version = version
        choice.pop("weight_versions", None)
    body = orjson.dumps(payload)
    parsed = payload if isinstance(payload, dict) else None  # what parsing *body* gives: not parsed again
    oversized = len(body) > max_response_bytes
    return ExactOutcome(UpstreamAnswer(answer.status, JSON_HEADERS, body, oversized, parsed), extras)
