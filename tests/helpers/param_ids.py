"""Parametrize ids that are the same in every process (pytest-xdist compares the collections of its workers)."""

from __future__ import annotations

import re

_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def stable_repr(value: object) -> str:
    """``repr(value)`` without memory addresses (``<object object at 0x7f...>`` becomes ``<object object>``)."""
    return _ADDRESS.sub("", repr(value))
