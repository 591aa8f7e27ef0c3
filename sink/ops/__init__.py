"""Operations: pruning, metrics, cluster setup and ACL roles."""
