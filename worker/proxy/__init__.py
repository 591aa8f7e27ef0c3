"""The capture proxy in front of an OpenAI-compatible inference server: ASGI middleware and the proxy app.

Needs the ``proxy`` extra (uvicorn, httpx, httpcore, orjson); import the modules themselves (the package imports
none of them, so ``staging-sink`` can register its commands without the extra): :mod:`.middleware`
(:class:`CaptureMiddleware`, per request), :mod:`.captured_call` (one captured call), :mod:`.app`
(:class:`ProxyApp`, settings :class:`sink.settings.ProxySettings`), :mod:`.in_process` (vLLM ``--middleware``),
:mod:`.serve`, :mod:`.cli` (the ``proxy`` and ``engine`` commands), :mod:`.bench`. The simulated HTTP engine is
:mod:`sink_tools.simulated.http_app`; ``demo --http`` is :mod:`sink_tools.demo.http`.
"""

from __future__ import annotations

__all__ = ()
