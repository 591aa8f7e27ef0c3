"""Why a pulled rollout is not trainable: the skip codes a trainer reader reports (``PulledRollout.skip_code``).

A skipped rollout carries one code: a :class:`SkipCode` below (the receipt's own verdict, a problem of the
staged records, an ownership refusal, staleness, a group member gone), or the ``code`` of the
:class:`~sink.errors.ReceiptVerificationError` a verification check raised (contract §8.1: ``corrupt_digest``,
``wrong_*``, ...). The values are the stored, printed and exported strings; never change one.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Final

__all__ = ("UPSTREAM_SKIP_CODES", "SkipCode")


class SkipCode(StrEnum):
    """The skip codes that are not a verification check's code."""

    ROLLOUT_FAILED = "rollout_failed"
    """The receipt records a failed rollout (``failure_reason``)."""
    CAPTURE_POISONED = "capture_poisoned"
    """The receipt records a poisoned capture: no trainable row."""
    MISSING_RECORD = "missing_record"
    """A staged record named by the manifest is gone (``KeyError`` from the source)."""
    CORRUPT_RECORD = "corrupt_record"
    """A staged blob is corrupt or stored under a foreign key (``CodecError`` from the source)."""
    FOREIGN_STAGING_KEY = "foreign_staging_key"
    """A manifest row names a malformed key, or a key of a rollout that does not own the row."""
    FOREIGN_CAPTURE_KEY = "foreign_capture_key"
    """A manifest row's ``capture_key`` names another rollout (not an attempt of this one)."""
    STALE_WEIGHTS = "stale_weights"
    """The rollout's oldest generating call is more than ``max_weight_lag`` versions old."""


UPSTREAM_SKIP_CODES: Final = frozenset({SkipCode.ROLLOUT_FAILED, SkipCode.CAPTURE_POISONED})
"""Skip codes that the receipt itself carries (the rollout failed upstream): not verification failures."""
