"""The demo's worker processes, seen from the parent: start them (``spawn``), follow their progress queue,
notice a failure, and stop them for good."""

from __future__ import annotations

import multiprocessing
import queue
from collections.abc import Sequence
from typing import Any

import anyio

from sink.store.pipeline_counters import pipeline_counters
from sink_tools.demo.report import DemoTally
from sink_tools.demo.worker_process import WorkerConfig, worker_process_main
from worker.errors import WorkersFailedError

__all__ = ("WorkerPool",)

_POLL_INTERVAL_S = 0.05
_JOIN_TIMEOUT_S = 5.0
_NOPERM_HINT = (
    " (with ACL users, --redis-url needs the worker user and --gate-redis-url the gate user, "
    "which writes the ledger and the done events)"
)


class WorkerPool:
    """One process per :class:`WorkerConfig`, all reporting to one queue that feeds a :class:`DemoTally`."""

    def __init__(self, configs: Sequence[WorkerConfig]) -> None:
        context = multiprocessing.get_context("spawn")
        self._queue: Any = context.Queue()
        self._processes: list[Any] = [
            context.Process(
                target=worker_process_main,
                args=(config, self._queue),
                name=f"demo-worker-{config.index}",
                daemon=True,  # never outlive this process, even if it dies without cleaning up
            )
            for config in configs
        ]

    def start(self) -> None:
        """Start every process."""
        for process in self._processes:
            process.start()

    def drain(self, tally: DemoTally) -> None:
        """Apply every queued message to *tally*: progress snapshots, final reports and errors."""
        while True:
            try:
                kind, index, payload = self._queue.get_nowait()
            except queue.Empty:
                return
            if kind == "error":
                hint = _NOPERM_HINT if "NoPermission" in payload or "NOPERM" in payload else ""
                tally.errors.append(f"worker process {index} failed: {payload}{hint}")
            elif kind == "done":
                tally.latencies_ms.extend(payload.pop("latencies_ms"))
                pipeline_counters().merge(payload.pop("metrics", {"counters": [], "latency": {}}))  # for the exporter
                tally.workers[index] = payload
            else:
                tally.workers[index] = payload

    async def supervise(self, tally: DemoTally) -> None:
        """Follow the processes until all exited, feeding *tally*.

        :raises WorkersFailedError: a process exited with a non-zero status (the others are left running;
            :meth:`stop` ends them).
        """
        processes = self._processes
        while any(process.is_alive() for process in processes):
            self.drain(tally)
            if any(process.exitcode not in (None, 0) for process in processes):
                break
            await anyio.sleep(_POLL_INTERVAL_S)
        self.drain(tally)
        failed = [f"{p.name} (exit {p.exitcode})" for p in processes if p.exitcode not in (None, 0)]
        if failed:
            if not tally.errors:
                tally.errors.append(f"worker process(es) failed: {', '.join(failed)}")
            raise WorkersFailedError(", ".join(failed))

    def stop(self, tally: DemoTally) -> None:
        """Terminate what still runs (SIGTERM, then SIGKILL), reap every process, take their last messages."""
        for process in self._processes:
            if process.is_alive():
                process.terminate()
        for process in self._processes:
            if process.pid is None:
                continue  # never started
            process.join(_JOIN_TIMEOUT_S)
            if process.is_alive():
                process.kill()
                process.join()
        self.drain(tally)
        self._queue.close()
        self._queue.cancel_join_thread()
