"""Operator commands that remove rollouts' ledgers and fences: ``retire`` and ``delete``."""

from __future__ import annotations

from collections.abc import Sequence

from ..ledger.redis import RedisCaptureLedger
from .common import EXIT_OK, RedisTarget, open_topology, stdout_console, write_json
from .rollouts import checked_rollout_id

__all__ = ("delete_rollouts", "retire_rollouts")


# --- retire / delete ---------------------------------------------------------------------------------


async def _remove(target: RedisTarget, rollout_ids: Sequence[str], *, verb: str, as_json: bool) -> int:
    ids = [checked_rollout_id(rollout_id) for rollout_id in rollout_ids]
    async with (
        open_topology(target) as topology,
        RedisCaptureLedger(topology.client, namespace=target.namespace) as ledger,
    ):
        removal = await (ledger.retire(ids) if verb == "retire" else ledger.delete(ids))
    if as_json:
        write_json(removal.model_dump(mode="json"))
        return EXIT_OK
    console = stdout_console()
    done = "retired (ledger removed, fence set)" if verb == "retire" else "deleted (ledger and fence removed)"
    absent = "no ledger rows; fenced anyway" if verb == "retire" else "no live ledger: nothing deleted"
    for rollout_id in removal.removed:
        console.print(f"{rollout_id}: {done}")
    for rollout_id in removal.absent:
        console.print(f"{rollout_id}: absent ({absent})")
    return EXIT_OK


async def retire_rollouts(target: RedisTarget, rollout_ids: Sequence[str], *, as_json: bool) -> int:
    """``staging-sink retire R...``: fence each rollout and remove its ledger (staged records are untouched)."""
    return await _remove(target, rollout_ids, verb="retire", as_json=as_json)


async def delete_rollouts(target: RedisTarget, rollout_ids: Sequence[str], *, as_json: bool) -> int:
    """``staging-sink delete R...``: remove each rollout's ledger and fence, making the id reusable."""
    return await _remove(target, rollout_ids, verb="delete", as_json=as_json)
