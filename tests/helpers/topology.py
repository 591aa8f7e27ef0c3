"""Topology changes of the local cluster while the services run, and rollouts flowing through them.

- :func:`fail_over`: ``CLUSTER FAILOVER`` on a primary's replica; the old primary stays up and answers ``MOVED``.
- :func:`kill_and_promote`: SIGKILL a primary and wait until its replica took over its slots.
- :func:`begin_migration`, :func:`move_keys`, :func:`end_migration`: a live slot migration as
  ``valkey-cli --cluster reshard`` does it (``SETSLOT IMPORTING``/``MIGRATING``, ``MIGRATE`` of every key,
  ``SETSLOT NODE``), in steps a test interleaves with the services' work.
- :class:`RolloutFlow`: stage rollouts (the sink and the ledger) and finish them (``finished()``), each step tried
  again until it is acknowledged (every one is idempotent), so rollouts keep flowing across a change.
- :func:`running_services`: the ``staging-sink`` services as the processes users run (assembler, trainer, prune,
  metrics), their output collected, and :class:`Services` to wait on what the trainer verified.

The cluster helpers block (they poll the nodes): call them through ``anyio.to_thread.run_sync``.
"""

from __future__ import annotations

import contextlib
import re
import signal
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Self

import anyio
import redis
import redis.asyncio as aioredis
from redis.crc import key_slot

from sink.contract.records import CaptureLedgerCommit
from sink.errors import StagingConnectionError
from sink.keys import dead_letter_stream, done_stream, receipt_key, receipts_stream, shard_of
from sink.ledger.redis import RedisCaptureLedger
from sink.rollout.assembler import ASSEMBLER_GROUP
from sink.rollout.done_event import finished
from sink.server import DurableServer
from sink.settings import DEFAULT_SHARDS
from sink.store.sink import AsyncRedisStagingSink
from sink.trainer.reader.rollout_reader import TRAINER_GROUP
from sink_tools.cluster import LocalCluster
from tests.helpers.commands import Command, staging_sink
from tests.helpers.e2e import call_record_of
from tests.helpers.staging import make_chain

__all__ = (
    "TOPOLOGY_RETRY",
    "RolloutFlow",
    "Services",
    "begin_migration",
    "clear_namespace",
    "end_migration",
    "fail_over",
    "fresh_namespace",
    "kill_and_promote",
    "move_keys",
    "owner_of",
    "rollout_ids_on",
    "running_services",
    "settle_migration",
    "shared_slots",
    "slot_of",
    "slot_of_rollout",
)

DEADLINE_S = 120.0
"""How long any one condition of these tests may take (generous: the machine may be busy)."""
TOPOLOGY_RETRY = re.compile(
    r"MOVED|Moved|ASK|Ask|TRYAGAIN|TryAgain|READONLY|ReadOnly|CLUSTERDOWN|ClusterDown|ClusterError|UNBLOCKED"
)
"""A service's line about a topology reply it rode out."""


# --- the cluster ----------------------------------------------------------------------------------------------


def _by_port(cluster: LocalCluster, port: int) -> DurableServer:
    return next(node for node in cluster.nodes if node.port == port)


def _answering(cluster: LocalCluster) -> DurableServer:
    for node in cluster.nodes:
        if node.running and not node.paused:
            return node
    raise AssertionError("no node of the cluster is running")


def _slot_ranges(cluster: LocalCluster) -> list[tuple[int, int, int]]:
    """``(first slot, last slot, port of the primary)`` of every range (``CLUSTER SLOTS`` of a running node)."""
    with _answering(cluster).client() as client:
        reply = client.execute_command("CLUSTER", "SLOTS")
    return [(int(start), int(end), int(primary[1])) for start, end, primary, *_replicas in reply]


def owner_of(cluster: LocalCluster, slot: int) -> DurableServer:
    """The primary that serves *slot* now."""
    port = next(port for start, end, port in _slot_ranges(cluster) if start <= slot <= end)
    return _by_port(cluster, port)


def slot_of(key: str) -> int:
    """The cluster slot of *key*."""
    return int(key_slot(key.encode()))


def slot_of_rollout(rollout_id: str) -> int:
    """The slot of every key of *rollout_id* (``ns:{R}:...``)."""
    return slot_of(f"{{{rollout_id}}}")


def rollout_ids_on(
    cluster: LocalCluster, node: DurableServer, prefix: str, count: int, *, avoid: Collection[int] = ()
) -> list[str]:
    """*count* rollout ids ``<prefix>-<n>`` whose slots *node* serves, each in a slot of its own (none in *avoid*)."""
    ranges = [(start, end) for start, end, port in _slot_ranges(cluster) if port == node.port]
    found: list[str] = []
    slots: set[int] = set(avoid)
    for n in range(100_000):
        rollout_id = f"{prefix}-{n}"
        slot = slot_of_rollout(rollout_id)
        if slot not in slots and any(start <= slot <= end for start, end in ranges):
            found.append(rollout_id)
            slots.add(slot)
            if len(found) == count:
                return found
    raise AssertionError(f"fewer than {count} rollout ids on node {node.port}")


def shared_slots(namespace: str, shards: int = DEFAULT_SHARDS) -> set[int]:
    """Slots of the namespace's shared keys (``done``/``receipts`` shards, the dead letters), to leave alone."""
    keys = [done_stream(namespace, k) for k in range(shards)] + [receipts_stream(namespace, k) for k in range(shards)]
    keys += [dead_letter_stream(namespace, name) for name in ("abandoned", "groups")]
    keys += [dead_letter_stream(namespace, f"{role}-{k}") for role in ("done", "receipts") for k in range(shards)]
    keys.append(f"{namespace}:weight_version")
    return {slot_of(key) for key in keys}


_ATTEMPT_S = 10.0
"""How long one CLUSTER FAILOVER is given to switch the roles before it is asked again."""


def _replication(node: DurableServer) -> dict[str, Any]:
    """*node*'s ``INFO replication``."""
    with node.client() as client:
        return dict(client.info("replication"))


def _role(node: DurableServer) -> str:
    return str(_replication(node)["role"])


def _replica_of(node: DurableServer, cluster: LocalCluster) -> DurableServer:
    return _by_port(cluster, int(_replication(node)["slave0"]["port"]))


def _replication_offset(node: DurableServer) -> int:
    """How far into the replication stream *node* is: a primary's written, a replica's read."""
    return int(_replication(node)["master_repl_offset"])


def _until(condition: Callable[[], bool], message: str, timeout_s: float = DEADLINE_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, message
        time.sleep(0.05)


def fail_over(cluster: LocalCluster, primary: DurableServer) -> DurableServer:
    """``CLUSTER FAILOVER`` on *primary*'s replica; returns the new primary once the roles have switched (the old
    one is then its replica, up, answering ``MOVED``) and the cluster is healthy."""
    replica = _replica_of(primary, cluster)
    deadline = time.monotonic() + DEADLINE_S
    # A manual failover the primary does not confirm within its own timeout (5 s; a busy machine) is aborted by the
    # server: ask again until the roles have switched.
    while True:
        with replica.client() as client:
            client.execute_command("CLUSTER", "FAILOVER")
        try:
            _until(lambda: _role(replica) == "master" and _role(primary) == "slave", "", timeout_s=_ATTEMPT_S)
            break
        except AssertionError:
            assert time.monotonic() < deadline, "the failover did not complete"
    cluster.wait_healthy(timeout_s=DEADLINE_S)
    return replica


def kill_and_promote(cluster: LocalCluster, primary: DurableServer) -> DurableServer:
    """SIGKILL *primary*; returns its replica once promoted and serving every slot the dead node had.

    Before the kill, writes are paused on *primary* (``CLIENT PAUSE WRITE``: a write sent meanwhile waits, then
    fails with the connection and is sent again to the promoted replica) and its replica is let catch up, so the
    kill loses nothing the primary acknowledged. Without that, what the replica had not received yet would be
    lost with the primary: staged records wait for a replica (``min_replicas=1``), but ledger rows, done events and
    receipts are acknowledged once fsynced on their primary, and a kill inside the replication lag (a busy
    machine) may lose one: the window docs/reliability.md describes, not what these tests are about.
    """
    replica = _replica_of(primary, cluster)
    with primary.client() as client:
        client.execute_command("CLIENT", "PAUSE", int(DEADLINE_S * 1000), "WRITE")
    offset = _replication_offset(primary)
    _until(lambda: _replication_offset(replica) >= offset, "the replica did not catch up with the paused primary")
    primary.kill()
    _until(lambda: _role(replica) == "master", "the replica of the killed primary was not promoted")
    cluster.wait_healthy(timeout_s=DEADLINE_S)  # the running nodes: cluster_state ok, every slot served
    return replica


def _node_id(node: DurableServer) -> str:
    with node.client() as client:
        return str(client.execute_command("CLUSTER", "MYID").decode())


def begin_migration(source: DurableServer, target: DurableServer, slots: Sequence[int]) -> None:
    """Mark *slots* importing on *target* and migrating on *source* (keys not moved yet)."""
    source_id, target_id = _node_id(source), _node_id(target)
    with target.client() as to, source.client() as frm:
        for slot in slots:
            to.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", source_id)
            frm.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", target_id)


def move_keys(source: DurableServer, target: DurableServer, slots: Sequence[int]) -> int:
    """``MIGRATE`` every key of *slots* from *source* to *target*; how many keys moved."""
    moved = 0
    with source.client() as client:
        for slot in slots:
            while keys := client.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 100):
                client.execute_command("MIGRATE", target.host, target.port, "", 0, 5000, "KEYS", *keys)
                moved += len(keys)
    return moved


def settle_migration(cluster: LocalCluster, source: DurableServer, target: DurableServer, slots: Sequence[int]) -> None:
    """Finish a migration a failed test left half done (keys moved, slots given to *target*), so the shared
    cluster is whole again."""
    move_keys(source, target, slots)
    end_migration(cluster, source, target, slots)


def end_migration(cluster: LocalCluster, source: DurableServer, target: DurableServer, slots: Sequence[int]) -> None:
    """Give *slots* to *target* (``SETSLOT NODE`` on the target, the source, then every other primary) and wait
    until the cluster is healthy."""
    target_id = _node_id(target)
    others = [node for node in cluster.primaries() if node.port not in (source.port, target.port)]
    for node in (target, source, *others):
        with node.client() as client:
            for slot in slots:
                client.execute_command("CLUSTER", "SETSLOT", slot, "NODE", target_id)
    cluster.wait_healthy(timeout_s=DEADLINE_S)


@contextlib.asynccontextmanager
async def fresh_namespace(cluster: LocalCluster, namespace: str) -> AsyncIterator[None]:
    """A healthy cluster and an empty *namespace* before the block; healed and emptied after, whatever happened."""
    await anyio.to_thread.run_sync(cluster.heal)
    await anyio.to_thread.run_sync(clear_namespace, cluster, namespace)
    try:
        yield
    finally:
        await anyio.to_thread.run_sync(cluster.heal)
        await anyio.to_thread.run_sync(clear_namespace, cluster, namespace)


def clear_namespace(cluster: LocalCluster, namespace: str) -> None:
    """Delete every key of *namespace* on every running primary (the cluster is shared by the session)."""
    for node in cluster.primaries():
        with node.client() as client:
            for key in list(client.scan_iter(match=f"{namespace}:*", count=1000)):
                client.delete(key)


# --- rollouts flowing -----------------------------------------------------------------------------------------


@dataclass
class RolloutFlow:
    """Stages rollouts through the sink and the ledger and finishes them, as a rollout worker does; each step is
    tried again until acknowledged (what failed on the way is kept in :attr:`errors`)."""

    url: str
    namespace: str
    min_replicas: int = 0
    calls: int = 2
    finished_ids: list[str] = field(default_factory=list)
    """Rollouts whose ``finished()`` was acknowledged, in order."""
    errors: list[str] = field(default_factory=list)
    _stack: contextlib.AsyncExitStack = field(default_factory=contextlib.AsyncExitStack)

    async def __aenter__(self) -> Self:
        common: dict[str, Any] = {"cluster": True, "namespace": self.namespace, "connect_timeout_s": 1.0}
        self.sink = await self._stack.enter_async_context(
            AsyncRedisStagingSink.from_url(
                self.url, min_replicas=self.min_replicas, confirm_timeout_s=1.0, command_timeout_s=3.0, **common
            )
        )
        self.ledger = await self._stack.enter_async_context(
            RedisCaptureLedger.from_url(self.url, command_timeout_s=3.0, **common)
        )
        self.client = await self._stack.enter_async_context(aioredis.RedisCluster.from_url(self.url))
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self._stack.aclose()

    async def _again(self, what: str, error: str) -> None:
        self.errors.append(f"{what}: {error}")
        await anyio.sleep(0.1)

    async def stage(self, rollout_id: str) -> None:
        """Stage the calls of *rollout_id* and record their ledger rows, each until acknowledged."""
        chain = make_chain(rollout_id, self.calls, n_tokens=12)
        with anyio.fail_after(DEADLINE_S):
            for index, record in enumerate(chain):
                while not (result := await self.sink.stage(record)).ok:
                    await self._again(f"stage {record.staging_key}", str(result.error))
                commit = CaptureLedgerCommit(
                    rollout_id=rollout_id,
                    record=call_record_of(record, admitted_at=1000.0 + index),
                    staging_chain=tuple(r.staging_key for r in chain[: index + 1]),
                    request_items=[],
                    response_items=[],
                )
                while True:
                    try:
                        await self.ledger.record(commit)
                        break
                    except StagingConnectionError as exc:
                        await self._again(f"record {record.staging_key}", repr(exc))

    async def finish(self, rollout_id: str) -> None:
        """``finished()`` for *rollout_id*, until acknowledged (a second event is harmless: one receipt)."""
        with anyio.fail_after(DEADLINE_S):
            while True:
                try:
                    await finished(self.client, rollout_id, reward=1.0, namespace=self.namespace)
                    break
                except StagingConnectionError as exc:
                    await self._again(f"finish {rollout_id}", repr(exc))
        self.finished_ids.append(rollout_id)

    async def stage_all(self, rollout_ids: Sequence[str]) -> None:
        async with anyio.create_task_group() as group:
            for rollout_id in rollout_ids:
                group.start_soon(self.stage, rollout_id)

    async def finish_all(self, rollout_ids: Sequence[str]) -> None:
        for rollout_id in rollout_ids:
            await self.finish(rollout_id)

    async def complete(self, rollout_ids: Sequence[str]) -> None:
        """Stage, then finish, every one of *rollout_ids*."""
        await self.stage_all(rollout_ids)
        await self.finish_all(rollout_ids)

    async def keep_flowing(self, prefix: str, stop: anyio.Event, stopped: anyio.Event) -> None:
        """Stage and finish rollouts ``<prefix>-<n>`` one after another until *stop* is set; then set *stopped*."""
        n = 0
        while not stop.is_set():
            await self.complete([f"{prefix}-{n}"])
            n += 1
        stopped.set()


# --- the services as processes --------------------------------------------------------------------------------

_VERIFIED = re.compile(r"^verified (\S+): ")
_SKIPPED = re.compile(r"^skipped (\S+): ")
SERVICE_NAMES = ("assembler", "trainer", "prune", "metrics")


def _service_args(name: str, url: str, namespace: str) -> list[str]:
    common = ["--redis-url", url, "--cluster", "--namespace", namespace]
    if name == "prune":
        return ["prune", *common, "--interval-s", "0.5"]
    if name == "metrics":
        return ["metrics", *common, "--port", "0", "--interval-s", "0.5"]
    return [name, *common]


class Services:
    """The running service processes by name, and what they printed."""

    def __init__(self, url: str, namespace: str, stack: contextlib.ExitStack) -> None:
        self._url, self._namespace, self._stack = url, namespace, stack
        self.commands: dict[str, Command] = {}

    def start(self, name: str) -> Command:
        command = self._stack.enter_context(staging_sink(*_service_args(name, self._url, self._namespace)))
        self.commands[name] = command
        return command

    def assert_running(self) -> None:
        """:raises AssertionError: a service exited (naming it, its code and its last lines)."""
        for name, command in self.commands.items():
            code = command.process.poll()
            assert code is None, f"{name} exited {code}: {command.lines('stderr')[-15:]}"

    def verified(self) -> Counter[str]:
        """How often the trainer printed each rollout as verified."""
        return Counter(m.group(1) for line in self.commands["trainer"].lines("stdout") if (m := _VERIFIED.match(line)))

    def skipped(self) -> list[str]:
        return [m.group(1) for line in self.commands["trainer"].lines("stdout") if (m := _SKIPPED.match(line))]

    def topology_lines(self, name: str) -> list[str]:
        """The lines of service *name* about a topology reply it rode out."""
        return [line for line in self.commands[name].lines("stderr") if TOPOLOGY_RETRY.search(line)]

    async def until(
        self, condition: Callable[[], bool], message: str | Callable[[], str], timeout_s: float = DEADLINE_S
    ) -> None:
        """Wait for *condition* (polled), failing at once when a service exits, or after *timeout_s* with
        *message* (a callable: built then)."""
        deadline = time.monotonic() + timeout_s
        while not condition():
            self.assert_running()
            assert time.monotonic() < deadline, message if isinstance(message, str) else message()
            await anyio.sleep(0.1)
        self.assert_running()

    async def watch(self) -> None:
        """Fail as soon as a service exits (run it beside work that does not wait on the services itself)."""
        while True:
            self.assert_running()
            await anyio.sleep(0.1)

    async def until_verified(self, rollout_ids: Sequence[str]) -> None:
        wanted = set(rollout_ids)

        def all_verified() -> bool:
            return wanted <= set(self.verified())

        def missing() -> str:
            lost = sorted(wanted - set(self.verified()))
            tails = {name: command.lines("stderr")[-12:] for name, command in self.commands.items()}
            where = {rollout_id: self._whereabouts(rollout_id) for rollout_id in lost}
            return f"not every rollout was verified: missing {lost}; where they are: {where}; stderr: {tails}"

        await self.until(all_verified, missing)

    def _whereabouts(self, rollout_id: str) -> dict[str, object]:
        """Where *rollout_id* got to: its done entry, its receipt, its receipt entry, each stream's pending entries."""
        ns, shard = self._namespace, shard_of(rollout_id, DEFAULT_SHARDS)
        found: dict[str, object] = {}
        with redis.RedisCluster.from_url(self._url) as client:
            for name, stream, group in (
                ("done", done_stream(ns, shard), ASSEMBLER_GROUP),
                ("receipts", receipts_stream(ns, shard), TRAINER_GROUP),
            ):
                entries = [e for e, f in client.xrange(stream) if f.get(b"rollout_id") == rollout_id.encode()]
                pending = client.xpending_range(stream, group, min="-", max="+", count=100) if entries else []
                found[name] = {
                    "entries": [e.decode() for e in entries],
                    "pending": [
                        (p["message_id"].decode(), p["times_delivered"]) for p in pending if p["message_id"] in entries
                    ],
                    "groups": [
                        {k: g[k] for k in ("name", "last-delivered-id", "pending")} for g in client.xinfo_groups(stream)
                    ],
                }
            found["receipt"] = client.exists(receipt_key(ns, rollout_id))
        return found

    def stop(self) -> dict[str, int]:
        """SIGTERM every service; their exit codes by name."""
        for command in self.commands.values():
            command.process.send_signal(signal.SIGTERM)
        return {name: command.wait(timeout_s=DEADLINE_S) for name, command in self.commands.items()}


@contextlib.contextmanager
def running_services(url: str, namespace: str, names: Sequence[str] = SERVICE_NAMES) -> Iterator[Services]:
    """Start the service processes *names* on the cluster at *url* in *namespace*; killed on exit if still up."""
    with contextlib.ExitStack() as stack:
        services = Services(url, namespace, stack)
        for name in names:
            services.start(name)
        yield services
