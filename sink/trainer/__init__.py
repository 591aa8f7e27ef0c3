"""The trainer side: pulling, verifying and linearizing rollouts, then batches, packing, groups, staleness and export."""

__all__ = ()
