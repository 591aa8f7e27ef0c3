"""Server availability: find a server binary, or skip the test locally and fail it in CI."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from types import ModuleType
from typing import NoReturn

import pytest

from sink import server as sink_server


def running_in_ci() -> bool:
    """Whether the ``CI`` environment variable asks for no skipped server tests."""
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def extra_missing(module: str) -> bool:
    """Whether *module*, an optional extra's, is not installed and CI does not require it."""
    return importlib.util.find_spec(module) is None and not running_in_ci()


def skip_or_fail(reason: str) -> NoReturn:
    """Skip locally; fail in CI, where every server test must run."""
    if running_in_ci():
        pytest.fail(f"{reason} (CI is set, so server tests may not be skipped)", pytrace=False)
    pytest.skip(reason)


def import_or_skip(module: str) -> ModuleType:
    """Import *module* by name, or skip/fail the test when it is not importable."""
    try:
        return __import__(module, fromlist=["_"])
    except ImportError as exc:
        skip_or_fail(f"{module} is not importable yet: {exc}")


def require_binary(name: str) -> Path:
    """The path of server binary ``name``, or skip/fail the test."""
    try:
        return sink_server.find_server_binary(name)
    except sink_server.ServerNotFoundError as exc:
        skip_or_fail(str(exc))


def reset_durable_server(server: sink_server.DurableServer) -> None:
    """Undo what an earlier test may have done to a shared server: resume or restart it, restore the durable
    settings, empty it (through ``server.client()``: an ACL server's admin)."""
    server.resume()
    if not server.running:
        server.restart()
    with server.client() as connection:
        for name, value in (
            ("appendonly", "yes"),
            ("appendfsync", "always"),
            ("no-appendfsync-on-rewrite", "no"),
            ("maxmemory-policy", "noeviction"),
            ("maxmemory", "0"),
        ):
            connection.config_set(name, value)
        connection.flushall()
