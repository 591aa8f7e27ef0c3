"""The ``staging-sink`` entry point (``sink_cli.main:main``; ``python -m sink_cli`` runs it too).

The command line's output (tables, progress) needs rich, the ``cli`` extra; the library (``sink``, ``worker``) does
not, so an install without the extra is a working library. :func:`main` checks for rich before any module that
imports it loads: without it, one ``staging-sink: error: ...`` line naming the fix and exit 1 (a missing extra, as
``export --format parquet`` without pyarrow), never a traceback. Everything else is :mod:`sink_cli.dispatch`
(the parser, the environment defaults, the exit codes).
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Sequence

__all__ = ("main",)

_EXIT_FAILURE = 1  # sink_cli.common.EXIT_FAILURE, not imported: sink_cli.common imports rich
_NO_RICH = (
    "staging-sink: error: the command line needs rich, the 'cli' extra: "
    "pip install 'staging-sink[cli]' (pip install -e '.[cli]' in a clone)\n"
)


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``staging-sink`` with *argv* (default ``sys.argv[1:]``) and return the exit code.

    Operational failures print one ``staging-sink: error: ...`` line on stderr, never a traceback; so does a
    missing ``cli`` extra (exit 1).
    """
    if importlib.util.find_spec("rich") is None:
        sys.stderr.write(_NO_RICH)
        return _EXIT_FAILURE
    from sink_cli.dispatch import run  # imports rich (through sink_cli.common and the commands' modules)

    return run(argv)
