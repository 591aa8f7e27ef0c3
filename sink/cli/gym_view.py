"""What ``inspect`` and ``stats`` show of the NeMo Gym transport's rollouts (:mod:`sink.gym`).

Read with plain read-only commands the ``ops`` ACL user may run (``HGETALL`` of the state and digests hashes,
``HLEN`` of the entries hash, ``SMEMBERS`` of the intents set, ``GET`` of the fence, ``SCAN``): never an
entry's tokens, and not one atomic snapshot (an inspection tool, not a consumer: ``freeze`` is the consumer's).
"""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from sink.keys import gym_keys
from sink.store.connection import Topology, reply_text
from sink.store.gym_scripts import TOMBSTONE_PREFIX

__all__ = ("gym_rollout_state", "gym_totals", "render_gym_state")

_INT_FIELDS = ("version", "touched_ms")


async def gym_rollout_state(topology: Topology, ns: str, rollout_id: str) -> dict[str, Any] | None:
    """The transport's state of *rollout_id*: ``frozen``, ``incomplete``, ``version``, ``snapshot_id``,
    ``touched_ms``, its entries (call id -> digest), its ``begin_call`` intents and those without an entry;
    or ``dropped`` (the snapshot identity a ``drop`` retired) after a drop. ``None``: the transport never
    touched this rollout.

    :raises redis.RedisError: the server cannot be reached or refuses a command.
    """
    state_key, entries_key, digests_key, intents_key, fence = gym_keys(ns, rollout_id)
    client = topology.client
    raw_state = {
        reply_text(k, lenient=True): reply_text(v, lenient=True) for k, v in (await client.hgetall(state_key)).items()
    }
    digests = {
        reply_text(k, lenient=True): reply_text(v, lenient=True) for k, v in (await client.hgetall(digests_key)).items()
    }
    stored = int(await client.hlen(entries_key))
    intents = sorted(reply_text(call, lenient=True) for call in await client.smembers(intents_key))
    tombstone = await client.get(fence)
    dropped = None
    if tombstone is not None and reply_text(tombstone, lenient=True).startswith(TOMBSTONE_PREFIX):
        dropped = reply_text(tombstone, lenient=True)[len(TOMBSTONE_PREFIX) :]
    if not (raw_state or digests or stored or intents or dropped):
        return None
    return {
        "frozen": raw_state.get("frozen") == "1",
        "incomplete": raw_state.get("incomplete") == "1",
        "snapshot_id": raw_state.get("snapshot_id"),
        **{name: int(raw_state[name]) if raw_state.get(name, "").isdigit() else None for name in _INT_FIELDS},
        "entries": stored,
        "digests": dict(sorted(digests.items())),
        "intents": intents,
        "intents_without_entry": [call for call in intents if call not in digests],
        "dropped": dropped,
    }


async def gym_totals(topology: Topology, ns: str, state_keys: list[str]) -> dict[str, int]:
    """Over the transport's rollouts (*state_keys*: their ``ns:{R}:gym`` hashes, from ``SCAN``): how many,
    how many frozen and incomplete, and the entries they hold.

    :raises redis.RedisError: the server cannot be reached or refuses a command.
    """
    totals = {"rollouts": 0, "frozen": 0, "incomplete": 0, "entries": 0}
    for state_key in state_keys:
        node = topology.node_for_key(state_key)
        state = {
            reply_text(k, lenient=True): reply_text(v, lenient=True) for k, v in (await node.hgetall(state_key)).items()
        }
        totals["rollouts"] += 1
        totals["frozen"] += state.get("frozen") == "1"
        totals["incomplete"] += state.get("incomplete") == "1"
        totals["entries"] += int(await node.hlen(f"{state_key}:entries"))
    return totals


def render_gym_state(console: Console, gym: dict[str, Any]) -> None:
    """Print *gym* (from :func:`gym_rollout_state`) for ``inspect``."""
    if gym["dropped"] is not None:
        console.print(f"gym transport: dropped (snapshot {escape(gym['dropped'])}); later calls fail")
        return
    phase = "frozen" if gym["frozen"] else "open (accepting puts)"
    flag = "[red]incomplete[/]" if gym["incomplete"] else "complete so far"
    snapshot = f", snapshot {escape(gym['snapshot_id'])}" if gym["snapshot_id"] else ""
    console.print(f"gym transport: {phase}, {flag}, version {gym['version']}{snapshot}")
    entries = Table(title=f"gym entries: {gym['entries']} stored", title_justify="left")
    entries.add_column("model call id")
    entries.add_column("digest")
    entries.add_column("begin_call")
    intents = set(gym["intents"])
    for call_id, digest in gym["digests"].items():
        entries.add_row(escape(call_id), digest[:12], "yes" if call_id in intents else "-")
    for call_id in gym["intents_without_entry"]:
        entries.add_row(escape(call_id), "[red]no entry[/]", "yes")
    console.print(entries)
