"""Inference-worker side of token staging: per-call capture, adapters, simulated engine."""

from __future__ import annotations

__all__: tuple[str, ...] = ()
