"""The wire contract: record models, the field table, digests, fingerprints, the codec and packed columns (pure code, no I/O)."""

__all__ = ()
