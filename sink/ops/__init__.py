"""Operations: pruning (`prune`), metrics (`metrics/`), access control (`access/`), the local cluster and the report
page."""

__all__ = ()
