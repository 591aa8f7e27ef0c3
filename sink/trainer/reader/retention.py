"""Bounded state after the trainer's ack: a consumed rollout's receipt and fence expire after ``retention_s``.

After :meth:`sink.trainer.reader.rollout_reader.RolloutReader.ack` the rollout's staged records, ``calls`` stream, ledger and claim are
gone; what remains is ``ns:{R}:receipt`` (what was trained on, for ``inspect``/``verify``) and ``ns:{R}:fence``
(the id is consumed: a late duplicate is dropped, a late write refused). Both get ``EXPIRE retention_s`` here,
in one pipeline per node (:func:`~sink.store.batch.run_batch`); both keys share the rollout's slot. A crash
between the ack and this call leaves them without a TTL: ``staging-sink prune`` gives them one (see
:mod:`sink.ops.prune`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from sink.keys import fence_key, receipt_key
from sink.store.batch import BatchCall, raise_first_error, run_batch
from sink.store.connection import Topology

__all__ = ("consumed_keys", "expire_consumed")


def consumed_keys(namespace: str, rollout_id: str) -> tuple[str, str]:
    """The keys a consumed rollout leaves behind, which expire after ``retention_s``: receipt, fence."""
    return receipt_key(namespace, rollout_id), fence_key(namespace, rollout_id)


async def expire_consumed(topology: Topology, namespace: str, rollout_ids: Sequence[str], retention_s: float) -> int:
    """``EXPIRE`` every consumed rollout's receipt and fence after *retention_s* (rounded up to a second).

    :returns: how many keys got the TTL (absent keys are skipped by the server).
    :raises StagingConnectionError: the server could not be reached.
    """
    seconds = max(1, math.ceil(retention_s))
    keys = [key for rollout_id in rollout_ids for key in consumed_keys(namespace, rollout_id)]
    calls = [BatchCall([key], ["EXPIRE", key, seconds]) for key in keys]
    async with topology.translated("set the retention of consumed rollouts"):
        return sum(bool(reply) for reply in raise_first_error(await run_batch(topology, calls)))
