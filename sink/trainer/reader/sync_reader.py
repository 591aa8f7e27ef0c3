"""The synchronous trainer reader: :class:`RolloutReader`'s semantics for loops that are not async.

:class:`SyncRolloutReader` runs a :class:`~sink.trainer.reader.rollout_reader.RolloutReader` on a
private event-loop thread (the :class:`~sink.store.resource.PortalOwner`
facade, like :class:`~sink.store.sink.RedisStagingSink`). Every method is
thread-safe: calls from several threads are serialized on the loop, one at a
time and in the order they came, so a heartbeat thread can run beside the training loop (a thread that pulls in a
loop never keeps another waiting longer than for the call in progress).

:class:`WorkerAcks` runs on one in a ``DataLoader`` worker (:mod:`sink.trainer.torch_data`; no torch here): the
loading process sends each acknowledgement to the worker whose reader holds the batch's rollouts (one request
queue and one answer queue per worker), and a thread applies it at once, after the reader call in progress, and
answers; it also renews the reader's leases while the worker waits for the loader. A worker's pass over the
dataset (its *iteration*) ends with a :data:`STOPPED` answer: its batches can no longer be acknowledged
(:func:`give_back` gave them back).
"""

from __future__ import annotations

import logging
import multiprocessing.queues
import pickle
import queue
import secrets
import threading
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, Self, TypeVar

from sink.errors import BatchInputError, StagingError
from sink.settings import ReaderSettings
from sink.store.resource import PortalOwner
from sink.trainer.groups import GroupReader, RolloutGroup
from sink.trainer.pulled import PulledRollout
from sink.trainer.reader.guards import AckOutcome
from sink.trainer.reader.rollout_reader import RolloutReader
from sink.trainer.statistics import ReaderStatistics

__all__ = ("RENEWALS_PER_IDLE", "STOPPED", "Answer", "Request", "SyncRolloutReader", "WorkerAcks", "give_back")

T = TypeVar("T")
_log = logging.getLogger(__name__)
_POLL_S = 0.25  # how soon a WorkerAcks thread notices that its worker stops

RENEWALS_PER_IDLE = 8
"""Leases are renewed every ``claim_idle_ms`` / this, as :meth:`~sink.trainer.reader.rollout_reader.RolloutReader.pull` does."""
STOPPED = -1
"""In a :class:`WorkerAcks` answer, in place of a request number: the worker's pass over the dataset stopped."""
Request = tuple[str, int, list[str]]
"""One acknowledgement request to a worker: (iteration, request number, rollout ids)."""
Answer = tuple[str, int, list[str], BaseException | None]
"""Its answer: (iteration, request number or :data:`STOPPED`, rollouts whose lease was lost, the error or None)."""


class _TurnLock:
    """A lock taken in the order it was asked for (``threading.Lock`` is not: a thread that releases it and asks
    again at once may take it before a thread that was waiting)."""

    def __init__(self) -> None:
        self._turns = threading.Condition()
        self._next = 0  # the next ticket to hand out
        self._serving = 0  # the ticket whose turn it is

    def __enter__(self) -> None:
        with self._turns:
            ticket, self._next = self._next, self._next + 1
            self._turns.wait_for(lambda: self._serving == ticket)

    def __exit__(self, *_exc: object) -> None:
        with self._turns:
            self._serving += 1
            self._turns.notify_all()


class SyncRolloutReader(PortalOwner[RolloutReader]):
    """Synchronous, thread-safe :class:`~sink.trainer.reader.rollout_reader.RolloutReader`: ``pull``, ``heartbeat``, ``ack``,
    ``statistics``, and :meth:`pull_groups` (GRPO groups, see :mod:`sink.trainer.groups`).

    Open with :meth:`from_url`; close with :meth:`close` or a ``with`` block.
    Rollouts still held at close stay pending (reclaimable), as with the async reader.
    """

    def __init__(self, resource: RolloutReader) -> None:
        super().__init__(resource)
        # One reader call at a time, in turn: the reader's bookkeeping is not re-entrant across awaits.
        self._serial = _TurnLock()
        self._groups: GroupReader | None = None

    @classmethod
    def from_url(cls, url: str, settings: ReaderSettings | None = None, **fields: Any) -> Self:
        """Open a reader on *url*; the arguments are :meth:`RolloutReader.from_url`'s."""
        return cls(RolloutReader.from_url(url, settings, **fields))

    def _serialized(self, func: Callable[..., Awaitable[T]], *args: Any) -> T:
        with self._serial:
            return self._call(func, *args)

    @property
    def consumer_name(self) -> str:
        return self._resource.consumer_name

    @property
    def held_rollouts(self) -> tuple[str, ...]:
        return self._resource.held_rollouts

    def pull(self, max_rollouts: int, *, block_ms: int = 0) -> list[PulledRollout]:
        """Thread-safe :meth:`RolloutReader.pull`."""

        async def run() -> list[PulledRollout]:
            return await self._resource.pull(max_rollouts, block_ms=block_ms)

        return self._serialized(run)

    def pull_groups(self, max_groups: int, *, block_ms: int = 0) -> list[RolloutGroup]:
        """Thread-safe :meth:`sink.trainer.groups.GroupReader.pull_groups` over this reader."""
        with self._serial:
            if self._groups is None:
                self._groups = GroupReader(self._resource)
            groups = self._groups

            async def run() -> list[RolloutGroup]:
                return await groups.pull_groups(max_groups, block_ms=block_ms)

            return self._call(run)

    def ack_groups(self, groups: Iterable[RolloutGroup]) -> None:
        """Thread-safe :meth:`sink.trainer.groups.GroupReader.ack_groups`: acknowledge delivered groups after the step."""
        delivered = list(groups)
        with self._serial:
            if self._groups is None:
                self._groups = GroupReader(self._resource)
            self._call(self._groups.ack_groups, delivered)

    def heartbeat(self) -> int:
        """Thread-safe :meth:`RolloutReader.heartbeat`."""
        return self._serialized(self._resource.heartbeat)

    def ack(self, rollout_ids: Iterable[str]) -> AckOutcome:
        """Thread-safe :meth:`RolloutReader.ack`."""
        if isinstance(rollout_ids, str | bytes):
            raise TypeError("ack() takes a collection of rollout ids, not a single str")
        ids = list(rollout_ids)
        return self._serialized(self._resource.ack, ids)

    def release_unpulled(self) -> int:
        """Thread-safe :meth:`RolloutReader.release_unpulled`."""
        return self._serialized(self._resource.release_unpulled)

    def release_held(self) -> int:
        """Thread-safe :meth:`RolloutReader.release_held`."""
        return self._serialized(self._resource.release_held)

    def set_weight_version(self, version: int) -> None:
        """Thread-safe :meth:`RolloutReader.set_weight_version`."""
        with self._serial:
            self._resource.set_weight_version(version)

    def pending(self) -> int:
        """Thread-safe :meth:`RolloutReader.pending`."""
        return self._serialized(self._resource.pending)

    def retire_consumer(self) -> int:
        """Thread-safe :meth:`RolloutReader.retire_consumer`."""
        return self._serialized(self._resource.retire_consumer)

    def statistics(self) -> ReaderStatistics:
        with self._serial:
            return self._resource.statistics()

    def __repr__(self) -> str:
        return repr(self._resource).replace("<RolloutReader", "<SyncRolloutReader", 1)


class WorkerAcks:
    """A ``DataLoader`` worker's acknowledging thread, for one pass over the dataset (*iteration*): applies each
    acknowledgement the loading process sends at once and answers it, and renews the worker's leases every
    *renew_every_s* while the worker waits for the loader. Started on construction; :meth:`stop` ends it."""

    def __init__(
        self,
        reader: SyncRolloutReader,
        requests: multiprocessing.queues.Queue[Request],
        answers: multiprocessing.queues.Queue[Answer],
        *,
        renew_every_s: float,
    ) -> None:
        self.iteration = secrets.token_hex(8)
        self._reader = reader
        self._requests = requests
        self._answers = answers
        self._renew_every_s = renew_every_s
        self._expected: set[str] = set()
        self._acknowledged = threading.Condition()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"{reader.consumer_name}-acks", daemon=True)
        self._thread.start()

    def expect(self, rollout_ids: tuple[str, ...]) -> None:
        """*rollout_ids* went out in a batch: :meth:`wait_for_all` waits for their acknowledgement."""
        with self._acknowledged:
            self._expected.update(rollout_ids)

    def wait_for_all(self, timeout_s: float) -> set[str]:
        """Wait up to *timeout_s* until every expected rollout is acknowledged; return those that are not."""
        with self._acknowledged:
            self._acknowledged.wait_for(lambda: not self._expected, timeout=timeout_s)
            return set(self._expected)

    def stop(self) -> None:
        """End the thread, then tell the loading process this pass stopped (its batches can no longer be acked)."""
        self._stopping.set()
        self._thread.join()
        self._answers.put((self.iteration, STOPPED, [], None))

    def _run(self) -> None:
        renewed_at = time.monotonic()
        while not self._stopping.is_set():
            try:
                self._answer(*self._requests.get(timeout=_POLL_S))
            except queue.Empty:
                pass
            if time.monotonic() - renewed_at >= self._renew_every_s:
                renewed_at = time.monotonic()
                try:
                    self._reader.heartbeat()
                except StagingError as exc:
                    _log.warning("%s: could not renew its leases (%s); trying again", self._reader.consumer_name, exc)

    def _answer(self, iteration: str, number: int, rollout_ids: list[str]) -> None:
        lost: list[str] = []
        error: BaseException | None = None
        if iteration != self.iteration:
            error = BatchInputError(
                f"a batch of an earlier pass of {self._reader.consumer_name}: that pass gave its rollouts back when "
                "it stopped, and they are delivered again"
            )
        else:
            try:
                lost = self._reader.ack(rollout_ids).lost_lease
            except Exception as exc:  # noqa: BLE001 - handed to the loading process, whose ack() raises it
                error = exc if _pickles(exc) else StagingError(f"{type(exc).__name__}: {exc}")
            else:
                with self._acknowledged:
                    self._expected.difference_update(rollout_ids)
                    self._acknowledged.notify_all()
        self._answers.put((iteration, number, lost, error))


def _pickles(exc: Exception) -> bool:
    """Whether *exc* survives pickling, to cross to the loading process."""
    try:
        pickle.loads(pickle.dumps(exc))
    except (pickle.PickleError, TypeError, AttributeError, ValueError):
        return False
    return True


def give_back(reader: SyncRolloutReader) -> None:
    """The reader stops: what it has in hand goes to the next reader at once (else after ``claim_idle_ms``)."""
    try:
        reader.release_unpulled()
        reader.release_held()
    except StagingError as exc:
        _log.warning(
            "%s: could not give back the rollouts in hand (%s): they are reclaimed after claim_idle_ms",
            reader.consumer_name,
            exc,
        )
