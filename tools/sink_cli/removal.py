"""Operator commands that remove rollouts: ``retire`` (fence and remove the ledger) and ``delete`` (every key).

Both read each rollout's keys first, so they can refuse ids that name nothing (a typo would otherwise leave a
permanent fence), print what ``--dry-run`` would do, and report what was actually removed. The read and the
removal are separate steps (the removal itself is one atomic script per id); the ledger figure in the report
is the script's own answer, the fence figure what the read saw just before.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sink.keys import calls_stream, claim_key, fence_key, ledger_stream, receipt_key
from sink.ledger.redis import RedisCaptureLedger
from sink.store.connection import Topology, map_redis_errors
from sink_cli.common import EXIT_OK, CommandError, RedisTarget, open_topology, stdout_console, write_json
from sink_cli.rollouts import checked_rollout_id

__all__ = ("delete_rollouts", "retire_rollouts")


@dataclass(frozen=True, slots=True)
class _Found:
    """Which of a rollout's keys exist."""

    ledger: bool
    fence: bool
    other: bool  # calls stream, receipt or claim

    @property
    def known(self) -> bool:
        return self.ledger or self.fence or self.other


async def _found(topology: Topology, namespace: str, rollout_id: str) -> _Found:
    client = topology.client
    with map_redis_errors(f"read rollout {rollout_id!r}"):
        ledger = bool(await client.exists(ledger_stream(namespace, rollout_id)))
        fence = bool(await client.exists(fence_key(namespace, rollout_id)))
        other = [
            calls_stream(namespace, rollout_id),
            receipt_key(namespace, rollout_id),
            claim_key(namespace, rollout_id),
        ]
        # One EXISTS per key: the generated ACL puts these keys in different selectors, and a multi-key command
        # must fit one selector whole.
        found_other = any([bool(await client.exists(key)) for key in other])
    return _Found(ledger=ledger, fence=fence, other=found_other)


def _retire_line(entry: dict[str, Any], dry_run: bool) -> str:
    if not entry["fence_set"]:
        return "already retired (fence kept)" + (", stray ledger removed" if entry["ledger_removed"] else "")
    if dry_run:
        ledger = "remove the ledger, " if entry["ledger_removed"] else "no ledger rows; "
        return f"would retire ({ledger}set the fence)"
    if entry["ledger_removed"]:
        return "retired (ledger removed, fence set)"
    return "fenced (no ledger rows; later writes are refused)"


_DELETED_PARTS = {"ledger": "ledger", "fence": "fence", "other": "staged calls, receipt and claim"}


def _delete_line(entry: dict[str, Any], dry_run: bool) -> str:
    parts = [label for name, label in _DELETED_PARTS.items() if entry[f"{name}_removed"]]
    if not parts:
        return "nothing to delete (no ledger, fence, staged calls, receipt or claim)"
    what = " and the ".join(parts)
    return f"would delete the {what}" if dry_run else f"deleted the {what}"


async def _remove(
    target: RedisTarget, rollout_ids: Sequence[str], *, verb: str, as_json: bool, dry_run: bool, force: bool
) -> int:
    ids = list(dict.fromkeys(checked_rollout_id(rollout_id) for rollout_id in rollout_ids))
    async with open_topology(target) as topology:
        found = {rollout_id: await _found(topology, target.namespace, rollout_id) for rollout_id in ids}
        unknown = [rollout_id for rollout_id in ids if not found[rollout_id].known]
        if unknown and not force:
            raise CommandError(
                f"unknown rollout id(s) in namespace {target.namespace!r}: {', '.join(unknown)} (no calls, ledger, "
                f"fence, receipt or claim); nothing changed. Pass --force to {verb} them anyway"
                + (" (retire fences them against later writes)" if verb == "retire" else "")
            )
        if dry_run:
            removed = {rollout_id for rollout_id in ids if found[rollout_id].ledger}
        else:
            async with RedisCaptureLedger(topology.client, target.settings()) as ledger:
                removal = await (ledger.retire(ids) if verb == "retire" else ledger.delete(ids))
            removed = set(removal.removed)
    entries: list[dict[str, Any]] = []
    for rollout_id in ids:
        entry: dict[str, Any] = {"rollout_id": rollout_id, "ledger_removed": rollout_id in removed}
        if verb == "retire":
            entry["fence_set"] = not found[rollout_id].fence
            if found[rollout_id].fence:
                entry["ledger_removed"] = found[rollout_id].ledger
        else:  # delete removes every key under the rollout's hash tag: what the read saw is what went
            entry["ledger_removed"] = found[rollout_id].ledger
            entry["fence_removed"] = found[rollout_id].fence
            entry["other_removed"] = found[rollout_id].other
        entries.append(entry)
    if as_json:
        write_json({"verb": verb, "dry_run": dry_run, "rollouts": entries, "unknown": unknown})
        return EXIT_OK
    console = stdout_console()
    for entry in entries:
        line = _retire_line(entry, dry_run) if verb == "retire" else _delete_line(entry, dry_run)
        console.print(
            f"{entry['rollout_id']}: {line}" + (" (unknown id, forced)" if entry["rollout_id"] in unknown else "")
        )
    if dry_run:
        console.print("dry run: nothing changed")
    return EXIT_OK


async def retire_rollouts(
    target: RedisTarget, rollout_ids: Sequence[str], *, as_json: bool, dry_run: bool = False, force: bool = False
) -> int:
    """``staging-sink retire R...``: fence each rollout and remove its ledger (staged records are untouched).

    :raises CommandError: (exit 1) an id names nothing in the namespace and *force* is off (nothing changed);
        (exit 2) an id is invalid.
    """
    return await _remove(target, rollout_ids, verb="retire", as_json=as_json, dry_run=dry_run, force=force)


async def delete_rollouts(
    target: RedisTarget, rollout_ids: Sequence[str], *, as_json: bool, dry_run: bool = False, force: bool = False
) -> int:
    """``staging-sink delete R...``: remove every key of each rollout (ledger, fence, receipt, claim, staged records
    and their calls stream), making the id reusable.

    :raises CommandError: (exit 1) an id names nothing in the namespace and *force* is off (nothing changed);
        (exit 2) an id is invalid.
    """
    return await _remove(target, rollout_ids, verb="delete", as_json=as_json, dry_run=dry_run, force=force)
