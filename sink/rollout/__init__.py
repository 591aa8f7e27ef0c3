"""The rollout end: the done event, the assembler that seals a receipt, and terminal selection."""

__all__ = ()
