"""The Redis side of staging: connections, durability checks, server scripts, the sink, the source, stream consumers."""

from __future__ import annotations

__all__ = ()
