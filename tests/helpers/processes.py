"""Child processes for tests: their output lines waited on as conditions, and ``staging-sink`` services that
run until a block ends.

:class:`Output` collects a process's stdout and stderr line by line (one reader thread per pipe);
:meth:`Output.wait_for` blocks until a line of the named stream matches (or the pipe closes, or the deadline
passes: then it fails naming what it saw). A test waits on the stream that carries the line it needs, never
on one stream and then reads the other, and never reads a pipe without a deadline.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import IO, Literal

import anyio
import httpx

from tests.helpers.tls import tls

__all__ = ("Output", "Stream", "free_port", "healthy", "service", "stop", "until", "wait_for")

ROOT = Path(__file__).resolve().parents[2]
Stream = Literal["stdout", "stderr"]


# Ports a test hands to a service it starts: below the kernel's ephemeral range (an outgoing connection, of this
# test or another, never takes one between the pick and the service's bind) and below the range the local
# cluster nodes of ``sink.server`` pick from (12000 and up), one slice per pytest-xdist worker (no other worker
# picks the same port).
_TEST_PORTS = range(2000, 12000)


def _ephemeral_low() -> int:
    with contextlib.suppress(OSError, ValueError):
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    return 32768


@functools.cache
def _worker_slice() -> range:
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw"))
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    top = min(_TEST_PORTS.stop, _ephemeral_low())
    size = (top - _TEST_PORTS.start) // workers
    assert size >= 100, f"no room for test ports below the ephemeral range ({top}) for {workers} workers"
    start = _TEST_PORTS.start + worker * size
    return range(start, start + size)


@functools.cache
def _slice_cursor() -> Iterator[int]:
    return itertools.cycle(_worker_slice())


def free_port() -> int:
    """A loopback port free right now, that nothing else picks before the test's service binds it: from this
    worker's own slice below the ephemeral range, each port handed out once per slice round, skipping ports
    something is bound to (a server of another run, a socket in TIME_WAIT)."""
    for _ in range(len(_worker_slice())):
        port = next(_slice_cursor())
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise AssertionError(f"no free port in {_worker_slice()}")


def healthy(url: str) -> bool:
    with contextlib.suppress(httpx.HTTPError):
        return httpx.get(url, timeout=1, verify=tls()).status_code == 200
    return False


def wait_for(
    condition: Callable[[], bool],
    message: str | Callable[[], str],
    process: subprocess.Popen[str] | None = None,
    timeout_s: float = 60,
) -> None:
    """Poll *condition* until it holds (fails the test after *timeout_s*, or when *process* died); *message*
    may be a function, called at the failure (to show what was seen by then)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        failed = process is not None and process.poll() is not None or time.monotonic() >= deadline
        assert not failed, message() if callable(message) else message
        time.sleep(0.1)


async def until(
    condition: Callable[[], bool | Awaitable[bool]], message: str | Callable[[], str], *, timeout_s: float = 60
) -> None:
    """Poll *condition* (plain or async) until it holds; fails the test after *timeout_s* with *message* (or
    what the function *message* returns then). For a state another task or the server changes: never a sleep."""
    with anyio.move_on_after(timeout_s):
        while True:
            held = condition()
            if held if isinstance(held, bool) else await held:
                return
            await anyio.sleep(0.01)
    raise AssertionError(message() if callable(message) else message)


class Output:
    """The lines *process* printed so far on its piped streams (stdout and/or stderr, opened in text mode)."""

    def __init__(self, process: subprocess.Popen[str]) -> None:
        pipes: dict[Stream, IO[str] | None] = {"stdout": process.stdout, "stderr": process.stderr}
        self._lines: dict[Stream, list[str]] = {name: [] for name, pipe in pipes.items() if pipe is not None}
        self._changed = threading.Condition()
        self._open = len(self._lines)
        for name, pipe in pipes.items():
            if pipe is not None:
                threading.Thread(target=self._collect, args=(name, pipe), daemon=True).start()

    def _collect(self, name: Stream, pipe: IO[str]) -> None:
        try:
            for line in pipe:
                with self._changed:
                    self._lines[name].append(line.rstrip("\n"))
                    self._changed.notify_all()
        finally:
            with self._changed:
                self._open -= 1
                self._changed.notify_all()

    def lines(self, stream: Stream = "stderr") -> list[str]:
        with self._changed:
            return list(self._lines[stream])

    def wait_for(self, pattern: str, stream: Stream = "stderr", *, count: int = 1, timeout_s: float = 60.0) -> str:
        """The *count*-th line of *stream* matching *pattern* (a regular expression, searched), once printed.

        :raises AssertionError: the process closed its output, or *timeout_s* passed, without such a line.
        """
        regex = re.compile(pattern)

        def found() -> list[str]:
            return [line for line in self._lines[stream] if regex.search(line)]

        with self._changed:
            self._changed.wait_for(lambda: len(found()) >= count or self._open == 0, timeout=timeout_s)
            lines = found()
            assert len(lines) >= count, (
                f"{len(lines)} of {count} {stream} line(s) matching {pattern!r}; saw {self._lines}"
            )
            return lines[count - 1]

    def closed(self, *, timeout_s: float = 60.0) -> bool:
        """Whether every pipe reached its end (the process and its children closed them) within *timeout_s*."""
        with self._changed:
            return self._changed.wait_for(lambda: self._open == 0, timeout=timeout_s)


def stop(process: subprocess.Popen[str], *, timeout_s: float = 30) -> None:
    """SIGTERM *process* and wait for it; SIGKILL it if it does not end within *timeout_s*."""
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=10)


@contextlib.contextmanager
def service(*argv: str, health: str, module: bool = True) -> Iterator[Output]:
    """Run ``staging-sink ARGV`` (or *argv* itself with ``module=False``) until the block ends (SIGTERM), once
    *health* answers 200; yields its :class:`Output` (stderr only: stdout is discarded)."""
    command = [sys.executable, "-m", "sink_cli", *argv] if module else list(argv)
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    output = Output(process)
    try:
        wait_for(lambda: healthy(health), lambda: f"{argv[0]} did not come up: {output.lines()}", process)
        yield output
    finally:
        stop(process)
        output.closed(timeout_s=10)
        assert process.stderr is not None
        process.stderr.close()
