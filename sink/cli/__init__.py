"""The ``staging-sink`` command line: ``main`` parses and dispatches; ``rollouts`` (inspect, verify, tail, retire,
delete), ``stats``, ``services`` (server, assembler, trainer, metrics, acl, bench) implement the commands."""

from __future__ import annotations

__all__ = ()
