"""What every long-running service shares (assembler, ``staging-sink trainer``, ``staging-sink prune
--interval-s``): the outage policy, and for the consumers the reclaim schedule.

The line between waiting and stopping is drawn by type where redis-py errors are translated
(:func:`sink.store.connection.translate_redis_error`):

- :class:`~sink.errors.StagingUnavailableError` (the server cannot be reached, or a cluster's topology changed
  under the client: ``MOVED``, ``ASK``, ``READONLY``, ``TRYAGAIN``, ``CLUSTERDOWN`` during a failover or a slot
  migration, the failed command having reloaded the slot map): ridden out, in every phase of the service
  (opening, running, closing), with a pause that doubles from ``reconnect_backoff_s`` up to
  ``reconnect_backoff_max_s``, until the outage has lasted ``max_outage_s``; then it is raised again, naming
  the limit (the command exits 3). An outage begins at the first failure and only a success ends it, so one
  that spans two phases is one outage.
- :class:`~sink.errors.StagingRefusedError` (the server answered with an error: ``WRONGTYPE``, ``NOPERM``,
  ``OOM``...): retrying sends the same command to the same answer, so the service stops at once with
  :class:`~sink.errors.UnrecoverableServiceError` (the command exits 1).

The settings are those of :class:`~sink.settings.OutageSettings` (the assembler's, the reader's and prune's).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable
from typing import Literal, TypeVar

import anyio

from sink.errors import StagingConnectionError, StagingUnavailableError, UnrecoverableServiceError
from sink.settings import OutageSettings, ServiceSettings

__all__ = ("OutagePolicy", "Phase", "ReclaimSchedule", "leaf_errors")

logger = logging.getLogger(__name__)

T = TypeVar("T")
Phase = Literal["opening", "running", "closing"]


def leaf_errors(exc: BaseException) -> list[BaseException]:
    """*exc* itself, or every leaf of an exception group (a task group's failures)."""
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for inner in exc.exceptions for leaf in leaf_errors(inner)]
    return [exc]


class ReclaimSchedule:
    """When a consumer next looks for entries crashed consumers left pending: every ``reclaim_interval_s``."""

    def __init__(self, settings: ServiceSettings) -> None:
        self._interval_s = settings.reclaim_interval_s
        self._next_at = -math.inf

    def due(self) -> bool:
        """Whether a reclaim is due now; if so, the next one is scheduled one interval later."""
        now = anyio.current_time()
        if now < self._next_at:
            return False
        self._next_at = now + self._interval_s
        return True


class OutagePolicy:
    """One service's outage policy (see the module). Share one instance across the service's phases and tasks.

    :param service: who waits, for messages (``"assembler host-1-abc"``).
    :param report: where the retry and recovery lines go (default: the module's logger, as warnings).
    """

    def __init__(self, settings: OutageSettings, service: str, *, report: Callable[[str], None] | None = None) -> None:
        self._settings = settings
        self.service = service
        self._report = report or logger.warning
        self._started_at: float | None = None
        self.retries = 0
        """Failed attempts ridden out since the service started."""

    @property
    def in_outage(self) -> bool:
        return self._started_at is not None

    def succeeded(self) -> None:
        """A command reached the server: the outage, if any, is over."""
        if self._started_at is not None:
            self._report(f"{self.service}: the server is reachable again")
        self._started_at = None

    async def failed(self, exc: BaseException, phase: Phase) -> None:
        """Wait before the next attempt after *exc*, or raise.

        :raises UnrecoverableServiceError: *exc* is (or holds) a refusal, not an outage.
        :raises StagingUnavailableError: the outage has lasted ``max_outage_s``.
        :raises BaseException: *exc* itself when it is not the server's failure at all (a bug, a cancellation).
        """
        leaves = leaf_errors(exc)
        if not all(isinstance(leaf, StagingConnectionError) for leaf in leaves):
            raise exc
        refused = [leaf for leaf in leaves if not isinstance(leaf, StagingUnavailableError)]
        if refused:
            raise UnrecoverableServiceError(
                f"{self.service} stopped: {refused[0]} (retrying cannot fix this: check the ACL user, the password "
                "and that nothing else writes the namespace's keys)"
            ) from refused[0]
        first = leaves[0]
        assert isinstance(first, StagingUnavailableError)
        now = anyio.current_time()
        if self._started_at is None:
            self._started_at = now
        elapsed = now - self._started_at
        limit = self._settings.max_outage_s
        left = math.inf if limit is None else limit - elapsed
        if left <= 0:
            raise first.restated(
                f"{self.service} gave up: the server was unreachable for longer than max_outage_s={limit:g} s ({first})"
            ) from exc
        # The pause doubles the outage so far (exponential backoff), whichever task of the service failed.
        settings = self._settings
        delay = min(max(settings.reconnect_backoff_s, elapsed), settings.reconnect_backoff_max_s, left)
        self.retries += 1
        self._report(f"{self.service}: server unreachable while {phase} ({first}); retrying in {delay:.2g} s")
        await anyio.sleep(delay)

    async def ride_out(self, step: Callable[[], Awaitable[T]], phase: Phase) -> T:
        """``await step()``, again after each outage's pause (:meth:`failed`) until it succeeds, up to
        ``max_outage_s``; any other error (a refusal too) is raised as it is. For one step of a service's work
        (one event of a batch) whose refusal the service sets aside instead of stopping."""
        while True:
            try:
                return await step()
            except StagingUnavailableError as exc:
                await self.failed(exc, phase)

    async def call(self, operation: Callable[[], Awaitable[T]], phase: Phase) -> T:
        """``await operation()``, again after each outage failure (:meth:`failed`), until it succeeds."""
        while True:
            try:
                result = await operation()
            except (StagingConnectionError, BaseExceptionGroup) as exc:
                await self.failed(exc, phase)
                continue
            self.succeeded()
            return result
