"""The capture ledger (contract section 6): lineage, committed and failure rows, the gate, one front class over Redis and in-memory backends."""

from __future__ import annotations

__all__ = ()
