"""``python -m sink_cli``: the ``staging-sink`` command line (see :mod:`sink_cli`)."""

from __future__ import annotations

from sink_cli.main import main

__all__ = ()

if __name__ == "__main__":  # the guard matters: demo worker processes (spawn) import this module as __mp_main__
    raise SystemExit(main())
