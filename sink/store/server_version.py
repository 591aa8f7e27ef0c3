"""Redis/Valkey server versions: ``"7.2.4"`` text to a comparable ``(major, minor)``, and what a version supports.

Every Valkey release reports ``redis_version`` 7.2 or later (the Redis version it is compatible with).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Final

__all__ = ("WAITAOF_SINCE", "parse_server_version", "supports_waitaof")

WAITAOF_SINCE: Final = (7, 2)
"""First Redis version with ``WAITAOF`` (every Valkey release has it)."""

_VERSION_RE: Final = re.compile(r"(\d+)\.(\d+)")


def parse_server_version(text: str) -> tuple[int, int]:
    """``(major, minor)`` of a version like ``7.2`` or ``8.0.1`` (``INFO``'s ``redis_version``, ``--version``).

    :raises ValueError: *text* does not start with ``<major>.<minor>``.
    """
    match = _VERSION_RE.match(text)
    if match is None:
        raise ValueError(f"server_version must look like '7.2' or '8.0.1', got {text!r}")
    return int(match.group(1)), int(match.group(2))


def supports_waitaof(server_info: Mapping[str, object]) -> bool:
    """Whether the server that replied *server_info* (``INFO server``, parsed by redis-py) knows ``WAITAOF``."""
    if "valkey_version" in server_info:
        return True
    # redis-py parses INFO into text and numbers, never bytes.
    try:
        return parse_server_version(str(server_info.get("redis_version", "0"))) >= WAITAOF_SINCE
    except ValueError:
        return False
