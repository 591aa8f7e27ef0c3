"""``staging-sink`` services as real processes for tests: start, wait for a health URL, collect stderr, stop."""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx

__all__ = ("free_port", "healthy", "service", "wait_for")

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def healthy(url: str) -> bool:
    with contextlib.suppress(httpx.HTTPError):
        return httpx.get(url, timeout=1).status_code == 200
    return False


def wait_for(
    condition: Callable[[], bool], message: str, process: subprocess.Popen[str] | None = None, timeout_s: float = 60
) -> None:
    """Poll *condition* until it holds (fails the test after *timeout_s*, or when *process* died)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert process is None or process.poll() is None, message
        assert time.monotonic() < deadline, message
        time.sleep(0.1)


@contextlib.contextmanager
def service(*argv: str, health: str, module: bool = True) -> Iterator[list[str]]:
    """Run ``staging-sink ARGV`` (or *argv* itself with ``module=False``) until the block ends (SIGTERM), once
    *health* answers 200; yields its stderr lines as they arrive."""
    command = [sys.executable, "-m", "sink", *argv] if module else list(argv)
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    stream = process.stderr
    assert stream is not None
    reader = threading.Thread(target=lambda: lines.extend(line.rstrip("\n") for line in stream), daemon=True)
    reader.start()
    try:
        wait_for(lambda: healthy(health), f"{argv[0]} did not come up: {lines}", process)
        yield lines
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)
        reader.join(timeout=10)
        stream.close()
