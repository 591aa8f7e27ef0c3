"""Errors raised by the inference-worker capture (contract §5.1, §5.2, §9.4).

:class:`CaptureError` marks caller bugs: it is raised, never turned into a
poison row. Operational capture failures (a rejected stage, a missing chain
record) are not exceptions at all: they become failed coordinates (§5.8).
"""

from __future__ import annotations

from sink.errors import StagingError

__all__ = (
    "BodyTooLargeError",
    "CaptureError",
    "ContextChangedError",
    "EnginePayloadError",
    "GenerationCutError",
    "PrefixResolutionError",
    "ServerStartError",
    "SpliceError",
    "StagingModeError",
    "StreamingUnsupportedError",
    "WorkersFailedError",
)


class CaptureError(StagingError):
    """Raised when the capture is used incorrectly: a non-admission argument,
    an invalid prefix or weight version, a second completion of one call, or
    a synchronous method used with an asynchronous sink or source."""


class StreamingUnsupportedError(CaptureError):
    """Raised by ``begin_call(stream=True)``: streaming capture is out of
    scope (contract INV-5)."""


class GenerationCutError(CaptureError):
    """Raised when a generation-cut prefix cannot be rebuilt or does not
    match its admission (contract §9.4). The serving host drops the cut and
    regenerates the call; the message names the failed check."""


class PrefixResolutionError(StagingError):
    """Raised by :func:`worker.prefix.resolve_prefix` when a ``staging_chain``
    cannot be resolved to a verified prefix: a missing key, a length
    mismatch, or a chain or cumulative hash that does not link. ``begin_call``
    catches it: the call is then served uncaptured and acknowledged with
    failed coordinates."""


class EnginePayloadError(StagingError, ValueError):
    """Raised by the OpenAI-shape adapters (:mod:`worker.openai_adapters`) when an engine response lacks a token
    field or holds a malformed one. The capture turns it into failed coordinates; the completion is still served
    (contract INV-4). The message names the field."""


class WorkersFailedError(StagingError):
    """Raised by the demo's worker pool when a worker process exits with a non-zero status (the reason is in
    the tally's errors)."""


class SpliceError(StagingError, ValueError):
    """Raised by :func:`worker.proxy.exact.splice.splice_exact_prompt` when a rendered continuation cannot be spliced onto
    its parent's exact sequence (no end-of-turn where the last assistant message must close, no rendered suffix).
    The proxy then serves the call in verify mode, never with a guessed prompt; the message names the check."""


class StagingModeError(StagingError):
    """Raised at the proxy's start when the configured prefix mode cannot be used: ``prefix_mode=exact`` on an engine
    without the token-in/token-out routes, or engine weight labels the configured rule refuses. The message names
    the engine's answer."""


class ContextChangedError(SpliceError):
    """Raised by :func:`worker.proxy.exact.chat.exact_chat` when a continuation's conversation before its parent's reply
    (system or developer messages, earlier turns, tools, template arguments) renders differently than it did for the
    parent: splicing would send the engine the parent's old context. The call is no continuation of that parent: a
    new chain where the rollout allows one, else a capture failure naming this cause."""


class BodyTooLargeError(StagingError):
    """A request body exceeded the configured limit (answered with HTTP 413)."""


class ServerStartError(StagingError):
    """uvicorn did not start (or its app's lifespan startup failed) within the deadline."""
