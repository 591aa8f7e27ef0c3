"""The ``staging-sink`` entry point (``sink_cli.main:main``; ``python -m sink_cli`` runs it too).

Everything is :mod:`sink_cli.dispatch` (the parser, the environment defaults, the exit codes).
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ("main",)


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``staging-sink`` with *argv* (default ``sys.argv[1:]``) and return the exit code.

    Operational failures print one ``staging-sink: error: ...`` line on stderr, never a traceback.
    """
    # Imported here: the demo's worker processes (spawn) import ``sink_cli.__main__``, and with it this module, as
    # ``__mp_main__``; they need none of the parser and its command modules.
    from sink_cli.dispatch import run

    return run(argv)
