"""Capture in front of an OpenAI-compatible inference server: ASGI middleware, the capture proxy, the HTTP engine.

Needs the ``proxy`` extra (uvicorn, httpx, orjson); import the modules themselves (the package imports none of
them, so the CLI can register its commands without the extra): :mod:`.middleware` (:class:`CaptureMiddleware`),
:mod:`.proxy` (:class:`ProxyApp`, settings :class:`sink.settings.ProxySettings`), :mod:`.engine_app`
(:class:`EngineApp`), :mod:`.in_process` (vLLM ``--middleware``), :mod:`.serve`, :mod:`.cli`, :mod:`.bench`,
:mod:`.demo`.
"""

from __future__ import annotations

__all__ = ()
