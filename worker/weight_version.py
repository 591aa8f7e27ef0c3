"""Where a call's ``weight_version`` comes from: the engine's spans, or the trainer's published version.

**From the engine** (vLLM 0.32's generate route): each choice carries ``weight_versions``, spans
``{version, start, end}`` over output-token indexes telling which weights sampled which tokens; the labels are
strings. The record's ``weight_version`` is an integer, so:

* a label maps to an int by :class:`WeightLabelRule`: a decimal integer label (``"7"``) is that integer; the label
  ``"default"`` (what vLLM reports until ``/update_weight_version`` is called) is ``default_version`` when one is
  configured and a refusal otherwise; any other label is a refusal. The proxy checks the label of
  ``GET /weight_info`` at start, so an engine whose labels cannot be mapped stops it there, with the label named;
* a call sampled across a weight update (several spans) is stamped with its **oldest** version, the minimum
  over its spans: staleness (``max_weight_lag``) is then never under-estimated. The spans must tile the output
  ``[0, n)`` in order, or the answer is refused.

**From the trainer** where the engine reports nothing: :class:`PublishedWeightVersion` reads the namespace's key
(:mod:`sink.trainer.weights`) at most once per ``max_staleness_s``; a call is stamped with a version read no more
than ``max_staleness_s`` (plus one Redis round trip) before it was admitted. ``--weight-version`` stays a fixed
override of both, and the fallback while nothing is published. A published version that was **deleted** (the key
existed, then vanished: :func:`sink.trainer.weights.read_published_state`) keeps that fallback, loudly: one error
line when it is found deleted, one line when a version is published again (per process), and
:attr:`PublishedWeightVersion.deleted` for the proxy to count the calls stamped meanwhile.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import anyio

from sink.contract.digest_encoding import decimal_u64
from sink.keys import weight_version_key
from sink.trainer.weights import read_published_state
from worker.errors import CaptureError

__all__ = ("PublishedWeightVersion", "WeightLabelRule", "WeightVersionError", "version_of_spans")

logger = logging.getLogger(__name__)


class WeightVersionError(CaptureError):
    """An engine weight label that the rule cannot map, or ``weight_versions`` spans that do not tile the output."""


@dataclass(frozen=True)
class WeightLabelRule:
    """How the engine's string labels map to the record's integer ``weight_version``."""

    default_version: int | None = None
    """The version of the label ``"default"`` (vLLM's label before any update); ``None`` refuses it."""

    def version_of(self, label: object) -> int:
        """The integer version of *label*.

        :raises WeightVersionError: not a decimal integer, nor ``"default"`` with a configured value.
        """
        version = decimal_u64(label) if isinstance(label, str) else None
        if version is not None:
            return version
        if label == "default" and self.default_version is not None:
            return self.default_version
        hint = " (configure the version of 'default')" if label == "default" else ""
        raise WeightVersionError(f"engine weight label {label!r} is not a non-negative integer below 2**64{hint}")


def version_of_spans(spans: Sequence[Any], output_length: int, rule: WeightLabelRule) -> int:
    """The record's ``weight_version`` of a call whose output was sampled under *spans*: the oldest (minimum).

    :raises WeightVersionError: no span, spans that do not tile ``[0, output_length)`` in order, or a label the
        rule refuses.
    """
    if not spans:
        raise WeightVersionError("the engine reported no weight_versions span")
    position = 0
    versions = []
    for span in spans:
        if not isinstance(span, dict):
            raise WeightVersionError(f"weight_versions span {span!r} is not an object")
        start, end = span.get("start"), span.get("end")
        if type(start) is not int or type(end) is not int or start != position or end < start:
            raise WeightVersionError(f"weight_versions spans {list(spans)!r} do not tile the output from {position}")
        versions.append(rule.version_of(span.get("version")))
        position = end
    if position != output_length:
        raise WeightVersionError(f"weight_versions spans end at {position}, the output has {output_length} ids")
    return min(versions)


class PublishedWeightVersion:
    """The trainer's published weight version, read at most once per *max_staleness_s* (see the module docstring).

    Concurrent callers share one read. ``None`` while nothing is published, or after the published version was
    deleted (then :attr:`deleted` is the last published one).
    """

    def __init__(
        self,
        client: Any,
        namespace: str,
        *,
        max_staleness_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_staleness_s <= 0:
            raise ValueError(f"max_staleness_s must be positive, got {max_staleness_s}")
        self._client = client
        self._namespace = namespace
        self.max_staleness_s = max_staleness_s
        self._value: int | None = None
        self.deleted: int | None = None
        """The last published version while the namespace's published one is deleted, else ``None``."""
        self._read_at = -float("inf")
        self._lock = anyio.Lock()
        self._clock = clock

    async def current(self) -> int | None:
        """The published version, re-read when the cached one is older than ``max_staleness_s``.

        :raises sink.trainer.weights.WeightVersionKeyError: the key holds what the record cannot carry.
        """
        async with self._lock:
            if self._clock() - self._read_at >= self.max_staleness_s:
                started = self._clock()
                state = await read_published_state(self._client, self._namespace)
                self._note_transition(state.version, state.deleted)
                self._value, self.deleted, self._read_at = state.version, state.deleted, started
            return self._value

    def _note_transition(self, version: int | None, deleted: int | None) -> None:
        if deleted is not None and self.deleted is None:
            logger.error(
                "the published weight version (%d) was deleted: %s is gone; calls are stamped with the fallback "
                "version (--weight-version) until the trainer publishes again (staging-sink weights set N)",
                deleted,
                weight_version_key(self._namespace),
            )
        elif deleted is None and self.deleted is not None:
            if version is not None:
                logger.warning("a weight version is published again (%d): calls are stamped with it", version)
            else:
                logger.warning("the deleted weight version's record is gone too: calls keep the fallback version")
