"""The demo application: simulated multi-turn rollouts through worker processes, an assembler and a trainer."""

from __future__ import annotations

__all__ = ()
