"""Server child processes that never outlive their owner.

A :class:`~sink.server.DurableServer` registers each process it starts and each temporary directory it makes;
an ``atexit`` hook kills whatever is still registered and removes the directories. On Linux,
:func:`parent_death_hook` also gives the child a parent-death signal, so even a SIGKILLed pytest leaks
nothing. That signal is set only when starting from the main thread, because Linux delivers it when the
*thread* that forked the child exits.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

__all__ = ("forget_process", "forget_temp_dir", "parent_death_hook", "register_process", "register_temp_dir")

_PR_SET_PDEATHSIG = 1

_live_processes: dict[int, subprocess.Popen[bytes]] = {}
_owned_dirs: set[Path] = set()
_registry_lock = threading.Lock()


def register_process(process: subprocess.Popen[bytes]) -> None:
    """Kill *process* at interpreter exit unless :func:`forget_process` is called first."""
    with _registry_lock:
        _live_processes[process.pid] = process


def forget_process(process: subprocess.Popen[bytes]) -> None:
    """Stop tracking *process* (it exited, or its owner reaped it)."""
    with _registry_lock:
        _live_processes.pop(process.pid, None)


def register_temp_dir(directory: Path) -> None:
    """Remove *directory* at interpreter exit unless :func:`forget_temp_dir` is called first."""
    with _registry_lock:
        _owned_dirs.add(directory)


def forget_temp_dir(directory: Path) -> None:
    """Stop tracking *directory* (its owner removed it)."""
    with _registry_lock:
        _owned_dirs.discard(directory)


def parent_death_hook() -> Callable[[], None] | None:
    """A ``preexec_fn`` that makes the child die with this thread, or ``None`` where that cannot be had."""
    if not sys.platform.startswith("linux") or threading.current_thread() is not threading.main_thread():
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved before fork: no dlopen in the child
    parent_pid = os.getpid()

    def hook() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent_pid:  # the parent died before prctl took effect
            os._exit(1)

    return hook


def _kill_leftovers() -> None:
    with _registry_lock:
        processes = list(_live_processes.values())
        directories = list(_owned_dirs)
    for process in processes:
        if process.poll() is None:
            process.kill()
            process.wait()
    for directory in directories:
        shutil.rmtree(directory, ignore_errors=True)


atexit.register(_kill_leftovers)
