"""The ``staging-sink`` command line, one module per kind of command.

The rule: :mod:`~sink_cli.main` is the entry point; :mod:`~sink_cli.dispatch` only parses arguments and dispatches (:mod:`~sink_cli.failures` turns expected
failures into exit codes); each command lives in the module for its kind:

* :mod:`~sink_cli.rollouts`: commands that read single rollouts (``inspect``, ``verify``, ``tail``);
* :mod:`~sink_cli.removal`: commands that remove rollouts' ledgers and fences (``retire``, ``delete``);
* :mod:`~sink_cli.listing`: the ``list`` command (the namespace's rollouts by state);
* :mod:`~sink_cli.stats`: the ``stats`` command, the collection of its namespace snapshot and ``--check``;
* :mod:`~sink_cli.services`: long-running services and tools (``server``, ``assembler``, ``trainer``,
  ``metrics``, ``acl``, ``bench``);
* :mod:`~sink_cli.common`: what several commands share (the Redis target, exit codes,
  :class:`~sink_cli.common.CommandError`, the parser and help formatter, argument types, output helpers);
* :mod:`~sink_cli.logs`: the ``-v``/``--log-format`` options and the log line formats.

* :mod:`~sink_cli.failures`: expected failures to one stderr line and an exit code;
* :mod:`~sink_cli.context`: the environment and Redis options every command's parser shares;
* :mod:`~sink_cli.demo` and :mod:`~sink_cli.demo_run`: ``demo``; :mod:`~sink_cli.proxy`: ``proxy`` and ``engine``.

It sits on top: it imports the library (``sink``, ``worker``) and the tools (``sink_tools``) directly; neither
imports it. It ships with the tools, in their own distribution (``tools/pyproject.toml``: ``staging-sink-tools``, which
depends on the library and on rich); the library's wheel holds neither.
"""

from __future__ import annotations

__all__ = ()
