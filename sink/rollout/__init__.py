"""The rollout end: the done event, the assembler that seals a receipt, and terminal selection."""

from __future__ import annotations

from sink.rollout.assembler import Assembler, AssemblerStatistics
from sink.rollout.done_event import finished

__all__ = (
    "Assembler",
    "AssemblerStatistics",
    "finished",
)
