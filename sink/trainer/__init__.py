"""The trainer side: pulling, verifying and linearizing rollouts, then batches, packing, groups, staleness and export."""

from __future__ import annotations

__all__ = ()
