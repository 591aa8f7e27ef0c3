"""One pulled rollout: a receipt turned into a verified training row, or a skip with its reason (contract §8).

:func:`fetch_and_verify` is the per-rollout work of
:meth:`sink.trainer.reader.RolloutReader.pull`: fetch the staged records the manifest
names, verify them against the receipt and linearize them. Nothing is dropped
silently: every failure becomes a skipped :class:`PulledRollout` with a code.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import NamedTuple

from sink.contract.records import RolloutReceipt
from sink.contract.skip_codes import SkipCode
from sink.errors import CodecError, ReceiptVerificationError
from sink.keys import validate_rollout_id
from sink.rollout.done_event import GroupTag
from sink.store.source import AsyncRedisStagingSource
from sink.trainer.verify import LinearizedRow, verify_decoded_and_linearize

__all__ = (
    "PulledRollout",
    "SkippedRollout",
    "fetch_and_verify",
    "parse_receipt_entry",
    "with_group",
)


class SkippedRollout(NamedTuple):
    """A pulled rollout that is not trainable (or was skipped by the reader), with its skip code and reason."""

    rollout_id: str
    skip_code: str
    skip_reason: str


@dataclass(frozen=True, slots=True)
class PulledRollout:
    """One pulled rollout: trainable (``row`` set) or skipped (``skip_code`` and ``skip_reason`` set).

    ``group``: the GRPO group given to :func:`~sink.rollout.done_event.finished`, or ``None``.
    """

    receipt: RolloutReceipt
    row: LinearizedRow | None = None
    skip_code: str | None = None
    skip_reason: str | None = None
    group: GroupTag | None = None

    @property
    def rollout_id(self) -> str:
        return self.receipt.rollout_id

    @property
    def trainable(self) -> bool:
        return self.row is not None

    def skipped(self) -> SkippedRollout:
        """This rollout as a :class:`SkippedRollout` (``skip_code`` ``""`` if it is trainable)."""
        return SkippedRollout(self.rollout_id, self.skip_code or "", self.skip_reason or "")


def parse_receipt_entry(fields: Mapping[str, str]) -> RolloutReceipt:
    """The receipt of a ``ns:receipts:<k>`` entry.

    :raises ValueError: a field is missing, the receipt is invalid, or it names another rollout.
    """
    try:
        receipt = RolloutReceipt.model_validate_json(fields["receipt"])
        rollout_id = fields["rollout_id"]
    except KeyError as exc:
        raise ValueError(f"missing field {exc}") from exc
    if receipt.rollout_id != validate_rollout_id(rollout_id):
        raise ValueError("rollout_id field does not match the receipt")
    return receipt


def with_group(pulled: PulledRollout, group: GroupTag | None) -> PulledRollout:
    """*pulled* carrying *group*."""
    return pulled if group is None else replace(pulled, group=group)


def _skip(receipt: RolloutReceipt, code: str, reason: str) -> PulledRollout:
    return PulledRollout(receipt=receipt, skip_code=code, skip_reason=reason)


async def fetch_and_verify(source: AsyncRedisStagingSource, receipt: RolloutReceipt) -> PulledRollout:
    """Fetch *receipt*'s staged records from *source*, verify and linearize them; a failure is a skip.

    :raises StagingConnectionError: the server could not be reached.
    """
    if receipt.failure_reason is not None:
        return _skip(receipt, SkipCode.ROLLOUT_FAILED, receipt.failure_reason)
    if receipt.capture_poisoned:
        return _skip(
            receipt, SkipCode.CAPTURE_POISONED, receipt.terminal_attribution_reason or SkipCode.CAPTURE_POISONED
        )
    try:
        # One fetch per rollout: one MGET per slot, and a rollout lives in one slot.
        snapshots = await source.fetch_packed([row.staging_key for row in receipt.manifest])
    except KeyError as exc:
        return _skip(receipt, SkipCode.MISSING_RECORD, str(exc.args[0]) if exc.args else str(exc))
    except CodecError as exc:
        return _skip(receipt, SkipCode.CORRUPT_RECORD, str(exc))
    try:
        # Decoded just now, packed, and not shared: verified at decode (same
        # checks, same digests), and the row keeps their bytes.
        row = verify_decoded_and_linearize(receipt, snapshots)
    except ReceiptVerificationError as exc:
        return _skip(receipt, exc.code, exc.detail)
    return PulledRollout(receipt=receipt, row=row)
