"""Shared pieces of the ``staging-sink`` commands: the Redis target, exit codes, errors and output helpers.

Nothing here reads environment variables; :mod:`sink_cli` resolves every default before a command runs.
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, NoReturn, TextIO
from urllib.parse import urlsplit, urlunsplit

import anyio
import redis.exceptions as redis_errors
from anyio.abc import TaskStatus
from rich.console import Console

from sink.errors import StagingError, StagingUnavailableError
from sink.keys import DEFAULT_NAMESPACE
from sink.service import OutagePolicy
from sink.settings import ConnectionSettings, OutageSettings
from sink.store.connection import Topology, map_redis_errors

__all__ = (
    "EXIT_CANNOT_LISTEN",
    "EXIT_FAILURE",
    "EXIT_OK",
    "EXIT_UNREACHABLE",
    "EXIT_USAGE",
    "URL_SCHEMES",
    "CommandError",
    "CommandParser",
    "DefaultsHelpFormatter",
    "RedisTarget",
    "cancel_on_signal",
    "check_redis_url",
    "connect_topology",
    "int_at_least",
    "is_unreachable",
    "mask_url",
    "namespace_name",
    "non_negative_int",
    "open_topology",
    "positive_int",
    "positive_seconds",
    "service_outage_policy",
    "stderr_console",
    "stdout_console",
    "write_json",
)


class CommandError(StagingError):
    """Raised by a ``staging-sink`` command to end with a one-line message (no traceback) and ``exit_code``
    (1, failed, unless the command says otherwise)."""

    def __init__(self, message: str, *, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


EXIT_OK = 0
EXIT_FAILURE = 1
"""An operation failed, a rollout does not exist or did not verify, or the server refused a command."""
EXIT_USAGE = 2
"""Bad arguments (argparse's own code), a malformed URL or rollout id."""
EXIT_UNREACHABLE = 3
"""The server could not be reached (connection refused, timeout, DNS)."""
EXIT_CANNOT_LISTEN = 4
"""A service (``proxy``, ``engine``) could not listen on its address: the port is in use, or not allowed."""

URL_SCHEMES = ("redis", "rediss", "unix")
_NAMESPACE_RE = re.compile(r"[A-Za-z0-9._-]+")  # the rule of ConnectionSettings.namespace
_CLI_CONNECT_TIMEOUT_S = 3.0


def int_at_least(text: str, minimum: int, expected: str) -> int:
    """Parse an argparse integer argument that must be ``>= minimum``.

    :raises argparse.ArgumentTypeError: *text* is not an integer, or is below *minimum*
        (the message reads "expected {expected}, got ...").
    """
    try:
        value = int(text)
    except ValueError:
        value = minimum - 1
    if value < minimum:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
    return value


def positive_int(text: str) -> int:
    """Argparse type of a positive integer.

    :raises argparse.ArgumentTypeError: not an integer >= 1.
    """
    return int_at_least(text, 1, "a positive integer")


def non_negative_int(text: str) -> int:
    """Argparse type of an integer >= 0.

    :raises argparse.ArgumentTypeError: not an integer >= 0.
    """
    return int_at_least(text, 0, "an integer >= 0")


def positive_seconds(text: str) -> float:
    """Argparse type of a finite positive number of seconds.

    :raises argparse.ArgumentTypeError: not a number, or not in ``(0, inf)``.
    """
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}")
    return value


def namespace_name(text: str) -> str:
    """Argparse type of a key namespace: ASCII letters, digits, ``.``, ``_`` and ``-`` (the settings' rule).

    :raises argparse.ArgumentTypeError: anything else.
    """
    if _NAMESPACE_RE.fullmatch(text) is None:
        raise argparse.ArgumentTypeError(
            f"expected ASCII letters, digits, '.', '_' and '-' (e.g. {DEFAULT_NAMESPACE!r}), got {text!r}"
        )
    return text


class CommandParser(argparse.ArgumentParser):
    """An argument parser whose usage errors are one line: what is wrong and where the help is."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Help that shows every option's default, unless the help text already says it or there is none
    (``None``, ``False``, an empty list)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "default" in text or not action.option_strings or action.default in (None, False, [], argparse.SUPPRESS):
            return action.help
        return f"{text} (default: %(default)s)".lstrip()


def mask_url(url: str) -> str:
    """*url* with any password replaced by ``***`` (for messages and logs)."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<malformed url>"
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    port = f":{parts.port}" if parts.port is not None else ""
    return urlunsplit((parts.scheme, f"{user}:***@{host}{port}", parts.path, parts.query, parts.fragment))


def check_redis_url(url: str) -> str:
    """Return *url* if it looks like a Redis URL (``redis://``, ``rediss://`` or ``unix://``).

    :raises CommandError: (exit 2) it does not; the message says what a valid URL looks like.
    """
    hint = "expected e.g. redis://127.0.0.1:6379 or rediss://user:password@host:6380/0"
    try:
        parts = urlsplit(url)
        port = parts.port  # raises ValueError for a non-numeric or out-of-range port
    except ValueError as exc:
        raise CommandError(f"malformed Redis URL {mask_url(url)!r}: {exc}; {hint}", exit_code=EXIT_USAGE) from exc
    if parts.scheme not in URL_SCHEMES:
        raise CommandError(
            f"malformed Redis URL {mask_url(url)!r}: the scheme must be one of {', '.join(URL_SCHEMES)}; {hint}",
            exit_code=EXIT_USAGE,
        )
    if parts.scheme != "unix" and not parts.hostname:
        raise CommandError(f"malformed Redis URL {mask_url(url)!r}: no host; {hint}", exit_code=EXIT_USAGE)
    if port == 0:
        raise CommandError(f"malformed Redis URL {mask_url(url)!r}: port 0; {hint}", exit_code=EXIT_USAGE)
    return url


def is_unreachable(exc: BaseException) -> bool:
    """Whether *exc* means the server could not be reached at all: :class:`StagingUnavailableError`, or a
    socket or redis-py connection error no layer translated."""
    if isinstance(exc, StagingError):
        return isinstance(exc, StagingUnavailableError)
    if isinstance(exc, redis_errors.AuthenticationError | redis_errors.AuthorizationError):
        return False
    return isinstance(exc, redis_errors.ConnectionError | redis_errors.TimeoutError | OSError)


def service_outage_policy(settings: OutageSettings, service: str) -> OutagePolicy:
    """The outage policy of a service command, its retry lines on stderr."""
    console = stderr_console()
    return OutagePolicy(settings, service, report=lambda line: console.print(line, markup=False, soft_wrap=True))


async def cancel_on_signal(
    scope: anyio.CancelScope, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED
) -> None:
    """Cancel *scope* on the first SIGINT/SIGTERM (a normal stop for services and followers); reports
    started (``await group.start(...)``) once the handlers are installed."""
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        task_status.started()
        async for _signum in signals:
            scope.cancel()
            return


@dataclass(frozen=True, slots=True)
class RedisTarget:
    """Where a command talks to: URL, key namespace and whether the URL is a cluster node."""

    url: str
    namespace: str = DEFAULT_NAMESPACE
    cluster: bool = False

    @property
    def display_url(self) -> str:
        """The URL with its password masked."""
        return mask_url(self.url)

    def settings(self) -> ConnectionSettings:
        """Connection settings with the CLI's short connect timeout."""
        return ConnectionSettings(
            namespace=self.namespace, cluster=self.cluster, connect_timeout_s=_CLI_CONNECT_TIMEOUT_S
        )


@asynccontextmanager
async def open_topology(target: RedisTarget) -> AsyncIterator[Topology]:
    """Connect to *target* and check it answers ``PING``; the topology is closed on exit.

    :raises StagingConnectionError: the server cannot be reached or refuses ``PING``.
    """
    topology = Topology.from_url(target.url, target.settings())
    try:
        await connect_topology(topology, target)
        yield topology
    finally:
        await topology.aclose()


async def connect_topology(topology: Topology, target: RedisTarget) -> None:
    """Initialize *topology* (of *target*) and check that it answers ``PING``.

    :raises StagingConnectionError: the server cannot be reached or refuses ``PING``.
    """
    with map_redis_errors(f"connect to {target.display_url}"):
        await topology.initialize()
        await topology.client.ping()


def _console(stream: TextIO) -> Console:
    """On a terminal: rich's own width handling. Piped: plain text, never hard-wrapped (one record, one line,
    whatever ``COLUMNS`` says), tables laid out 120 columns wide."""
    if stream.isatty():
        return Console(file=stream, highlight=False)
    return Console(file=stream, width=120, soft_wrap=True, highlight=False)


def stdout_console() -> Console:
    """A rich console on stdout (see :func:`_console`)."""
    return _console(sys.stdout)


def stderr_console() -> Console:
    """A rich console on stderr for progress and notes (see :func:`_console`)."""
    return _console(sys.stderr)


def write_json(value: Any, *, one_line: bool = False) -> None:
    """Print *value* as indented JSON on stdout, or as one line (*one_line*: line-delimited output)."""
    sys.stdout.write(json.dumps(value, indent=None if one_line else 2, sort_keys=True, default=str) + "\n")
    if one_line:
        sys.stdout.flush()
