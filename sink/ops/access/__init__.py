"""Access control: least-privilege Redis/Valkey ACL users for the staging roles.

:mod:`~sink.ops.access.policy` is the single table of what each role may run on which keys;
:mod:`~sink.ops.access.render` renders it into an ``aclfile`` and the roles' environment files. Nothing is
re-exported here.
"""

__all__ = ()
