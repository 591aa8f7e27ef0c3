"""``prune``'s abandonment policy, key by key: what an abandoned rollout loses (everything but its fence), what
``ns:dead:abandoned`` records, what counts as activity (the newest ``calls`` or ledger entry or Gym transport
write), where the age line falls (the dry run and the pass agree on it), and that a rollout whose receipt lands
mid-pass is left to the trainer."""

from __future__ import annotations

from typing import Any

import pytest
import redis.asyncio as aioredis

from sink.contract.records import CaptureLedgerCommit
from sink.gym import RedisTokenSink
from sink.keys import (
    calls_stream,
    claim_key,
    dead_letter_stream,
    fence_key,
    gym_keys,
    ledger_ids_key,
    ledger_stream,
    ledger_text_key,
    receipt_key,
)
from sink.ledger.redis import RedisCaptureLedger
from sink.ops.prune import prune_namespace
from sink.settings import PruneSettings
from sink.store.connection import Topology, reply_text
from sink.store.sink import AsyncRedisStagingSink
from tests.helpers.e2e import call_record_of, stage_rollout, stage_rollouts
from tests.helpers.gym import make_entry
from tests.helpers.prune import key_state, newest_entry_ms, next_millisecond, now_for_cutoff
from tests.helpers.replies import raw_entries
from tests.helpers.staging import make_chain, make_record

pytestmark = pytest.mark.anyio

ABANDON_AFTER_S = 600.0


async def _dead_letters(client: aioredis.Redis) -> dict[str, dict[str, str]]:
    """``ns:dead:abandoned`` by rollout id: each entry's fields as text."""
    entries = raw_entries(await client.xrange(dead_letter_stream("stg", "abandoned")))
    by_rollout = {}
    for _id, fields in entries:
        text = {name.decode(): value.decode() for name, value in fields.items()}
        by_rollout[text["rollout_id"]] = text
    return by_rollout


async def _newest_activity_ms(client: aioredis.Redis, rollout_id: str) -> int:
    return max(
        [
            await newest_entry_ms(client, stream)
            for stream in (calls_stream("stg", rollout_id), ledger_stream("stg", rollout_id))
        ]
    )


async def test_an_abandoned_rollout_keeps_only_its_fence_and_is_recorded_with_its_last_activity(redis_url: str) -> None:
    async with (
        AsyncRedisStagingSink.from_url(redis_url) as sink,
        RedisCaptureLedger.from_url(redis_url) as ledger,
        aioredis.Redis.from_url(redis_url) as client,
    ):
        staged = await stage_rollout(sink, ledger, "full", calls=2)
        # a second root whose call id holds the hash tag's closing "}:" (call ids are free text)
        assert (await sink.stage(make_record("full", "tool}:call", seed=1))).ok
        await client.hset(ledger_text_key("stg", "full"), "c0", "text of c0")  # an exact-prefix completion's text
        await client.set(claim_key("stg", "full"), "0-1\ntrainer-0")  # a claim left behind
        await stage_rollout(sink, ledger, "orphan", calls=1)
        await client.delete(
            calls_stream("stg", "orphan"), ledger_stream("stg", "orphan"), ledger_ids_key("stg", "orphan")
        )
        gym = RedisTokenSink(redis_url=redis_url)
        try:
            await gym.put(make_entry("gym-full", "c1"))
            await gym.begin_call("gym-full", "c2")  # an announced call: ns:gym:{R}:intents
        finally:
            await gym.close()
        assert len(await client.keys("stg:gym:{gym-full}*")) == 4  # state, entries, digests, intents
        full_ms = await _newest_activity_ms(client, "full")
        touched = await client.hget(gym_keys("stg", "gym-full").state, "touched_ms")
        assert touched is not None
        settings = PruneSettings(abandon_after_s=ABANDON_AFTER_S, retention_s=60)
        now_s = await next_millisecond() + ABANDON_AFTER_S  # every write above is older than the age line
        topology = Topology.borrow(client, settings)
        report = await prune_namespace(topology, settings, now_s=now_s)
        await topology.aclose()
        assert report.abandoned == ["full", "gym-full", "orphan"]
        assert report.rollouts_seen == 3
        for rollout_id in report.abandoned:
            # records, calls, ledger, Gym keys, claim: gone; an RL rollout keeps its fence, a Gym one its tombstone
            left = await key_state(client, f"stg:{{{rollout_id}}}:*")
            left |= await key_state(client, f"stg:gym:{{{rollout_id}}}*")
            is_gym = rollout_id.startswith("gym")
            fence = gym_keys("stg", rollout_id).tombstone if is_gym else fence_key("stg", rollout_id)
            assert list(left) == [fence], left
            assert 0 < left[fence][1] <= 60
        dead = await _dead_letters(client)
        assert set(dead) == {"full", "gym-full", "orphan"}
        assert {name for fields in dead.values() for name in fields} == {
            "rollout_id",
            "dead_reason",
            "last_activity_ms",
            "records",
        }
        assert all(fields["dead_reason"].startswith("abandoned") for fields in dead.values())
        assert dead["full"]["last_activity_ms"] == str(full_ms)
        assert dead["full"]["records"] == str(len(staged.records) + 1)
        assert dead["gym-full"]["last_activity_ms"] == reply_text(touched)
        assert dead["gym-full"]["records"] == "0"
        assert dead["orphan"]["last_activity_ms"] == "0"  # records with no calls stream or ledger: no activity
        assert dead["orphan"]["records"] == "1"


async def test_activity_is_the_newest_calls_entry_ledger_row_or_gym_write(redis_url: str) -> None:
    chain = make_chain("ledger-newer", 2)
    later = make_chain("calls-newer", 3)[2]
    async with (
        AsyncRedisStagingSink.from_url(redis_url) as sink,
        RedisCaptureLedger.from_url(redis_url) as ledger,
        aioredis.Redis.from_url(redis_url) as client,
    ):
        await stage_rollout(sink, ledger, "stale", calls=1)
        await stage_rollout(sink, ledger, "calls-newer", calls=2)
        for record in chain:  # staged now, committed to the ledger only after the age line
            assert (await sink.stage(record)).ok
        line_s = await next_millisecond()
        await next_millisecond()  # every write below is in a later millisecond than the age line
        assert (await sink.stage(later)).ok  # staged, not (yet) committed: only its calls entry is new
        for index, record in enumerate(chain):
            staging_chain = tuple(r.staging_key for r in chain[: index + 1])
            commit = CaptureLedgerCommit(
                rollout_id="ledger-newer",
                record=call_record_of(record, admitted_at=1000.0 + index),
                staging_chain=staging_chain,
                request_items=[],
                response_items=[],
            )
            await ledger.record(commit)
        gym = RedisTokenSink(redis_url=redis_url)
        try:
            await gym.put(make_entry("gym-fresh", "c1"))
        finally:
            await gym.close()
        settings = PruneSettings(abandon_after_s=ABANDON_AFTER_S, retention_s=60)
        now_s = line_s + ABANDON_AFTER_S
        topology = Topology.borrow(client, settings)
        before = await key_state(client, "stg:*")
        dry = await prune_namespace(topology, settings, dry_run=True, now_s=now_s)
        assert dry.abandoned == ["stale"]
        assert await key_state(client, "stg:*") == before
        report = await prune_namespace(topology, settings, now_s=now_s)
        await topology.aclose()
        assert report.abandoned == ["stale"]
        for rollout_id in ("calls-newer", "ledger-newer"):
            assert await client.exists(calls_stream("stg", rollout_id), ledger_stream("stg", rollout_id)) == 2
            assert await client.exists(fence_key("stg", rollout_id)) == 0
        assert await client.exists(*gym_keys("stg", "gym-fresh")[:3]) == 3  # state, entries, digests


async def test_the_dry_run_and_the_pass_agree_at_the_age_line(redis_url: str) -> None:
    await stage_rollouts(redis_url, ["edge"], calls=1)
    await next_millisecond()
    await stage_rollouts(redis_url, ["younger"], calls=1)
    async with aioredis.Redis.from_url(redis_url) as client:
        edge_ms = await _newest_activity_ms(client, "edge")
        assert await _newest_activity_ms(client, "younger") > edge_ms
        settings = PruneSettings(abandon_after_s=ABANDON_AFTER_S, retention_s=60)
        now_s = now_for_cutoff(edge_ms, ABANDON_AFTER_S)  # "edge" is exactly abandon_after_s old, to the ms
        topology = Topology.borrow(client, settings)
        dry = await prune_namespace(topology, settings, dry_run=True, now_s=now_s)
        report = await prune_namespace(topology, settings, now_s=now_s)
        await topology.aclose()
        assert dry.abandoned == report.abandoned == ["edge"]  # what the dry run shows is what the pass does
        assert await client.exists(calls_stream("stg", "younger"), ledger_stream("stg", "younger")) == 2


class _FinishesMidPass(aioredis.Redis):
    """A real client to the test's server that, at the pass's first ``TTL`` (it has scanned the namespace and
    is at the first consumed rollout), lets another connection write *receipt*: a rollout finishing mid-pass."""

    url = ""
    receipt = ""
    written = False

    async def execute_command(self, *args: Any, **options: Any) -> Any:
        if args[0] == "TTL" and not self.written:
            self.written = True
            async with aioredis.Redis.from_url(self.url) as other:
                await other.set(self.receipt, "{}")
        return await super().execute_command(*args, **options)  # type: ignore[no-untyped-call]


@pytest.mark.parametrize("dry_run", [True, False], ids=["dry-run", "pass"])
async def test_a_rollout_whose_receipt_lands_mid_pass_is_left_to_the_trainer(redis_url: str, dry_run: bool) -> None:
    await stage_rollouts(redis_url, ["b-finishing"], calls=2)
    async with aioredis.Redis.from_url(redis_url) as setup:
        await setup.set(fence_key("stg", "a-consumed"), "1")  # sorted first: its TTL read comes before "b"
        before = await key_state(setup, "stg:{b-finishing}:*")
    client = _FinishesMidPass.from_url(redis_url)
    assert isinstance(client, _FinishesMidPass)
    client.url = redis_url
    client.receipt = receipt_key("stg", "b-finishing")
    settings = PruneSettings(abandon_after_s=ABANDON_AFTER_S, retention_s=60)
    topology = Topology.borrow(client, settings)
    try:
        report = await prune_namespace(topology, settings, dry_run=dry_run, now_s=await next_millisecond() + 3600)
    finally:
        await topology.aclose()
        await client.aclose()
    assert client.written
    assert report.abandoned == []  # it has a receipt now: the trainer's
    async with aioredis.Redis.from_url(redis_url) as check:
        after = await key_state(check, "stg:{b-finishing}:*")
    assert after == {**before, receipt_key("stg", "b-finishing"): ("string", -1, 2)}  # nothing deleted, no fence


async def test_dead_letters_that_abandonment_pushes_past_the_cap_are_trimmed_and_counted(redis_url: str) -> None:
    await stage_rollouts(redis_url, ["late"], calls=1)
    dead = dead_letter_stream("stg", "abandoned")
    async with aioredis.Redis.from_url(redis_url) as client:
        for index in range(5):  # earlier passes' records, already at the cap
            await client.xadd(dead, {"rollout_id": f"earlier-{index}", "dead_reason": "abandoned", "records": "1"})
        settings = PruneSettings(abandon_after_s=ABANDON_AFTER_S, retention_s=60, dead_letter_max_entries=5)
        topology = Topology.borrow(client, settings)
        report = await prune_namespace(topology, settings, now_s=await next_millisecond() + ABANDON_AFTER_S)
        await topology.aclose()
        assert report.abandoned == ["late"]
        assert report.dead_letters_trimmed == {dead: 1}  # the oldest record made room, and the report says so
        ids = [fields[b"rollout_id"] for _id, fields in raw_entries(await client.xrange(dead))]
        assert ids == [b"earlier-1", b"earlier-2", b"earlier-3", b"earlier-4", b"late"]


async def test_a_sub_second_retention_is_rounded_up_to_one_second(redis_url: str) -> None:
    """``EXPIRE`` counts whole seconds: ``retention_s`` 0.25 gives one second, never more."""
    await stage_rollouts(redis_url, ["stale"], calls=1)
    async with aioredis.Redis.from_url(redis_url) as client:
        await client.set(fence_key("stg", "retired"), "1")  # consumed: retention, no abandonment
        settings = PruneSettings(abandon_after_s=ABANDON_AFTER_S, retention_s=0.25)
        topology = Topology.borrow(client, settings)
        report = await prune_namespace(topology, settings, now_s=await next_millisecond() + ABANDON_AFTER_S)
        await topology.aclose()
        assert (report.retained, report.abandoned) == (["retired"], ["stale"])
        for rollout_id in ("retired", "stale"):
            ttl_ms = int(await client.pttl(fence_key("stg", rollout_id)))
            assert ttl_ms == -2 or 0 <= ttl_ms <= 1000, (rollout_id, ttl_ms)  # -2: already expired (0: this ms)
