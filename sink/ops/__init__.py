"""Operations: pruning, metrics, cluster setup and ACL roles."""

__all__ = ()
