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
from sink.contract.records import UNRESOLVED_PARENT_REASON, CaptureLedgerCommit, StagedCallRecord
from sink.errors import LedgerConflictError, RolloutRetiredError, StagingConnectionError, StagingKeyOwnershipError
from sink.keys import DEFAULT_NAMESPACE, fence_key, ledger_ids_key, ledger_stream
from sink.ledger.lineage import LineageMatch, LineageResolution, LineageStatus
from sink.ledger.memory import MemoryCaptureLedger
from sink.ledger.redis import RedisCaptureLedger
from sink.ledger.rows import custody_row
from sink.server import DurableServer
from sink.store.durability import supports_waitaof
from sink.store.scripts import AppendStatus
from sink.store.sink import AsyncRedisStagingSink
from sink_tools.cluster import LocalCluster
from tests.helpers.e2e import call_record_of
from tests.helpers.ledger import ANSWER1, CHILD_REQUEST, ROOT_REQUEST, R, child_commit, hexdigest, root_commit
from tests.helpers.processes import free_port
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


# --- a row behind its stage: one durable round per captured call (contract §6.6) ------------------------


def _staged_commit(record: StagedCallRecord, *, response_id: str | None = None) -> CaptureLedgerCommit:
    """The custody commit of a staged root *record* (the gate's row, fingerprints left out)."""
    row = call_record_of(record, admitted_at=1700000000.5)
    if response_id is not None:
        row = row.model_copy(update={"response_id": response_id})
    return CaptureLedgerCommit(
        rollout_id=record.rollout_id,
        record=row,
        staging_chain=(record.staging_key,),
        request_items=list(ROOT_REQUEST),
        response_items=[ANSWER1],
    )


def _config_gets(stats: dict[str, object]) -> int:
    entry = stats.get("cmdstat_config|get")
    return int(entry["calls"]) if isinstance(entry, dict) else 0


@pytest.mark.anyio
async def test_a_row_behind_its_stage_is_appended_in_the_stage_round(redis_url: str) -> None:
    record = make_record("rb-1", "c1")
    async with (
        aioredis.Redis.from_url(redis_url) as client,
        AsyncRedisStagingSink.from_url(redis_url) as sink,
        RedisCaptureLedger.from_url(redis_url) as ledger,
    ):
        commit = _staged_commit(record)
        follow_up = ledger.row_after_stage(commit)
        one_get = supports_waitaof(await client.info("server"))  # then the four settings come in one CONFIG GET
        before = _config_gets(await client.info("commandstats"))
        result = await sink.stage(record, then=follow_up)
        after = _config_gets(await client.info("commandstats"))
        assert result.ok and follow_up.sent and ledger.appended_after_stage(follow_up)
        assert after - before == (1 if one_get else 4), "the stage and its row share one read-back of the settings"
        shown = await ledger.manifest("rb-1")
        again = ledger.row_after_stage(commit)  # a retry of the same call: the row is found, not appended twice
        assert (await sink.stage(record, then=again)).ok and ledger.appended_after_stage(again)
        assert again.reply[0] == AppendStatus.DUPLICATE
        assert await client.xlen(ledger_stream(DEFAULT_NAMESPACE, "rb-1")) == 1
    assert [row.model_call_id for row in shown.records] == ["c1"] and not shown.failures
    assert shown.records[0].digest == record.digest and shown.records[0].staging_key == record.staging_key


@pytest.mark.anyio
async def test_a_row_behind_a_stage_that_did_not_write_its_record_leaves_the_ledger_unchanged(
    redis_url: str,
) -> None:
    """A conflicting record under the key (the stage refuses): the row is not appended, nothing is written; the
    gate then commits as without the shared round."""
    stored, other = make_record("rb-2", "c1", seed=1), make_record("rb-2", "c1", seed=2)
    assert stored.digest != other.digest
    async with (
        aioredis.Redis.from_url(redis_url) as client,
        AsyncRedisStagingSink.from_url(redis_url) as sink,
        RedisCaptureLedger.from_url(redis_url) as ledger,
    ):
        assert (await sink.stage(stored)).ok
        follow_up = ledger.row_after_stage(_staged_commit(other))
        result = await sink.stage(other, then=follow_up)
        assert not result.ok and result.error is not None and "conflict" in result.error.lower(), result
        assert follow_up.sent and follow_up.reply == [AppendStatus.NOT_STAGED]
        assert not ledger.appended_after_stage(follow_up)
        assert await client.exists(ledger_stream(DEFAULT_NAMESPACE, "rb-2"), ledger_ids_key(DEFAULT_NAMESPACE, "rb-2")) == 0


@pytest.mark.anyio
async def test_a_row_behind_a_retired_rollouts_stage_is_discarded(redis_url: str) -> None:
    record = make_record("rb-3", "c1")
    async with (
        AsyncRedisStagingSink.from_url(redis_url) as sink,
        RedisCaptureLedger.from_url(redis_url) as ledger,
    ):
        await ledger.retire(["rb-3"])
        follow_up = ledger.row_after_stage(_staged_commit(record))
        result = await sink.stage(record, then=follow_up)
        assert not result.ok and follow_up.reply == [AppendStatus.FENCED]
        assert not ledger.appended_after_stage(follow_up)
        with pytest.raises(RolloutRetiredError):
            await ledger.manifest("rb-3")


@pytest.mark.anyio
async def test_a_row_behind_its_stage_that_conflicts_with_the_ledger_is_not_appended(redis_url: str) -> None:
    """Another row of the same call is in the ledger: the row is refused as a conflict (nothing written), the stage
    still succeeds, and the gate's own commit then meets the same conflict (a failure row)."""
    record = make_record("rb-4", "c1")
    async with (
        AsyncRedisStagingSink.from_url(redis_url) as sink,
        RedisCaptureLedger.from_url(redis_url) as ledger,
    ):
        await ledger.record(_staged_commit(record, response_id="resp-other"))
        follow_up = ledger.row_after_stage(_staged_commit(record))
        assert (await sink.stage(record, then=follow_up)).ok
        assert follow_up.reply[0] == AppendStatus.CONFLICT and not ledger.appended_after_stage(follow_up)
        with pytest.raises(LedgerConflictError):
            await ledger.record(_staged_commit(record))
        shown = await ledger.manifest("rb-4")
    assert [row.response_id for row in shown.records] == ["resp-other"]


@pytest.mark.anyio
async def test_a_row_behind_an_unconfirmed_stage_is_not_acknowledged(redis_url: str) -> None:
    """The round is not confirmed (a replica required, none there): neither the stage nor the row is acknowledged."""
    record = make_record("rb-5", "c1")
    async with (
        AsyncRedisStagingSink.from_url(redis_url, min_replicas=1, confirm_timeout_s=0.2) as sink,
        RedisCaptureLedger.from_url(redis_url) as ledger,
    ):
        follow_up = ledger.row_after_stage(_staged_commit(record))
        result = await sink.stage(record, then=follow_up)
        assert not result.ok and follow_up.sent and follow_up.unconfirmed is not None
        assert not ledger.appended_after_stage(follow_up)


@pytest.mark.anyio
async def test_a_row_behind_a_stage_refused_before_it_is_sent_is_never_sent(redis_url: str) -> None:
    record = make_record("rb-6", "c1", n_tokens=2048)
    async with (
        AsyncRedisStagingSink.from_url(redis_url, max_record_bytes=1024) as sink,
        RedisCaptureLedger.from_url(redis_url) as ledger,
    ):
        follow_up = ledger.row_after_stage(_staged_commit(record))
        result = await sink.stage(record, then=follow_up)
        assert not result.ok and "max_record_bytes" in (result.error or "")
        assert not follow_up.sent and not ledger.appended_after_stage(follow_up)
        shown = await ledger.manifest("rb-6")
    assert not shown.records and not shown.failures
