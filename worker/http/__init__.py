"""Capture in front of an OpenAI-compatible inference server: ASGI middleware, the capture proxy, the HTTP engine.

Needs the ``proxy`` extra (uvicorn, httpx, orjson). The proxy's settings are :class:`sink.settings.ProxySettings`.
"""

from __future__ import annotations

from .engine_app import EngineApp as EngineApp
from .engine_app import EngineOptions as EngineOptions
from .forward import ForwardingApp as ForwardingApp
from .metrics import ProxyMetrics as ProxyMetrics
from .middleware import CaptureMiddleware as CaptureMiddleware
from .middleware import CapturePolicy as CapturePolicy
from .proxy import ProxyApp as ProxyApp
from .proxy import build_proxy as build_proxy
from .serve import running_server as running_server

__all__ = (
    "CaptureMiddleware",
    "CapturePolicy",
    "EngineApp",
    "EngineOptions",
    "ForwardingApp",
    "ProxyApp",
    "ProxyMetrics",
    "build_proxy",
    "running_server",
)
