"""No rollout can stall training or hurt another (real Valkey 8 / Redis 7.0 servers).

* The gate accepts commit coordinates only for the admitted rollout and call: ``R/C``, or one of that
  call's generation-cut keys ``R/C/cut/<checkpoint>/<seq>``; anything else is a failure row.
* The ledger refuses a row whose staging key or ``capture_key`` belongs to another rollout (a capture key
  may name only the rollout itself or another attempt of it, ``<rollout>-a<n>``).
* A receipt that names a malformed key, another rollout's key or a foreign capture key (forged straight
  into Redis, past the gate and the ledger) is a skip, never an exception, and its ack deletes only keys
  under the rollout's own hash tag.
"""

from __future__ import annotations

from collections.abc import Sequence

import anyio
import pytest
import redis.asyncio as aioredis

from sink.contract.records import (
    INVALID_COMMIT_COORDS_REASON,
    CallRecord,
    CaptureLedgerCommit,
    CommitCoords,
    RolloutManifest,
    StagedCallRecord,
)
from sink.errors import StagingKeyOwnershipError
from sink.keys import receipt_key, receipts_stream, record_key
from sink.ledger.gate import CaptureGate
from sink.ledger.redis import RedisCaptureLedger
from sink.rollout.assembler import finished
from sink.rollout.receipt import build_receipt
from sink.store.sink import AsyncRedisStagingSink
from sink.trainer.reader.rollout_reader import RolloutReader
from sink_cli.main import main as cli_main
from tests.helpers.e2e import call_record_of, pull_until, running_assembler, stage_rollouts
from tests.helpers.processes import until
from tests.helpers.staging import make_record

RECEIPTS = receipts_stream("stg", 0)
ROOT_ITEMS = [{"role": "user", "content": "hi"}]


def _coords(record: StagedCallRecord, staging_key: str) -> CommitCoords:
    return CommitCoords(
        rollout_id=record.rollout_id,
        model_call_id=record.model_call_id,
        prev_len=record.prev_len,
        delta_len=record.delta_len,
        cum_len=record.cum_len,
        weight_version=record.weight_version,
        digest=record.digest,
        extras_digest=record.extras_digest,
        staging_key=staging_key,
        chain_hash=record.chain_hash,
        cumulative_hash=record.cumulative_hash,
    )


async def _commit_with_key(url: str, staging_key_of: str) -> tuple[CallRecord | None, RolloutManifest]:
    async with RedisCaptureLedger.from_url(url) as ledger:
        gate = CaptureGate(ledger)
        admission = await gate.admit("ra", ROOT_ITEMS, model_call_id="ca")
        assert admission is not None
        record = make_record("ra", "ca")
        row = await gate.commit(
            admission,
            _coords(record, staging_key_of),
            response_id="resp-1",
            request_items=ROOT_ITEMS,
            response_items=[{"role": "assistant", "content": "yo"}],
        )
        return row, await ledger.manifest("ra")


# --- the gate -------------------------------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize(
    "bad_key",
    ["nokey", "rb/ca", "ra/other", "ra/ca/extra", "ra/ca/cut/ck/x", "ra/ca/cut/ck/-1", "ra/ca/cut/bad!/0", "ra/ca/"],
)
async def test_the_gate_refuses_coords_naming_any_key_but_the_admitted_calls(redis_url: str, bad_key: str) -> None:
    row, manifest = await _commit_with_key(redis_url, bad_key)
    assert row is None
    assert manifest.records == []
    assert [(f.model_call_id, f.reason) for f in manifest.failures] == [("ca", INVALID_COMMIT_COORDS_REASON)]


@pytest.mark.anyio
@pytest.mark.parametrize("good_key", ["ra/ca", "ra/ca/cut/ck-1/0", "ra/ca/cut/ck/17"])
async def test_the_gate_accepts_the_admitted_call_and_its_generation_cut_keys(redis_url: str, good_key: str) -> None:
    row, manifest = await _commit_with_key(redis_url, good_key)
    assert row is not None and row.staging_key == good_key
    assert [r.staging_key for r in manifest.records] == [good_key] and manifest.failures == []


# --- the ledger -----------------------------------------------------------------------------------


def _commit(rollout_id: str, row: CallRecord) -> CaptureLedgerCommit:
    return CaptureLedgerCommit(
        rollout_id=rollout_id, record=row, staging_chain=(row.staging_key,), request_items=[], response_items=[]
    )


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("staging_key", "capture_key"),
    [("nokey", None), ("rb/c0", None), ("rb/c0", "rb"), ("ra/c0", "rb"), ("ra-a1/c0", "ra"), ("rab-a1/c0", "rab-a1")],
)
async def test_the_ledger_refuses_rows_owned_by_another_rollout(
    redis_url: str, staging_key: str, capture_key: str | None
) -> None:
    row = call_record_of(make_record("ra", "c0"), admitted_at=1.0).model_copy(
        update={"staging_key": staging_key, "capture_key": capture_key}
    )
    async with RedisCaptureLedger.from_url(redis_url) as ledger:
        with pytest.raises(StagingKeyOwnershipError, match="ra"):
            await ledger.record(_commit("ra", row))
        assert (await ledger.manifest("ra")).records == []
        assert not await ledger.has_rows("ra")


@pytest.mark.anyio
async def test_the_ledger_accepts_rows_of_another_attempt_of_the_same_rollout(redis_url: str) -> None:
    base = call_record_of(make_record("ra", "c0"), admitted_at=1.0)
    async with RedisCaptureLedger.from_url(redis_url) as ledger:
        await ledger.record(
            _commit("ra-a2", base.model_copy(update={"staging_key": "ra-a1/c0", "capture_key": "ra-a1"}))
        )
        await ledger.record(
            _commit("ra-a2", base.model_copy(update={"model_call_id": "c1", "staging_key": "ra-a2/c1"}))
        )
        await ledger.record(
            _commit(
                "ra-a2", base.model_copy(update={"model_call_id": "c2", "staging_key": "ra/c2", "capture_key": "ra"})
            )
        )
        manifest = await ledger.manifest("ra-a2")
    assert [(r.staging_key, r.capture_key) for r in manifest.records] == [
        ("ra-a1/c0", "ra-a1"),
        ("ra-a2/c1", "ra-a2"),
        ("ra/c2", "ra"),
    ]


# --- forged receipts at the reader -------------------------------------------------------------------


async def _forge_receipt(client: aioredis.Redis, rollout_id: str, rows: Sequence[CallRecord]) -> None:
    manifest = RolloutManifest(rollout_id=rollout_id, records=list(rows), failures=[])
    text = build_receipt(manifest, rollout_id=rollout_id, reward=1.0).model_dump_json()
    await client.set(receipt_key("stg", rollout_id), text)
    await client.xadd(RECEIPTS, {"rollout_id": rollout_id, "receipt": text})


async def _finish_and_assemble(url: str, rollout_ids: Sequence[str]) -> None:
    async with aioredis.Redis.from_url(url) as client:
        for rollout_id in rollout_ids:
            await finished(client, rollout_id, reward=1.0, shards=1)
        async with running_assembler(url, block_ms=20, done_shards=1, receipt_shards=1):

            async def drained() -> bool:
                return not await client.xlen("stg:done:0")

            await until(drained, "the assembler did not take in the done events within 20 s", timeout_s=20)


def _row(record: StagedCallRecord, **update: object) -> CallRecord:
    return call_record_of(record, admitted_at=1.0).model_copy(update=update)


@pytest.mark.anyio
async def test_a_malformed_staging_key_is_a_skip_and_never_stalls_the_reader(redis_url: str) -> None:
    healthy = await stage_rollouts(redis_url, ["h0", "h1", "h2"], calls=1)
    async with aioredis.Redis.from_url(redis_url) as client:
        await _forge_receipt(client, "bad", [_row(make_record("bad", "c0"), staging_key="nokey")])
        await _finish_and_assemble(redis_url, [s.rollout_id for s in healthy])
        async with RolloutReader.from_url(redis_url, receipt_shards=1) as reader:
            pulled = {p.rollout_id: p for p in await pull_until(reader, 4)}
            assert sorted(rid for rid, p in pulled.items() if p.trainable) == ["h0", "h1", "h2"]
            assert pulled["bad"].skip_code == "foreign_staging_key", pulled["bad"]
            await reader.ack(list(pulled))
        assert await client.xlen(RECEIPTS) == 0


def test_verify_reports_a_malformed_staging_key_without_a_traceback(
    redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    async def forge() -> None:
        async with aioredis.Redis.from_url(redis_url) as client:
            await _forge_receipt(client, "bad", [_row(make_record("bad", "c0"), staging_key="nokey")])

    anyio.run(forge)
    code = cli_main(["verify", "bad", "--json", "--redis-url", redis_url])
    captured = capsys.readouterr()
    assert code == 1, captured
    assert "Traceback" not in captured.err
    assert '"verified": false' in captured.out and "foreign_staging_key" in captured.out


@pytest.mark.anyio
@pytest.mark.parametrize("capture_key", [None, "victim"], ids=["key-only", "capture-key"])
async def test_a_receipt_naming_another_rollouts_records_neither_verifies_nor_deletes_them(
    redis_url: str, capture_key: str | None
) -> None:
    [victim] = await stage_rollouts(redis_url, ["victim"], calls=1)
    stolen = _row(victim.records[0], capture_key=capture_key)
    async with aioredis.Redis.from_url(redis_url) as client:
        await _forge_receipt(client, "thief", [stolen])
        async with RolloutReader.from_url(redis_url, receipt_shards=1) as reader:
            [pulled] = await pull_until(reader, 1)
            assert pulled.rollout_id == "thief" and not pulled.trainable
            assert pulled.skip_code in {"foreign_staging_key", "foreign_capture_key"}, pulled
            await reader.ack(["thief"])
        assert await client.exists(record_key("stg", victim.staging_keys[0])) == 1
        await _finish_and_assemble(redis_url, ["victim"])
        async with RolloutReader.from_url(redis_url, receipt_shards=1) as reader:
            [pulled] = await pull_until(reader, 1)
            assert pulled.rollout_id == "victim" and pulled.row is not None, pulled
            assert pulled.row.token_ids == tuple(victim.token_ids)
            await reader.ack(["victim"])
        assert await client.exists(record_key("stg", victim.staging_keys[0])) == 0


@pytest.mark.anyio
async def test_a_gate_fed_coords_for_another_rollout_cannot_reach_its_records(redis_url: str) -> None:
    """The issue's scenario end to end: A's coords name B's key; B stays trainable after A's ack."""
    [victim] = await stage_rollouts(redis_url, ["rb"], calls=1)
    async with RedisCaptureLedger.from_url(redis_url) as ledger, AsyncRedisStagingSink.from_url(redis_url) as sink:
        gate = CaptureGate(ledger)
        admission = await gate.admit("ra", ROOT_ITEMS, model_call_id="c0")
        assert admission is not None
        own = make_record("ra", "c0")
        assert (await sink.stage(own)).ok
        row = await gate.commit(
            admission,
            _coords(own, victim.staging_keys[0]),
            response_id="resp",
            request_items=ROOT_ITEMS,
            response_items=[{"role": "assistant", "content": "x"}],
        )
        assert row is None
    await _finish_and_assemble(redis_url, ["ra", "rb"])
    async with RolloutReader.from_url(redis_url, receipt_shards=1) as reader:
        pulled = {p.rollout_id: p for p in await pull_until(reader, 2)}
        assert pulled["ra"].skip_code == "rollout_failed" and pulled["ra"].skip_reason == INVALID_COMMIT_COORDS_REASON
        await reader.ack(["ra"])
        assert pulled["rb"].row is not None and pulled["rb"].row.token_ids == tuple(victim.token_ids)
        await reader.ack(["rb"])
