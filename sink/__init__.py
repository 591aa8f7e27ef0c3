"""staging-sink: durable token staging for RL training of LLM agents."""

from __future__ import annotations

__all__: tuple[str, ...] = ()
