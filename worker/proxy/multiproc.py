"""Metrics of a proxy with several uvicorn workers: prometheus-client's multiprocess mode.

With ``staging-sink proxy --workers N`` a scrape of ``/staging-sink/metrics`` reaches one worker at random, so
every worker writes its samples to memory-mapped files in ``$PROMETHEUS_MULTIPROC_DIR`` (a fresh directory per
proxy start, made by the parent before the workers start and removed when it stops) and any worker answers a
scrape with the sum over all of them (``MultiProcessCollector``). A worker marks itself dead when it stops.
With one worker nothing of this is used: the proxy serves its own registry.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from types import ModuleType

__all__ = ("MULTIPROC_ENV", "mark_process_dead", "multiprocess_directory", "multiprocess_exposition", "multiprocess_mode")

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"


@contextlib.contextmanager
def multiprocess_directory() -> Iterator[str]:
    """A fresh ``$PROMETHEUS_MULTIPROC_DIR`` for the workers started inside the block (inherited through the
    environment); the previous value comes back and the directory is removed afterwards."""
    path = tempfile.mkdtemp(prefix="staging-sink-proxy-metrics-")
    previous = os.environ.get(MULTIPROC_ENV)
    os.environ[MULTIPROC_ENV] = path
    try:
        yield path
    finally:
        if previous is None:
            os.environ.pop(MULTIPROC_ENV, None)
        else:
            os.environ[MULTIPROC_ENV] = previous
        shutil.rmtree(path, ignore_errors=True)


def multiprocess_mode() -> bool:
    """Whether this process writes its samples to a multiprocess directory."""
    return bool(os.environ.get(MULTIPROC_ENV))


def multiprocess_exposition(prometheus: ModuleType) -> bytes:
    """The text exposition of every worker's samples, summed (a fresh registry per scrape, as documented)."""
    registry = prometheus.CollectorRegistry()
    importlib.import_module("prometheus_client.multiprocess").MultiProcessCollector(registry)
    data: bytes = prometheus.generate_latest(registry)
    return data


def mark_process_dead() -> None:
    """Tell the multiprocess files this worker is gone (its live gauges stop counting; counters stay summed)."""
    if multiprocess_mode():
        importlib.import_module("prometheus_client.multiprocess").mark_process_dead(os.getpid())
