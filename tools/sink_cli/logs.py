"""Log output of the ``staging-sink`` commands: timestamped text lines, or one JSON object per line.

``--log-format text`` (the default): ``2026-01-31T12:00:00.123+00:00 INFO sink.trainer.reader.rollout_reader: message``.
``--log-format json``: ``{"time": ..., "level": ..., "logger": ..., "message": ...}`` (plus ``exception``
when one is attached), for log shippers. Both go to stderr; times are UTC, ISO 8601.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from datetime import UTC, datetime

__all__ = ("LOG_FORMATS", "JsonLogFormatter", "TextLogFormatter", "add_logging_options", "configure_logging")

LOG_FORMATS = ("text", "json")


def _timestamp(record: logging.LogRecord) -> str:
    return datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds")


class TextLogFormatter(logging.Formatter):
    """``<ISO 8601 UTC time> <LEVEL> <logger>: <message>``, then the traceback if any."""

    def format(self, record: logging.LogRecord) -> str:
        line = f"{_timestamp(record)} {record.levelname} {record.name}: {record.getMessage()}"
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


class JsonLogFormatter(logging.Formatter):
    """One JSON object per record: ``time``, ``level``, ``logger``, ``message`` and ``exception`` if any."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": _timestamp(record),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, sort_keys=True)


def configure_logging(*, verbose: bool, log_format: str) -> None:
    """Log to stderr at INFO (*verbose*) or WARNING in *log_format* (one of :data:`LOG_FORMATS`); a no-op when
    the root logger already has handlers (an embedding application or a test harness configured it).

    :raises ValueError: unknown *log_format*.
    """
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {', '.join(LOG_FORMATS)}, got {log_format!r}")
    root = logging.getLogger()
    if root.handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonLogFormatter() if log_format == "json" else TextLogFormatter())
    root.addHandler(handler)
    root.setLevel(logging.INFO if verbose else logging.WARNING)


def add_logging_options(parser: argparse.ArgumentParser, *, default: object, log_format: str) -> None:
    """``-v`` and ``--log-format``, on the top-level parser and again on each command (so they are accepted
    after the command too; there the defaults are suppressed, so they never undo an earlier flag)."""
    group = parser.add_argument_group("logging")
    group.add_argument("-v", "--verbose", action="store_true", default=default, help="log INFO messages to stderr")
    group.add_argument(
        "--log-format",
        choices=LOG_FORMATS,
        default=log_format,
        help="stderr log lines: timestamped text, or one JSON object per line (default: text)",
    )
