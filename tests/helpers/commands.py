"""A ``staging-sink`` command run as a child process, with its output lines waited on as conditions.

Two reader threads collect stdout and stderr line by line; :meth:`Command.wait_for` blocks until a line
matches (or the process ends, or the deadline passes: then it fails naming what it saw), so a test never
sleeps for a process to get somewhere.
"""

from __future__ import annotations

import re
import subprocess
import sys
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Literal

__all__ = ("Command", "staging_sink")

ROOT = Path(__file__).resolve().parents[2]
Stream = Literal["stdout", "stderr"]


class Command:
    """A running ``python -m sink ...`` and the lines it printed so far."""

    def __init__(self, process: subprocess.Popen[str]) -> None:
        self.process = process
        self._lines: dict[Stream, list[str]] = {"stdout": [], "stderr": []}
        self._changed = threading.Condition()
        self._open = 2
        assert process.stdout is not None and process.stderr is not None
        for name, pipe in (("stdout", process.stdout), ("stderr", process.stderr)):
            threading.Thread(target=self._collect, args=(name, pipe), daemon=True).start()

    def _collect(self, name: Stream, pipe: IO[str]) -> None:
        for line in pipe:
            with self._changed:
                self._lines[name].append(line.rstrip("\n"))
                self._changed.notify_all()
        with self._changed:
            self._open -= 1
            self._changed.notify_all()

    def lines(self, stream: Stream) -> list[str]:
        with self._changed:
            return list(self._lines[stream])

    def wait_for(self, pattern: str, stream: Stream = "stderr", *, count: int = 1, timeout_s: float = 60.0) -> str:
        """The *count*-th line of *stream* matching *pattern* (a regular expression), once it was printed.

        :raises AssertionError: the process closed its output, or *timeout_s* passed, without such a line.
        """
        regex = re.compile(pattern)

        def found() -> list[str]:
            return [line for line in self._lines[stream] if regex.search(line)]

        with self._changed:
            self._changed.wait_for(lambda: len(found()) >= count or self._open == 0, timeout=timeout_s)
            lines = found()
            assert len(lines) >= count, f"{len(lines)} of {count} {stream} line(s) matching {pattern!r}; saw {self._lines}"
            return lines[count - 1]

    def wait(self, *, timeout_s: float = 60.0) -> int:
        """The exit code, once the process ended and its output was read."""
        code = self.process.wait(timeout=timeout_s)
        with self._changed:
            self._changed.wait_for(lambda: self._open == 0, timeout=timeout_s)
        return code


@contextmanager
def staging_sink(*args: str) -> Iterator[Command]:
    """Run ``python -m sink ARGS``; killed on exit if it is still running."""
    command: Sequence[str] = [sys.executable, "-m", "sink", *args]
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT) as process:
        try:
            yield Command(process)
        finally:
            if process.poll() is None:
                process.kill()
