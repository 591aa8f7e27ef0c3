"""The simulated inference engine: a deterministic engine and rollout driver, and its OpenAI-compatible HTTP app."""

from __future__ import annotations

__all__ = ()
