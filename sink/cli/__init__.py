"""The ``staging-sink`` command line, one module per kind of command.

The rule: :mod:`~sink.cli.main` only parses arguments and dispatches (:mod:`~sink.cli.failures` turns expected
failures into exit codes); each command lives in the module for its kind:

* :mod:`~sink.cli.rollouts`: commands that read single rollouts (``inspect``, ``verify``, ``tail``);
* :mod:`~sink.cli.removal`: commands that remove rollouts' ledgers and fences (``retire``, ``delete``);
* :mod:`~sink.cli.listing`: the ``list`` command (the namespace's rollouts by state);
* :mod:`~sink.cli.stats`: the ``stats`` command, the collection of its namespace snapshot and ``--check``;
* :mod:`~sink.cli.services`: long-running services and tools (``server``, ``assembler``, ``trainer``,
  ``metrics``, ``acl``, ``bench``);
* :mod:`~sink.cli.common`: what several commands share (the Redis target, exit codes,
  :class:`~sink.cli.common.CommandError`, the parser and help formatter, argument types, output helpers);
* :mod:`~sink.cli.logs`: the ``-v``/``--log-format`` options and the log line formats.

* :mod:`~sink.cli.failures`: expected failures to one stderr line and an exit code;
* :mod:`~sink.cli.plugin`: the public API for packages that add commands and benchmarks (entry points); the
  worker's ``demo``, ``proxy``, ``engine``, ``bench worker`` and ``bench proxy`` come in that way (sink never
  imports worker).
"""

from __future__ import annotations

__all__ = ()
