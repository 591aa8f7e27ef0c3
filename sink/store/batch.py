"""The one way the package sends many single-slot calls at once: one pipeline per node.

:func:`run_batch` takes :class:`BatchCall` s (a script of :mod:`sink.store.scripts`, or a plain command), each on
keys of one slot, groups them by the primary that owns their slot (``keys[0]`` routes a call) and sends one
pipeline per node, the calls in order on each node, the nodes concurrently. A script the server lacks (an empty
script cache, flushed functions) is recovered once and its calls sent again; a call the cluster did not run because
its topology changed since the slot map was read (``MOVED``, ``ASK``, ``READONLY``, ``TRYAGAIN``, ``CLUSTERDOWN``: a
failover, a slot migration) is sent again once the map is reloaded, until the batch's ``timeout_s`` has passed. A
node that cannot be reached reloads the map too (in a cluster) before the error is raised.

An acknowledged write stays acknowledged only once durable (:mod:`sink.store.durability`): with
``durability="fsync"`` each node's pipeline ends with that node's durable confirmation (``WAITAOF 1 0`` and the
persistence settings read back), in the same round trip as the calls, and a node that cannot confirm makes the
batch raise :class:`~sink.errors.NotDurableError` once every node answered. So acknowledging k rollouts costs a
round trip per node and step, not per rollout.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import anyio
import redis.asyncio as aioredis
import redis.exceptions as redis_errors

from sink.errors import NotDurableError
from sink.store.connection import Topology, is_topology_reply
from sink.store.durability import (
    Durability,
    confirmation_problem,
    node_address,
    not_durable,
    queue_confirmation,
)
from sink.store.scripts.runner import EVAL_MODE, LibraryNotLoadedError, ScriptMode, ServerScript

__all__ = ("BatchCall", "raise_first_error", "run_batch")


@dataclass(frozen=True, slots=True)
class BatchCall:
    """One call of a :func:`run_batch`: *script* on *keys* and *args*, or (*script* ``None``) the command *args*.

    Every key of a call is in one slot; ``keys[0]`` routes it.
    """

    keys: Sequence[str]
    args: Sequence[Any] = ()
    script: ServerScript | None = None


@dataclass(slots=True)
class _NodeOutcome:
    """What one node's pipelines left: the replies by call index, and the confirmation's problem, if any."""

    replies: dict[int, Any]
    problem: str | None = None


async def run_batch(
    topology: Topology,
    calls: Sequence[BatchCall],
    *,
    durability: Durability = "none",
    timeout_s: float = 5.0,
    action: str = "run a batch of calls",
) -> list[Any]:
    """Send *calls* with one pipeline per node (in order on each node, the nodes concurrently).

    *durability* ``"fsync"``: each node's pipeline ends with its durable confirmation (the module docstring),
    within *timeout_s*; calls the cluster redirected are sent again for up to *timeout_s* (the module docstring);
    *action* names the writes in a refusal.

    :returns: one reply per call, in order; a refused call's reply is the exception (nothing is raised for it).
    :raises NotDurableError: a node's calls ran but the node does not keep them through a crash (every other
        node's pipeline completed first; nothing of the batch is acknowledged, retrying it is safe).
    :raises redis.exceptions.RedisError: a node could not be reached (a call may have run on it or not).
    """
    await topology.initialize()  # a borrowed cluster client may not know its slots yet (a no-op once it does)
    replies = await _by_node(topology, calls, range(len(calls)), durability, timeout_s, action)
    deadline = anyio.current_time() + timeout_s
    for tries in itertools.count():
        redirected = [index for index, reply in enumerate(replies) if is_topology_reply(reply)]
        # The slot moved (or its primary stepped down) since the map was read: those calls did not run; send them
        # to the slot's owner now, once the map is reloaded, until timeout_s has passed.
        if not redirected or not await topology.wait_for_redirect(deadline, tries):
            break
        again = await _by_node(topology, calls, redirected, durability, timeout_s, action)
        for index, reply in zip(redirected, again, strict=True):
            replies[index] = reply
    return replies


def raise_first_error(replies: list[Any]) -> list[Any]:
    """*replies* of a :func:`run_batch`, or the first refusal among them raised."""
    for reply in replies:
        if isinstance(reply, BaseException):
            raise reply
    return replies


async def _by_node(
    topology: Topology,
    calls: Sequence[BatchCall],
    indices: Sequence[int],
    durability: Durability,
    timeout_s: float,
    action: str,
) -> list[Any]:
    """The replies of ``calls[i]`` for *indices* (in that order), one pipeline per node."""
    by_node: dict[int, tuple[aioredis.Redis, list[int]]] = {}
    for index in indices:
        client = topology.node_for_key(calls[index].keys[0])
        by_node.setdefault(id(client), (client, []))[1].append(index)
    outcomes: list[_NodeOutcome] = []
    failures: list[redis_errors.RedisError | OSError] = []

    async def send(client: aioredis.Redis, node_indices: list[int]) -> None:
        try:
            outcomes.append(await _pipelined(client, calls, node_indices, durability, timeout_s))
        except (redis_errors.RedisError, OSError) as exc:
            failures.append(exc)  # raised after the other nodes' pipelines completed

    if len(by_node) == 1:
        await send(*next(iter(by_node.values())))
    else:
        async with anyio.create_task_group() as group:
            for client, node_indices in by_node.values():
                group.start_soon(send, client, node_indices)
    if failures:
        if topology.is_cluster:
            await topology.refresh_quietly()  # a node lost (killed, its replica promoted): the next try goes there
        raise failures[0]
    problems = [outcome.problem for outcome in outcomes if outcome.problem is not None]
    if problems:
        raise _refusal(action, problems)
    replies = {index: reply for outcome in outcomes for index, reply in outcome.replies.items()}
    return [replies[index] for index in indices]


def _refusal(action: str, problems: list[str]) -> NotDurableError:
    more = f" (and {len(problems) - 1} more nodes)" if len(problems) > 1 else ""
    return not_durable(action, problems[0] + more)


async def _pipelined(
    client: aioredis.Redis, calls: Sequence[BatchCall], indices: list[int], durability: Durability, timeout_s: float
) -> _NodeOutcome:
    """``calls[i]`` for *indices* in one pipeline on *client* (its confirmation behind them with *durability*
    ``"fsync"``); a script the server lacks is recovered and its calls sent again, once."""
    outcome = _NodeOutcome({})
    pending = list(indices)
    for attempt in range(2):
        pipe = client.pipeline(transaction=False)
        modes: dict[int, ScriptMode] = {}
        for index in pending:
            call = calls[index]
            if call.script is None:
                pipe.execute_command(*call.args)
                continue
            library = call.script.library
            modes[index] = await library.mode(client) if library is not None else EVAL_MODE
            call.script.queue(pipe, modes[index], call.keys, call.args)
        checks = queue_confirmation(pipe, timeout_s) if durability == "fsync" else 0
        raw = await pipe.execute(raise_on_error=False)
        written, checked = raw[: len(raw) - checks], raw[len(raw) - checks :]
        if checks and outcome.problem is None and not all(isinstance(r, BaseException) for r in written):
            outcome.problem = confirmation_problem(node_address(client), checked)  # something ran: confirm it
        missing: list[int] = []
        for index, reply in zip(pending, written, strict=True):
            outcome.replies[index] = _explained(client, calls[index], modes.get(index, EVAL_MODE), reply)
            if ServerScript.missing(reply):
                missing.append(index)
        if not missing or attempt:
            return outcome
        recovered: set[tuple[ServerScript, ScriptMode]] = set()
        for index in missing:
            script, mode = calls[index].script, modes[index]
            assert script is not None
            if (script, mode) not in recovered:
                await script.recover(client, mode)
                recovered.add((script, mode))
        pending = missing
    return outcome


def _explained(client: aioredis.Redis, call: BatchCall, mode: ScriptMode, reply: Any) -> Any:
    """A refused ``EVALSHA`` where the library is what is missing becomes :class:`LibraryNotLoadedError`."""
    if call.script is None or call.script.library is None or not isinstance(reply, BaseException):
        return reply
    message = call.script.library.explain_refusal(client, mode, reply)
    return reply if message is None else LibraryNotLoadedError(message)
