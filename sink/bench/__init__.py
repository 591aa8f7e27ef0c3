"""Benchmarks runnable as ``python -m sink.bench.<name>`` (and ``staging-sink bench <name>``).

Each module has a ``main(argv=None) -> int`` entry point and a function that
returns the measured figures, so the CLI and tests can use them directly.
"""

from __future__ import annotations

__all__: tuple[str, ...] = ()
