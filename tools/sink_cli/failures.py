"""How the command line turns an expected failure into one ``staging-sink: error: ...`` line and an exit code.

Exit codes: 0 success; 1 an operation failed; 2 bad arguments, a malformed URL or rollout id; 3 the server could
not be reached; 130 interrupted (see :mod:`sink_cli.dispatch`).
"""

from __future__ import annotations

import argparse
import sys

import pydantic
import redis.exceptions as redis_errors

from sink.errors import StagingError
from sink_cli.common import EXIT_FAILURE, EXIT_UNREACHABLE, EXIT_USAGE, CommandError, is_unreachable, mask_url

__all__ = ("EXIT_INTERRUPTED", "leaf_error", "report_failure")

EXIT_INTERRUPTED = 130


def leaf_error(exc: BaseException) -> BaseException:
    """The first leaf of an exception group (*exc* itself when it is not a group)."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc


def _fail(message: str, code: int) -> int:
    sys.stderr.write(f"staging-sink: error: {message}\n")
    return code


def report_failure(exc: BaseException, args: argparse.Namespace) -> int | None:
    """The exit code for an expected failure (after printing one line), ``None`` for anything else."""
    url = mask_url(getattr(args, "redis_url", None) or "") or "the server"
    if isinstance(exc, CommandError):
        return _fail(str(exc), exc.exit_code)
    if isinstance(exc, KeyboardInterrupt):
        return _fail("interrupted", EXIT_INTERRUPTED)
    if isinstance(exc, StagingError | redis_errors.RedisError | OSError) and is_unreachable(exc):
        return _fail(
            f"cannot reach Redis at {url}: {str(exc).rstrip('.')}. Is the server running? "
            "(`staging-sink server` starts a local durable one; or pass the right --redis-url)",
            EXIT_UNREACHABLE,
        )
    if isinstance(exc, StagingError | redis_errors.RedisError):
        return _fail(f"{exc}", EXIT_FAILURE)
    if isinstance(exc, pydantic.ValidationError):
        problems = "; ".join(
            f"{'.'.join(str(part) for part in error['loc']) or 'value'}: {error['msg']}"
            for error in exc.errors(include_url=False)
        )
        return _fail(f"invalid setting: {problems}", EXIT_USAGE)
    return None
