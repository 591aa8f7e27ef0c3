"""Shared pytest fixtures. Server fixtures are added by the server module's owner."""

from __future__ import annotations

import pytest


@pytest.fixture
def anyio_backend() -> str:
    # redis-py's asyncio client does not run on trio.
    return "asyncio"
