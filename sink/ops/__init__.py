"""Operations: pruning, metrics, cluster setup and ACL roles."""

from __future__ import annotations

__all__ = ()
