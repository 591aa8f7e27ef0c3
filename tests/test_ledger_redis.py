"""The capture ledger's pure pieces and its Redis-only behaviour (contract §6).

Durability across SIGKILL, key layout, error translation, scripts, cluster and
the typed conflict error; the contract suite shared with the in-memory ledger
is :mod:`tests.test_ledger`.
"""

from __future__ import annotations

import pickle

import anyio
import anyio.lowlevel
import pytest
import redis
import redis.asyncio as aioredis
import redis.cluster

from sink.canonical import canonical_json
from sink.contract.fingerprint import FINGERPRINT_VERSION
from sink.contract.records import UNRESOLVED_PARENT_REASON, CaptureLedgerCommit
from sink.errors import LedgerConflictError, RolloutRetiredError, StagingConnectionError, StagingKeyOwnershipError
from sink.keys import fence_key, ledger_ids_key, ledger_stream
from sink.ledger.lineage import LineageMatch, LineageResolution, LineageStatus
from sink.ledger.memory import MemoryCaptureLedger
from sink.ledger.redis import RedisCaptureLedger
from sink.ledger.rows import custody_row
from sink.server import DurableServer, free_port
from sink_tools.cluster import LocalCluster
from tests.helpers.e2e import call_record_of
from tests.helpers.ledger import CHILD_REQUEST, R, child_commit, hexdigest, root_commit
from tests.helpers.staging import make_record

# --- pure pieces --------------------------------------------------------------


def test_lineage_resolution_requires_a_match_exactly_when_resolved() -> None:
    with pytest.raises(ValueError):
        LineageResolution(LineageStatus.RESOLVED)
    match = LineageMatch("c", (), hexdigest("d"), ("r/c",), 3, hexdigest("h"))
    with pytest.raises(ValueError):
        LineageResolution(LineageStatus.UNRESOLVED, match=match)
    assert LineageResolution(LineageStatus.RESOLVED, match=match).match is match


def test_custody_row_encoding_is_canonical() -> None:
    first, second = canonical_json(custody_row(root_commit())), canonical_json(custody_row(root_commit()))
    assert first == second and " " not in first.replace("be brief", "")
    row = custody_row(root_commit())
    assert (row["context_len"], row["fingerprint_version"], row["staging_chain"]) == (
        2,
        FINGERPRINT_VERSION,
        [f"{R}/c-root"],
    )
    assert "request_items" not in first and "hello" not in first  # raw items are never stored


def test_memory_ledger_is_not_process_shared() -> None:
    assert MemoryCaptureLedger().is_process_shared() is False


# --- Redis only ---------------------------------------------------------------


@pytest.mark.anyio
async def test_redis_key_layout_and_namespace(redis_url: str) -> None:
    async with RedisCaptureLedger.from_url(redis_url, namespace="ns2") as ledger:
        assert ledger.is_process_shared() is True
        await ledger.record(root_commit())
        with redis.Redis.from_url(redis_url, decode_responses=True) as client:
            assert set(client.keys("*")) == {ledger_stream("ns2", R), ledger_ids_key("ns2", R)}
            await ledger.retire([R])
            assert set(client.keys("*")) == {fence_key("ns2", R)}
            await ledger.delete([R])
            assert client.keys("*") == []
        assert "appended=1" in repr(ledger)


@pytest.mark.anyio
async def test_borrowed_decoding_client_works_and_stays_open(redis_url: str) -> None:
    client = aioredis.Redis.from_url(redis_url, decode_responses=True)
    try:
        async with RedisCaptureLedger(client) as ledger:
            await ledger.record(root_commit())
            await ledger.record(root_commit())
            with pytest.raises(LedgerConflictError, match="weight_version") as caught:
                await ledger.record(root_commit(weight_version=9))
            assert caught.value.differing_fields == ("record.weight_version",)
            assert pickle.loads(pickle.dumps(caught.value)).differing_fields == ("record.weight_version",)
            assert [r.model_call_id for r in (await ledger.manifest(R)).records] == ["c-root"]
            assert (await ledger.resolve(R, CHILD_REQUEST)).status is LineageStatus.RESOLVED
        assert await client.ping() is True  # the ledger did not close a borrowed client
    finally:
        await client.aclose()


@pytest.mark.anyio
async def test_scripts_are_reloaded_after_a_script_flush(redis_url: str) -> None:
    async with RedisCaptureLedger.from_url(redis_url) as ledger:
        await ledger.record(root_commit())
        with redis.Redis.from_url(redis_url) as client:
            client.script_flush()
        await ledger.record(child_commit())
        assert len((await ledger.manifest(R)).records) == 2


@pytest.mark.anyio
async def test_unreachable_server_raises_staging_connection_error() -> None:
    url = f"redis://127.0.0.1:{free_port()}"
    async with RedisCaptureLedger.from_url(url, connect_timeout_s=0.5, command_timeout_s=0.5) as ledger:
        with pytest.raises(StagingConnectionError, match="could not"):
            await ledger.record(root_commit())
        with pytest.raises(StagingConnectionError):
            await ledger.retire([R])


@pytest.mark.anyio
async def test_rows_and_fences_survive_a_server_sigkill(fresh_server: DurableServer) -> None:
    async with RedisCaptureLedger.from_url(fresh_server.url) as ledger:
        await ledger.record(root_commit())
        await ledger.record(child_commit())
        await ledger.record_failure(R, "c-x", UNRESOLVED_PARENT_REASON)
        await ledger.record(root_commit(rollout_id="r-fenced"))
        await ledger.retire(["r-fenced"])
        before = await ledger.manifest(R)
    fresh_server.kill()
    fresh_server.restart()
    async with RedisCaptureLedger.from_url(fresh_server.url) as ledger:
        assert await ledger.manifest(R) == before
        assert len(before.records) == 2 and len(before.failures) == 1
        with pytest.raises(RolloutRetiredError):
            await ledger.manifest("r-fenced")
        await ledger.record(child_commit())  # the idempotency index survived too
        assert await ledger.manifest(R) == before


@pytest.mark.anyio
async def test_cluster_runs_every_operation_on_the_rollout_slot(cluster: LocalCluster) -> None:
    async with RedisCaptureLedger.from_url(cluster.url, cluster=True) as ledger:
        rollouts = [f"r-{index}" for index in range(6)]  # spread over slots of every primary
        for rollout_id in rollouts:
            await ledger.record(root_commit(rollout_id=rollout_id))
            await ledger.record_failure(rollout_id, "c-x", UNRESOLVED_PARENT_REASON)
        assert (await ledger.resolve("r-3", CHILD_REQUEST)).status is LineageStatus.RESOLVED
        assert (await ledger.retire(rollouts[:3])).removed == rollouts[:3]
        assert (await ledger.delete(rollouts)).removed == rollouts[3:]
        for rollout_id in rollouts:
            assert await ledger.has_rows(rollout_id) is False


@pytest.mark.anyio
async def test_a_cluster_primary_without_the_function_library_is_given_it_on_first_use(cluster: LocalCluster) -> None:
    """A primary lacks the function library while the others have it (a primary added after setup, or the first
    users of a fresh cluster racing their loads, as the demo's processes do): a ledger call there loads it and
    answers. Before, the library's probe asked the cluster client's default node, which had it, and the call
    failed with "Function not found" (the demo on a cluster: "could not check a rollout ledger")."""
    async with RedisCaptureLedger.from_url(cluster.url, cluster=True, namespace="fl") as ledger:
        rollouts = [f"fl-{index}" for index in range(12)]  # the slots of every primary, several times over
        assert [await ledger.has_rows(rollout_id) for rollout_id in rollouts] == [False] * 12  # probed, loaded
        with redis.cluster.RedisCluster.from_url(cluster.url) as admin:
            for rollout_id in rollouts:
                admin.execute_command("FUNCTION", "FLUSH", target_nodes=admin.get_node_from_key(ledger_stream("fl", rollout_id)))
                assert await ledger.has_rows(rollout_id) is False
            loaded = admin.execute_command("FUNCTION", "LIST", target_nodes=admin.get_primaries())
    assert all(libraries for libraries in loaded.values()), loaded  # the shared cluster keeps it on every primary


@pytest.mark.anyio
async def test_more_concurrent_calls_than_pool_connections_queue_instead_of_failing(redis_url: str) -> None:
    client = aioredis.Redis.from_url(redis_url, max_connections=4)
    try:
        async with RedisCaptureLedger(client) as ledger, anyio.create_task_group() as group:
            for index in range(150):
                group.start_soon(ledger.record, root_commit(f"c{index:03d}"))
        async with RedisCaptureLedger(client) as ledger:
            assert len((await ledger.manifest(R)).records) == 150
    finally:
        await client.aclose()


# --- key ownership (real servers) -----------------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("staging_key", "chain_extra"),
    [("ra/c1", None), ("ra/c0/cut/ck/x", None), ("ra/c0", "rb/c0"), ("ra/c0", "nokey"), ("ra/c0", "ra/")],
)
async def test_the_ledger_refuses_another_calls_key_and_foreign_chains(
    redis_url: str, staging_key: str, chain_extra: str | None
) -> None:
    """Kills ``problem is None and not is_call_staging_key`` -> ``is not None`` and the chain check's ``or``,
    and ``not sep or not rest`` -> ``and`` (a key ``ra/`` with nothing after the slash)."""
    row = call_record_of(make_record("ra", "c0"), admitted_at=1.0).model_copy(update={"staging_key": staging_key})
    chain = (*([chain_extra] if chain_extra else []), staging_key)
    commit = CaptureLedgerCommit(rollout_id="ra", record=row, staging_chain=chain, request_items=[], response_items=[])
    async with RedisCaptureLedger.from_url(redis_url) as ledger:
        with pytest.raises(StagingKeyOwnershipError):
            await ledger.record(commit)
        assert not await ledger.has_rows("ra")
