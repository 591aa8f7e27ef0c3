"""``staging-sink list``: the namespace's rollouts, one state each, found with ``SCAN`` (an ops tool).

A rollout's state is the first that applies, in this order:

* ``dead_lettered``: an entry of a ``dead`` stream names it (a consumer group gave up on its event/receipt);
* ``claimed``: a trainer rank pulled its receipt and has not acknowledged it yet (``ns:{R}:claimed``);
* ``consumed``: receipt and retire fence (a trainer acknowledged it; the staged records are gone);
* ``poisoned``: a receipt whose capture is poisoned (the trainer will skip it);
* ``receipt_waiting``: a receipt not yet claimed by a trainer;
* ``retired``: a fence and no receipt (retired by an operator or a restore), or a NeMo Gym tombstone (dropped);
* ``finished``: a ``done`` event not yet assembled into a receipt;
* ``gym``: held by the NeMo Gym transport (:mod:`sink.gym`, keys ``ns:gym:{R}...``), not yet dropped;
* ``staging``: staged records, calls or ledger rows only.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from rich.markup import escape
from rich.table import Table

from sink.contract.records import RolloutReceipt
from sink.contract.skip_codes import SkipCode
from sink.keys import claim_key, gym_key_kind, gym_key_prefix, receipt_key
from sink.store.connection import Topology, map_redis_errors, reply_text
from sink_cli.common import EXIT_OK, RedisTarget, open_topology, stdout_console, write_json

__all__ = ("ROLLOUT_STATES", "RolloutState", "collect_rollouts", "list_command")

ROLLOUT_STATES = (
    "dead_lettered",
    "claimed",
    "consumed",
    "poisoned",
    "receipt_waiting",
    "retired",
    "finished",
    "gym",
    "staging",
)
"""Every state ``list`` reports, in precedence order."""

_SCAN_COUNT = 1000
_PAGE = 1000


@dataclass(slots=True)
class RolloutState:
    """What ``list`` found about one rollout."""

    rollout_id: str
    keys: set[str] = field(default_factory=set)
    """Suffixes of its keys: ``calls``, ``ledger``, ``fence``, ``receipt``, ``claimed``, ``rec``; of its NeMo Gym
    transport keys ``gym`` and ``gym:<kind>`` (``gym:entries``, ``gym:tombstone``, ...)."""
    done_events: int = 0
    dead_reasons: list[str] = field(default_factory=list)
    receipt: RolloutReceipt | None = None
    claimed_by: str | None = None

    @property
    def state(self) -> str:
        """The first state of :data:`ROLLOUT_STATES` that applies."""
        if self.dead_reasons:
            return "dead_lettered"
        if "claimed" in self.keys:
            return "claimed"
        if self.receipt is not None or "receipt" in self.keys:
            if "fence" in self.keys:
                return "consumed"
            return "poisoned" if self.receipt is not None and self.receipt.capture_poisoned else "receipt_waiting"
        if "fence" in self.keys or "gym:tombstone" in self.keys:
            return "retired"
        if self.done_events:
            return "finished"
        return "gym" if any(k.startswith("gym") for k in self.keys) else "staging"

    def detail(self) -> str:
        """A short human note: who holds the claim, why it is poisoned or dead-lettered."""
        state = self.state
        if state == "dead_lettered":
            return "; ".join(self.dead_reasons)
        if state == "claimed":
            return f"by {self.claimed_by or '?'}"
        if self.receipt is not None and (state == "poisoned" or self.receipt.failure_reason):
            return self.receipt.failure_reason or self.receipt.terminal_attribution_reason or SkipCode.CAPTURE_POISONED
        return ""

    def as_json(self) -> dict[str, Any]:
        """The JSON object of one ``list --json`` line."""
        return {"rollout_id": self.rollout_id, "state": self.state, "keys": sorted(self.keys), "detail": self.detail()}


def _split(namespace: str, key: str) -> tuple[str, str] | None:
    """``(rollout id, key kind)`` of a per-rollout key ``ns:{R}:<kind>...`` or ``ns:gym:{R}...``, ``None`` for
    other keys."""
    gym = gym_key_kind(namespace, key)
    if gym is not None:
        return gym
    prefix = f"{namespace}:{{"
    rollout_id, sep, rest = key[len(prefix) :].partition("}:")
    if not key.startswith(prefix) or not sep or not rollout_id:
        return None
    kind = "rec" if rest.startswith("rec:") else rest
    return rollout_id, kind


async def _entries(topology: Topology, stream: str) -> list[dict[str, str]]:
    """Every entry's fields of *stream*, read in pages."""
    client = topology.node_for_key(stream)
    fields: list[dict[str, str]] = []
    start = "-"
    while True:
        page = await client.xrange(stream, min=start, count=_PAGE) or []
        for entry_id, raw in page:
            fields.append({reply_text(k, lenient=True): reply_text(v, lenient=True) for k, v in (raw or {}).items()})
            start = f"({reply_text(entry_id, lenient=True)}"
        if len(page) < _PAGE:
            return fields


async def _scan(topology: Topology, pattern: str, key_type: str | None = None) -> set[str]:
    found: set[str] = set()
    for node in topology.primaries():
        async for key in node.scan_iter(match=pattern, count=_SCAN_COUNT, _type=key_type):
            found.add(reply_text(key, lenient=True))
    return found


async def collect_rollouts(topology: Topology, namespace: str) -> list[RolloutState]:
    """Every rollout of *namespace* with its keys, events, claim and receipt, sorted by id.

    :raises StagingConnectionError: the server cannot be reached or refuses a command.
    """
    rollouts: dict[str, RolloutState] = {}

    def of(rollout_id: str) -> RolloutState:
        return rollouts.setdefault(rollout_id, RolloutState(rollout_id))

    with map_redis_errors(f"list the rollouts of namespace {namespace!r}"):
        keys = await _scan(topology, f"{namespace}:{{*}}:*") | await _scan(topology, f"{gym_key_prefix(namespace)}*")
        for key in keys:
            split = _split(namespace, key)
            if split is not None:
                of(split[0]).keys.add(split[1])
        for stream in sorted(await _scan(topology, f"{namespace}:done:*", "stream")):
            for fields in await _entries(topology, stream):
                if "rollout_id" in fields:
                    of(fields["rollout_id"]).done_events += 1
        for stream in sorted(await _scan(topology, f"{namespace}:dead:*", "stream")):
            for fields in await _entries(topology, stream):
                if "rollout_id" in fields:
                    of(fields["rollout_id"]).dead_reasons.append(fields.get("dead_reason", "dead-lettered"))
        client = topology.client
        for rollout in rollouts.values():
            if "claimed" in rollout.keys:
                claim = await client.get(claim_key(namespace, rollout.rollout_id))
                rollout.claimed_by = (
                    None if claim is None else reply_text(claim, lenient=True).partition("\n")[2] or None
                )
            if "receipt" in rollout.keys:
                text = await client.get(receipt_key(namespace, rollout.rollout_id))
                try:
                    rollout.receipt = None if text is None else RolloutReceipt.model_validate_json(text)
                except ValueError:
                    rollout.dead_reasons.append("corrupt receipt")
    return [rollouts[rollout_id] for rollout_id in sorted(rollouts)]


async def list_command(target: RedisTarget, *, states: list[str] | None, as_json: bool, limit: int) -> int:
    """``staging-sink list``: the namespace's rollouts by state (all, or those in *states*), at most *limit*
    rows; ``--json`` prints one object per line.

    :raises StagingConnectionError: the server cannot be reached or refuses a command.
    """
    async with open_topology(target) as topology:
        rollouts = await collect_rollouts(topology, target.namespace)
    shown = [rollout for rollout in rollouts if states is None or rollout.state in states]
    if as_json:
        for rollout in shown[:limit]:
            write_json(rollout.as_json(), one_line=True)
        return EXIT_OK
    console = stdout_console()
    table = Table(title=f"rollouts of namespace {target.namespace} ({target.display_url})", title_justify="left")
    for column in ("rollout", "state", "keys", "detail"):
        table.add_column(column)
    for rollout in shown[:limit]:
        table.add_row(rollout.rollout_id, rollout.state, " ".join(sorted(rollout.keys)), escape(rollout.detail()))
    console.print(table)
    counts = Counter(rollout.state for rollout in rollouts)
    summary = ", ".join(f"{counts[state]} {state}" for state in ROLLOUT_STATES if counts[state]) or "no rollouts"
    more = f" (showing {limit} of {len(shown)}: --limit)" if len(shown) > limit else ""
    console.print(f"{len(rollouts)} rollout(s): {summary}{more}")
    return EXIT_OK
