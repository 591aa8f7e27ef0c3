"""A ``staging-sink`` command run as a child process, with its output lines waited on as conditions.

:class:`~tests.helpers.processes.Output` collects stdout and stderr line by line; :meth:`Command.wait_for`
blocks until a line of the named stream matches (or the process ends, or the deadline passes: then it fails
naming what it saw), so a test never sleeps for a process to get somewhere.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from tests.helpers.processes import ROOT, Output, Stream

__all__ = ("Command", "staging_sink")


class Command:
    """A running ``python -m sink_cli ...`` and the lines it printed so far."""

    def __init__(self, process: subprocess.Popen[str]) -> None:
        self.process = process
        self.output = Output(process)

    def lines(self, stream: Stream) -> list[str]:
        return self.output.lines(stream)

    def wait_for(self, pattern: str, stream: Stream = "stderr", *, count: int = 1, timeout_s: float = 60.0) -> str:
        """The *count*-th line of *stream* matching *pattern* (a regular expression), once it was printed.

        :raises AssertionError: the process closed its output, or *timeout_s* passed, without such a line.
        """
        return self.output.wait_for(pattern, stream, count=count, timeout_s=timeout_s)

    def wait(self, *, timeout_s: float = 60.0) -> int:
        """The exit code, once the process ended and all its output was read."""
        code = self.process.wait(timeout=timeout_s)
        assert self.output.closed(timeout_s=timeout_s), f"exited {code} but its output did not end"
        return code


@contextmanager
def staging_sink(*args: str) -> Iterator[Command]:
    """Run ``python -m sink_cli ARGS``; killed on exit if it is still running."""
    command: Sequence[str] = [sys.executable, "-m", "sink_cli", *args]
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT) as process:
        running = Command(process)
        try:
            yield running
        finally:
            if process.poll() is None:
                process.kill()
            running.output.closed(timeout_s=30)  # read to the end before the pipes are closed
