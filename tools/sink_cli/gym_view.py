"""What ``inspect`` and ``stats`` show of the NeMo Gym transport's rollouts (:mod:`sink.gym`).

Read with plain read-only commands the ``ops`` ACL user may run (``HGETALL`` of the state, frozen and digests
hashes, ``HLEN`` of the entries and snapshot hashes, ``SMEMBERS`` of the intents set, ``GET`` of the tombstone,
``SCAN``): never an entry's tokens, and not one atomic snapshot (an inspection tool, not a consumer: ``freeze``
is the consumer's).
"""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from sink.keys import gym_key_prefix, gym_keys
from sink.store.connection import Topology, reply_text
from sink.store.scripts.gym import TOMBSTONE_PREFIX

__all__ = ("gym_rollout_ids", "gym_rollout_state", "gym_totals", "render_gym_state")


def _number(value: str | None) -> int | None:
    return int(value) if value is not None and value.isdigit() else None


async def _hash(client: Any, key: str) -> dict[str, str]:
    return {reply_text(k, lenient=True): reply_text(v, lenient=True) for k, v in (await client.hgetall(key)).items()}


async def _stored(client: Any, ns: str, rollout_id: str, frozen: bool) -> int:
    """The entries a freeze returns: the snapshot's once frozen (what the open hash holds then is never read)."""
    keys = gym_keys(ns, rollout_id)
    return int(await client.hlen(keys.snapshot if frozen else keys.entries))


async def gym_rollout_state(topology: Topology, ns: str, rollout_id: str) -> dict[str, Any] | None:
    """The transport's state of *rollout_id*: ``frozen``, ``incomplete``, ``version`` (the snapshot's once frozen,
    else the sink's), ``snapshot_id``, ``touched_ms`` (the newest write), its entries (call id -> digest), its
    ``begin_call`` intents and those without an entry; or ``dropped`` (the snapshot identity a ``drop`` retired)
    after a drop, ``abandoned`` after ``prune`` abandoned it. ``None``: the transport never touched this rollout.

    :raises redis.RedisError: the server cannot be reached or refuses a command.
    """
    keys = gym_keys(ns, rollout_id)
    client = topology.client
    state = await _hash(client, keys.state)
    frozen = await _hash(client, keys.frozen)
    digests = await _hash(client, keys.digests)
    stored = await _stored(client, ns, rollout_id, bool(frozen))
    intents = sorted(reply_text(call, lenient=True) for call in await client.smembers(keys.intents))
    tombstone = await client.get(keys.tombstone)
    dropped = None
    if tombstone is not None and reply_text(tombstone, lenient=True).startswith(TOMBSTONE_PREFIX):
        dropped = reply_text(tombstone, lenient=True)[len(TOMBSTONE_PREFIX) :]
    if not (state or frozen or digests or stored or intents or tombstone is not None):
        return None
    touched = [t for t in (_number(state.get("touched_ms")), _number(frozen.get("touched_ms"))) if t is not None]
    return {
        "frozen": bool(frozen),
        "incomplete": "1" in (state.get("incomplete"), frozen.get("incomplete")),
        "snapshot_id": frozen.get("snapshot_id"),
        "version": _number((frozen or state).get("version")),
        "touched_ms": max(touched, default=None),
        "entries": stored,
        "digests": dict(sorted(digests.items())),
        "intents": intents,
        "intents_without_entry": [call for call in intents if call not in digests],
        "dropped": dropped,
        "abandoned": tombstone is not None and dropped is None,
    }


async def gym_rollout_ids(topology: Topology, ns: str) -> list[str]:
    """The rollouts the transport holds (a state or a snapshot: not yet dropped), found with ``SCAN`` on every
    primary.

    :raises redis.RedisError: the server cannot be reached or refuses a command.
    """
    prefix = gym_key_prefix(ns)
    found: set[str] = set()
    for node in topology.primaries():
        for pattern, suffix in ((f"{prefix}*}}", "}"), (f"{prefix}*}}:frozen", "}:frozen")):
            async for raw in node.scan_iter(match=pattern, count=1000, _type="hash"):
                found.add(reply_text(raw, lenient=True)[len(prefix) : -len(suffix)])
    return sorted(found)


async def gym_totals(topology: Topology, ns: str) -> dict[str, int]:
    """Over the transport's rollouts (:func:`gym_rollout_ids`): how many, how many frozen and incomplete, and the
    entries they hold.

    :raises redis.RedisError: the server cannot be reached or refuses a command.
    """
    totals = {"rollouts": 0, "frozen": 0, "incomplete": 0, "entries": 0}
    for rollout_id in await gym_rollout_ids(topology, ns):
        keys = gym_keys(ns, rollout_id)
        node = topology.node_for_key(keys.state)
        state, frozen = await _hash(node, keys.state), await _hash(node, keys.frozen)
        totals["rollouts"] += 1
        totals["frozen"] += bool(frozen)
        totals["incomplete"] += "1" in (state.get("incomplete"), frozen.get("incomplete"))
        totals["entries"] += await _stored(node, ns, rollout_id, bool(frozen))
    return totals


def render_gym_state(console: Console, gym: dict[str, Any]) -> None:
    """Print *gym* (from :func:`gym_rollout_state`) for ``inspect``."""
    if gym["dropped"] is not None:
        console.print(f"gym transport: dropped (snapshot {escape(gym['dropped'])}); later calls fail")
        return
    if gym["abandoned"]:
        console.print("gym transport: abandoned by prune; later calls fail")
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
