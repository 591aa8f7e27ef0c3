"""The rollout end: the done event, the assembler that seals a receipt, and terminal selection."""

from __future__ import annotations

__all__ = ()
