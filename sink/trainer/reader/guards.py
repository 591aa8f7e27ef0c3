"""What a trainer reader refuses to touch: foreign keys, other ranks' leases (contract §2.5, §8.5).

* :func:`foreign_row_skip`: a receipt whose manifest names a malformed key, another rollout's key or a
  foreign ``capture_key`` is skipped before anything is fetched;
* :func:`own_keys`: the only staged keys the cleanup of a rollout may delete (its own hash tag);
* :class:`AckOutcome`: what :meth:`~sink.trainer.reader.rollout_reader.RolloutReader.ack` did, including the rollouts whose lease
  this reader had lost to another rank (nothing is done for those).
"""

from __future__ import annotations

from pydantic import Field

from sink.contract.records import Identifier, RolloutReceipt, RolloutRemoval
from sink.ledger.ownership import keys_owned_by, ownership_problem
from sink.trainer.pulled import PulledRollout

__all__ = ("AckOutcome", "foreign_row_skip", "own_keys")


class AckOutcome(RolloutRemoval):
    """:meth:`~sink.trainer.reader.rollout_reader.RolloutReader.ack`'s result: the ledger retirement (``removed``/``absent``), plus
    ``lost_lease``: rollouts another rank took over after this reader held them past ``claim_idle_ms``.
    Nothing was done for those (the new owner trains and acknowledges them); this reader's training of
    them was a duplicate.
    """

    lost_lease: list[Identifier] = Field(default_factory=list)


def own_keys(receipt: RolloutReceipt) -> list[str]:
    """The manifest's keys under the rollout's own hash tag: the only keys its cleanup may delete."""
    return keys_owned_by(receipt.rollout_id, [row.staging_key for row in receipt.manifest])


def foreign_row_skip(receipt: RolloutReceipt) -> PulledRollout | None:
    """A skip when a manifest row names a key or capture key of another rollout (nothing is fetched)."""
    if receipt.failure_reason is not None or receipt.capture_poisoned:
        return None
    for row in receipt.manifest:
        problem = ownership_problem(receipt.rollout_id, row.staging_key, row.capture_key)
        if problem is not None:
            return PulledRollout(receipt=receipt, skip_code=problem[0], skip_reason=problem[1])
    return None
