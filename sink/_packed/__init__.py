"""Private fast path: packed binary columns (ids, masks, log-probs) proved and hashed without per-token objects."""

from __future__ import annotations

__all__ = ()
