"""The one durable write path: calls grouped by node, each node's confirmation in the same round trip.

Every write the package acknowledges goes through :func:`send_calls`: the group commit of staged records
(:mod:`sink.store.commit`), the batched acknowledgements and claims (:func:`run_batch`) and the single durable
writes (:func:`write_durably`: ledger rows, ``finished`` events, receipts, dead letters).

It takes :class:`BatchCall` s (a script of :mod:`sink.store.scripts`, a plain command, or commands run in one
``MULTI``/``EXEC``), each on keys of one slot, groups them by the primary that owns their slot (``keys[0]`` routes a
call) and sends one pipeline per node, the calls in order on each node, the nodes concurrently. Behind each node's
calls the pipeline carries that node's :class:`~sink.store.durability.Confirmation` (``WAIT``, ``WAITAOF 1 0`` and
the persistence settings read back), so acknowledging k writes costs one round trip per node, not per write.

- A script the server lacks (an empty script cache, flushed functions) is recovered once and its calls sent again.
- A call the cluster did not run because its topology changed since the slot map was read (``MOVED``, ``ASK``,
  ``READONLY``, ``TRYAGAIN``, ``CLUSTERDOWN``: a failover, a slot migration) is sent again once the map is
  reloaded, until the redirect budget has passed.
- A node that cannot be reached reloads the map (in a cluster); its calls carry that error.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio
import redis.asyncio as aioredis
import redis.exceptions as redis_errors
from redis.asyncio.client import Pipeline

from sink.store.connection import Topology, is_topology_reply
from sink.store.durability import Confirmation, Durability, node_address, not_durable
from sink.store.scripts.runner import EVAL_MODE, LibraryNotLoadedError, ScriptMode, ServerScript

__all__ = ("BatchCall", "Sent", "raise_first_error", "run_batch", "send_calls", "write_durably")


@dataclass(frozen=True, slots=True)
class BatchCall:
    """One call: *script* on *keys* and *args*; or (*script* ``None``) the command *args*; or what *commands* queues
    on a pipeline with redis-py's methods (their replies parsed as those methods parse them; with *atomic*, in one
    ``MULTI``/``EXEC``, the reply then ``EXEC``'s list).

    *before*: plain commands queued ahead of *script* inside its ``MULTI``/``EXEC`` (so *atomic* must be set), for
    it to work on (the stage's record blobs, written with a ``SET`` each); the call's reply is then the script's
    (the first refusal among the transaction's replies, if any).

    Every key of a call is in one slot; ``keys[0]`` routes it.
    """

    keys: Sequence[str]
    args: Sequence[Any] = ()
    script: ServerScript | None = None
    commands: Callable[[Pipeline], object] | None = None
    atomic: bool = False
    before: Sequence[Sequence[Any]] = ()

    def __post_init__(self) -> None:
        if self.before and (self.script is None or not self.atomic):
            raise ValueError("commands before a call need its script and a MULTI/EXEC (atomic=True)")

    def queue(self, pipe: Pipeline, mode: ScriptMode) -> int:
        """Queue the call on *pipe* (a script in *mode*); how many replies it adds."""
        before = len(pipe)
        if self.atomic:
            pipe.execute_command("MULTI")
        for command in self.before:
            pipe.execute_command(*command)
        if self.commands is not None:
            self.commands(pipe)
        elif self.script is None:
            pipe.execute_command(*self.args)
        else:
            self.script.queue(pipe, mode, self.keys, self.args)
        if self.atomic:
            pipe.execute_command("EXEC")
        return len(pipe) - before

    def reply(self, replies: Sequence[Any]) -> Any:
        """The call's reply from its *replies*: the first refusal among them, else the one reply (``EXEC``'s when
        *atomic*), or the list of them."""
        refused = next((reply for reply in replies if isinstance(reply, BaseException)), None)
        if refused is not None:
            return refused
        if self.before:
            executed = replies[-1]  # EXEC's list: the commands before, then the script
            return next((reply for reply in executed if isinstance(reply, BaseException)), executed[-1])
        if self.atomic or len(replies) == 1:
            return replies[-1]
        return list(replies)


@dataclass(frozen=True, slots=True)
class Sent:
    """What became of one call of :func:`send_calls`.

    ``reply``: the call's reply, or the exception it met (the server's refusal, or the error of a node that could
    not be reached). ``unconfirmed``: why its node did not confirm it durable (it ran, but is not acknowledged);
    ``config_problem``: that reason is the node's persistence settings. ``unreached``: ``reply`` is the error of a
    node that could not be reached (the call may have run there or not).
    """

    reply: Any
    unconfirmed: str | None = None
    config_problem: bool = False
    unreached: bool = False


async def send_calls(
    topology: Topology, calls: Sequence[BatchCall], *, confirmation: Confirmation | None, redirect_budget_s: float
) -> list[Sent]:
    """Send *calls* with one pipeline per node, each ending with its node's *confirmation* (see the module
    docstring); calls the cluster redirected are sent again for up to *redirect_budget_s*.

    :returns: one :class:`Sent` per call, in order; nothing is raised for a refusal or a node's outage.
    """
    await topology.initialize()  # a borrowed cluster client may not know its slots yet (a no-op once it does)
    results: list[Sent | None] = [None] * len(calls)
    pending: Sequence[int] = range(len(calls))
    deadline = anyio.current_time() + redirect_budget_s
    for tries in itertools.count():
        await _by_node(topology, calls, pending, confirmation, results)
        # The slot moved (or its primary stepped down) since the map was read: those calls did not run; send them
        # to the slot's owner now, once the map is reloaded, until the budget has passed.
        pending = [i for i in pending if _redirected(results[i])]
        if not pending or not await topology.wait_for_redirect(deadline, tries):
            break
    return [result for result in results if result is not None]


async def run_batch(
    topology: Topology,
    calls: Sequence[BatchCall],
    *,
    durability: Durability = "none",
    timeout_s: float = 5.0,
    action: str = "run a batch of calls",
    redirect_budget_s: float | None = None,
) -> list[Any]:
    """:func:`send_calls` with all-or-nothing acknowledgement.

    *durability* ``"fsync"``: each node's pipeline ends with its durable confirmation within *timeout_s*; calls the
    cluster redirected are sent again for up to *redirect_budget_s* (default *timeout_s*); *action* names the
    writes in a refusal.

    :returns: one reply per call, in order; a refused call's reply is the exception (nothing is raised for it).
    :raises NotDurableError: a node's calls ran but the node does not keep them through a crash (every other
        node's pipeline completed first; nothing of the batch is acknowledged, retrying it is safe).
    :raises redis.exceptions.RedisError: a node could not be reached (a call may have run on it or not).
    """
    confirmation = Confirmation(timeout_s=timeout_s) if durability == "fsync" else None
    budget_s = timeout_s if redirect_budget_s is None else redirect_budget_s
    results = await send_calls(topology, calls, confirmation=confirmation, redirect_budget_s=budget_s)
    unreached = next((result.reply for result in results if result.unreached), None)
    if unreached is not None:
        raise unreached
    problems = list(dict.fromkeys(result.unconfirmed for result in results if result.unconfirmed is not None))
    if problems:
        more = f" (and {len(problems) - 1} more nodes)" if len(problems) > 1 else ""
        raise not_durable(action, problems[0] + more)
    return [result.reply for result in results]


async def write_durably(
    topology: Topology,
    call: BatchCall,
    *,
    durability: Durability,
    timeout_s: float,
    action: str,
    redirect_budget_s: float | None = None,
) -> Any:
    """One acknowledged write (:func:`run_batch` of *call*): its reply, once durable.

    :raises NotDurableError: the write ran but the server does not keep it through a crash.
    :raises redis.exceptions.RedisError: the server refused the write or could not be reached;
        :class:`LibraryNotLoadedError` when neither functions nor ``EVAL`` are available to this user.
    """
    replies = await run_batch(
        topology, [call], durability=durability, timeout_s=timeout_s, action=action, redirect_budget_s=redirect_budget_s
    )
    return raise_first_error(replies)[0]


def raise_first_error(replies: list[Any]) -> list[Any]:
    """*replies* of a :func:`run_batch`, or the first refusal among them raised."""
    for reply in replies:
        if isinstance(reply, BaseException):
            raise reply
    return replies


def _redirected(result: Sent | None) -> bool:
    return result is not None and not result.unreached and is_topology_reply(result.reply)


async def _by_node(
    topology: Topology,
    calls: Sequence[BatchCall],
    indices: Sequence[int],
    confirmation: Confirmation | None,
    results: list[Sent | None],
) -> None:
    """Set ``results[i]`` for *indices*: one pipeline per node."""
    by_node: dict[int, tuple[aioredis.Redis, list[int]]] = {}
    for index in indices:
        try:
            client = topology.node_for_key(calls[index].keys[0])
        except (redis_errors.RedisError, OSError) as exc:  # no node serves the slot (the map is being reloaded)
            results[index] = Sent(exc, unreached=not is_topology_reply(exc))
            continue
        by_node.setdefault(id(client), (client, []))[1].append(index)
    lost = False

    async def send(client: aioredis.Redis, node_indices: list[int]) -> None:
        nonlocal lost
        try:
            outcome = await _pipelined(client, calls, node_indices, confirmation)
        except (redis_errors.RedisError, OSError) as exc:
            # A topology error raised before anything was sent: every call goes again. Else the node is lost.
            topology_change = is_topology_reply(exc)
            lost |= not topology_change
            for index in node_indices:
                results[index] = Sent(exc, unreached=not topology_change)
            return
        for index in node_indices:
            results[index] = outcome.result(index)

    if len(by_node) == 1:
        await send(*next(iter(by_node.values())))
    elif by_node:
        async with anyio.create_task_group() as group:
            for client, node_indices in by_node.values():
                group.start_soon(send, client, node_indices)
    if lost and topology.is_cluster:
        await topology.refresh_quietly()  # a node lost (killed, its replica promoted): the next try goes there


@dataclass(slots=True)
class _NodeOutcome:
    """What one node's pipelines left: the replies by call index, and the confirmation's problem, if any."""

    replies: dict[int, Any] = field(default_factory=dict)
    problem: str | None = None
    config_problem: bool = False

    def result(self, index: int) -> Sent:
        reply = self.replies[index]
        if isinstance(reply, BaseException):
            return Sent(reply)
        return Sent(reply, self.problem, self.config_problem)


async def _pipelined(
    client: aioredis.Redis, calls: Sequence[BatchCall], indices: list[int], confirmation: Confirmation | None
) -> _NodeOutcome:
    """``calls[i]`` for *indices* in one pipeline on *client*, its *confirmation* behind them; a script the server
    lacks is recovered and its calls sent again, once."""
    outcome = _NodeOutcome()
    pending = list(indices)
    for attempt in range(2):
        pipe = client.pipeline(transaction=False)
        modes: dict[int, ScriptMode] = {}
        counts: list[int] = []
        for index in pending:
            call = calls[index]
            library = call.script.library if call.script is not None else None
            modes[index] = await library.mode(client) if library is not None else EVAL_MODE
            counts.append(call.queue(pipe, modes[index]))
        checks = confirmation.queue(pipe) if confirmation is not None else 0
        raw = await pipe.execute(raise_on_error=False)
        written, checked = raw[: len(raw) - checks], raw[len(raw) - checks :]
        missing: list[int] = []
        position = 0
        for index, count in zip(pending, counts, strict=True):
            call = calls[index]
            reply = call.reply(written[position : position + count])
            position += count
            outcome.replies[index] = _explained(client, call, modes[index], reply)
            if ServerScript.missing(reply):
                missing.append(index)
        ran = any(not isinstance(outcome.replies[index], BaseException) for index in pending)
        if confirmation is not None and outcome.problem is None and ran:
            verdict = confirmation.judge(node_address(client), checked)  # something ran: confirm it
            outcome.problem, outcome.config_problem = verdict.problem, verdict.config_problem
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
