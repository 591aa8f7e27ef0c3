"""One TLS context for the HTTP clients the tests create (httpx's and the official ``openai`` client's).

A client left with the default ``verify=True`` builds an SSL context and loads the CA bundle, about 20 ms of CPU,
although every URL the tests call is plain HTTP on loopback; the fast tier creates over a thousand clients (an openai
client per call, a logging hop's pool, a readiness probe per poll). They share httpx's default verifying context,
built once per process, as the proxy's forwarder does (:mod:`worker.proxy.forward`).
"""

from __future__ import annotations

import functools
import ssl
from typing import Any

import httpx
import openai

__all__ = ("openai_client", "tls")


@functools.cache
def tls() -> ssl.SSLContext:
    """httpx's default verifying context (``verify=True``), built once: pass it as ``verify=``."""
    return httpx.create_ssl_context()


def openai_client(base_url: str, **options: Any) -> openai.OpenAI:
    """``openai.OpenAI(base_url=..., **options)`` on the client's own default HTTP client, with the shared context."""
    return openai.OpenAI(base_url=base_url, http_client=openai.DefaultHttpxClient(verify=tls()), **options)
