"""The capture-ledger contract (contract §6), run against every implementation.

``TestLedgerContract`` runs each case on the in-memory ledger and on the Redis
ledger against both server binaries (valkey-server, redis-server), so the
fake cannot drift from the real thing. Redis-only behaviour (durability
across SIGKILL, key layout, error translation, scripts, cluster) is in
:mod:`tests.test_ledger_redis`.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import pytest
import redis

from sink.canonical import canonical_json
from sink.contract.fingerprint import FINGERPRINT_VERSION
from sink.contract.records import (
    LEDGER_ROW_MISSING_CHAIN_HASH_REASON,
    LEDGER_ROW_MISSING_RESPONSE_ID_REASON,
    UNRESOLVED_PARENT_REASON,
    CallRecord,
    ManifestFailure,
    RolloutRemoval,
)
from sink.errors import CodecError, LedgerConflictError, RolloutRetiredError
from sink.keys import ledger_ids_key, ledger_stream
from sink.ledger.lineage import AMBIGUOUS_REASON, NO_MATCH_REASON, LineageMatch, LineageResolution, LineageStatus
from sink.ledger.memory import MemoryCaptureLedger
from sink.ledger.redis import RedisCaptureLedger
from sink.ledger.rows import custody_entry, custody_row, decode_row
from tests.helpers.ledger import (
    ANSWER1,
    CHILD_REQUEST,
    ROOT_REQUEST,
    SYSTEM,
    USER1,
    USER2,
    R,
    as_manifest_row,
    child_commit,
    hexdigest,
    root_commit,
)

Ledger = MemoryCaptureLedger | RedisCaptureLedger


@dataclass
class LedgerEnv:
    """One ledger under test plus what a test needs to reach its storage directly."""

    ledger: Ledger
    url: str | None

    def second(self) -> Ledger:
        """Another instance over the same storage (another process, for Redis)."""
        if isinstance(self.ledger, MemoryCaptureLedger):
            return MemoryCaptureLedger(self.ledger.store)
        assert self.url is not None
        return RedisCaptureLedger.from_url(self.url)

    def inject(self, rollout_id: str, entry: dict[str, str]) -> None:
        """Append a raw ledger entry, bypassing every check (malformed rows)."""
        if isinstance(self.ledger, MemoryCaptureLedger):
            self.ledger._inject_entry(rollout_id, entry)
            return
        assert self.url is not None
        with redis.Redis.from_url(self.url) as client:
            client.xadd(ledger_stream("stg", rollout_id), entry)

    def holds_rows(self, rollout_id: str) -> bool:
        """Whether any ledger data (rows or idempotency index) is stored, ignoring the fence."""
        if isinstance(self.ledger, MemoryCaptureLedger):
            return rollout_id in self.ledger.store.ledgers
        assert self.url is not None
        with redis.Redis.from_url(self.url) as client:
            return bool(client.exists(ledger_stream("stg", rollout_id), ledger_ids_key("stg", rollout_id)))


BACKENDS = pytest.mark.parametrize(
    ("backend", "server_binary"),
    [
        pytest.param("memory", "valkey-server", id="memory"),
        pytest.param("redis", "valkey-server", id="redis-valkey"),
        pytest.param("redis", "redis-server", id="redis-redis"),
    ],
    indirect=["server_binary"],
)


@pytest.fixture
async def env(backend: str, server_binary: Path, request: pytest.FixtureRequest) -> AsyncIterator[LedgerEnv]:
    if backend == "memory":
        async with MemoryCaptureLedger() as memory:
            yield LedgerEnv(memory, None)
        return
    url = request.getfixturevalue("redis_url")
    async with RedisCaptureLedger.from_url(url) as ledger:
        yield LedgerEnv(ledger, url)


@BACKENDS
@pytest.mark.anyio
class TestLedgerContract:
    # --- record, idempotency, conflicts (§6.3) ---------------------------

    async def test_record_then_manifest_in_append_order(self, env: LedgerEnv) -> None:
        root, child = root_commit(), child_commit()
        await env.ledger.record(root)
        await env.ledger.record_failure(R, "c-x", UNRESOLVED_PARENT_REASON)
        await env.ledger.record(child)
        manifest = await env.ledger.manifest(R)
        assert manifest.rollout_id == R
        assert manifest.records == [as_manifest_row(root), as_manifest_row(child)]
        assert all(row.capture_key == R for row in manifest.records)
        assert manifest.failures == [ManifestFailure(model_call_id="c-x", reason=UNRESOLVED_PARENT_REASON)]
        assert await env.ledger.has_rows(R) is True

    async def test_stored_capture_key_and_fingerprint_version_are_kept(self, env: LedgerEnv) -> None:
        # A capture key names an earlier attempt of the rollout, never another rollout (contract §2.5).
        earlier = f"{R}-a0"
        commit = root_commit(
            capture_key=earlier, staging_key=f"{earlier}/c-root", fingerprint_version=0, output_fingerprint=None
        )
        await env.ledger.record(commit)
        (row,) = (await env.ledger.manifest(R)).records
        assert (row.capture_key, row.fingerprint_version, row.output_fingerprint) == (earlier, 0, None)

    async def test_never_touched_rollout_is_empty_not_an_error(self, env: LedgerEnv) -> None:
        manifest = await env.ledger.manifest("never")
        assert (manifest.records, manifest.failures) == ([], [])
        assert await env.ledger.has_rows("never") is False

    async def test_identical_replay_is_a_no_op(self, env: LedgerEnv) -> None:
        for _ in range(3):
            await env.ledger.record(root_commit())
        assert [row.model_call_id for row in (await env.ledger.manifest(R)).records] == ["c-root"]

    @pytest.mark.parametrize(
        "change",
        [
            {"weight_version": 2},
            {"response_id": "resp-other"},
            {"admitted_at": 1700000000.5},
            {"digest": hexdigest("other")},
            {"staging_chain": ("r-1/other",)},
            {"request_items": [SYSTEM, {"role": "user", "content": "bye"}]},
            {"response_items": [{"role": "assistant", "content": "bye"}]},
        ],
        ids=lambda change: next(iter(change)),
    )
    async def test_any_difference_conflicts_and_keeps_the_stored_row(
        self, env: LedgerEnv, change: dict[str, Any]
    ) -> None:
        original = root_commit()
        await env.ledger.record(original)
        before = await env.ledger.manifest(R)
        record_change = {k: v for k, v in change.items() if k in CallRecord.model_fields}
        commit_change = {k: v for k, v in change.items() if k not in record_change}
        altered = original.model_copy(
            update={"record": original.record.model_copy(update=record_change), **commit_change}
        )
        with pytest.raises(LedgerConflictError, match="conflicting") as caught:
            await env.ledger.record(altered)
        assert isinstance(caught.value, ValueError)
        assert (caught.value.rollout_id, caught.value.model_call_id) == (R, original.record.model_call_id)
        assert caught.value.differing_fields
        assert await env.ledger.manifest(R) == before
        await env.ledger.record(original)  # the stored row is still the original one
        assert await env.ledger.manifest(R) == before

    async def test_record_failure_dedupes_identical_and_appends_new_reasons(self, env: LedgerEnv) -> None:
        await env.ledger.record_failure(R, "c1", "worker_capture_failed")
        await env.ledger.record_failure(R, "c1", "worker_capture_failed")
        await env.ledger.record_failure(R, "c2", "worker_capture_failed")
        await env.ledger.record_failure(R, "c1", "unresolved_parent")
        failures = [(f.model_call_id, f.reason) for f in (await env.ledger.manifest(R)).failures]
        assert failures == [
            ("c1", "worker_capture_failed"),
            ("c2", "worker_capture_failed"),
            ("c1", "unresolved_parent"),
        ]
        assert (await env.ledger.manifest(R)).records == []
        assert await env.ledger.has_rows(R) is True

    async def test_invalid_rollout_ids_are_rejected_everywhere(self, env: LedgerEnv) -> None:
        for bad in ("", "a b", "r/1", "é", "{r}"):
            with pytest.raises(ValueError, match="Invalid rollout id"):
                await env.ledger.manifest(bad)
            with pytest.raises(ValueError, match="Invalid rollout id"):
                await env.ledger.has_rows(bad)
            with pytest.raises(ValueError, match="Invalid rollout id"):
                await env.ledger.record_failure(bad, "c1", "x")
            with pytest.raises(ValueError, match="Invalid rollout id"):
                await env.ledger.resolve(bad, ROOT_REQUEST)
        with pytest.raises(ValueError, match="Invalid rollout id"):
            await env.ledger.record(root_commit().model_copy(update={"rollout_id": "bad id"}))
        with pytest.raises(TypeError):
            await env.ledger.record(root_commit().record)  # type: ignore[arg-type]

    # --- manifest construction (§6.7) -------------------------------------

    async def test_malformed_custody_rows_become_ledger_row_failures(self, env: LedgerEnv) -> None:
        def damaged(call_id: str, **record_changes: Any) -> dict[str, str]:
            row = custody_row(root_commit(call_id))
            for name, value in record_changes.items():
                if value is None:
                    del row["record"][name]
                else:
                    row["record"][name] = value
            return custody_entry(canonical_json(row))

        await env.ledger.record(root_commit("c-good"))
        env.inject(R, damaged("c-no-resp", response_id=None))
        env.inject(R, damaged("c-empty-resp", response_id=""))
        env.inject(R, {"kind": "generation_cut", "checkpoint": "k1"})  # other kinds are skipped
        env.inject(R, damaged("c-no-chain", chain_hash=None))
        env.inject(R, damaged("c-no-cum", cumulative_hash=None))
        await env.ledger.record_failure(R, "c-late", "worker_capture_failed")
        manifest = await env.ledger.manifest(R)
        assert [row.model_call_id for row in manifest.records] == ["c-good"]
        assert [(f.model_call_id, f.reason) for f in manifest.failures] == [
            ("c-no-resp", LEDGER_ROW_MISSING_RESPONSE_ID_REASON),
            ("c-empty-resp", LEDGER_ROW_MISSING_RESPONSE_ID_REASON),
            ("c-no-chain", LEDGER_ROW_MISSING_CHAIN_HASH_REASON),
            ("c-no-cum", LEDGER_ROW_MISSING_CHAIN_HASH_REASON),
            ("c-late", "worker_capture_failed"),
        ]

    async def test_unreadable_rows_fail_loudly(self, env: LedgerEnv) -> None:
        await env.ledger.record(root_commit())
        env.inject(R, custody_entry("{not json"))
        with pytest.raises(CodecError, match="corrupt ledger row"):
            await env.ledger.manifest(R)
        with pytest.raises(CodecError, match="corrupt ledger row"):
            await env.ledger.resolve(R, CHILD_REQUEST)
        with pytest.raises(ValueError, match="non-empty"):
            await env.ledger.record_failure(R, "c1", "")

    # --- resolution (§6.5, §6.6) -------------------------------------------

    async def test_request_without_model_output_is_a_root(self, env: LedgerEnv) -> None:
        assert await env.ledger.resolve(R, ROOT_REQUEST) == LineageResolution(LineageStatus.ROOT)

    async def test_continuation_resolves_to_its_parent(self, env: LedgerEnv) -> None:
        root = root_commit()
        await env.ledger.record(root)
        resolution = await env.ledger.resolve(R, CHILD_REQUEST)
        assert resolution.status is LineageStatus.RESOLVED
        assert resolution.match == LineageMatch(
            model_call_id="c-root",
            cumulative_token_ids=(),
            digest=root.record.cumulative_hash,
            staging_chain=root.staging_chain,
            prev_len=root.record.cum_len,
            chain_hash=root.record.chain_hash,
        )

    async def test_seeded_history_on_an_empty_ledger_is_unresolved_without_rows(self, env: LedgerEnv) -> None:
        # The gate turns exactly this case (UNRESOLVED and has_rows false) into a text root (§6.6 step 5).
        resolution = await env.ledger.resolve(R, CHILD_REQUEST)
        assert (resolution.status, resolution.reason) == (LineageStatus.UNRESOLVED, NO_MATCH_REASON)
        assert await env.ledger.has_rows(R) is False

    async def test_unmatched_history_with_rows_is_no_match(self, env: LedgerEnv) -> None:
        await env.ledger.record(root_commit())
        foreign = [SYSTEM, USER1, {"role": "assistant", "content": "something else"}, USER2]
        resolution = await env.ledger.resolve(R, foreign)
        assert (resolution.status, resolution.match, resolution.reason) == (
            LineageStatus.UNRESOLVED,
            None,
            NO_MATCH_REASON,
        )
        assert await env.ledger.has_rows(R) is True

    async def test_same_output_under_a_different_context_does_not_match(self, env: LedgerEnv) -> None:
        await env.ledger.record(root_commit())
        other_user = [SYSTEM, {"role": "user", "content": "howdy"}, ANSWER1, USER2]
        assert (await env.ledger.resolve(R, other_user)).reason == NO_MATCH_REASON
        # Instruction content is volatile and not part of the context digest.
        new_system = [{"role": "system", "content": "be verbose"}, USER1, ANSWER1, USER2]
        assert (await env.ledger.resolve(R, new_system)).status is LineageStatus.RESOLVED

    async def test_identical_text_with_different_tokens_is_ambiguous(self, env: LedgerEnv) -> None:
        await env.ledger.record(root_commit("c-a"))
        await env.ledger.record(root_commit("c-b"))  # same text, different cumulative_hash (tokens)
        resolution = await env.ledger.resolve(R, CHILD_REQUEST)
        assert (resolution.status, resolution.reason) == (LineageStatus.UNRESOLVED, AMBIGUOUS_REASON)

    async def test_identical_retries_collapse_to_the_smallest_call_id(self, env: LedgerEnv) -> None:
        same_tokens = {"cumulative_hash": hexdigest("cum:shared")}
        await env.ledger.record(root_commit("c-b", **same_tokens))
        await env.ledger.record(root_commit("c-a", **same_tokens))
        resolution = await env.ledger.resolve(R, CHILD_REQUEST)
        assert resolution.match is not None and resolution.match.model_call_id == "c-a"

    async def test_rows_of_another_fingerprint_version_never_resolve(self, env: LedgerEnv) -> None:
        row = custody_row(root_commit())
        row["fingerprint_version"] = FINGERPRINT_VERSION - 1
        env.inject(R, custody_entry(canonical_json(row)))
        assert (await env.ledger.resolve(R, CHILD_REQUEST)).reason == NO_MATCH_REASON
        assert [r.model_call_id for r in (await env.ledger.manifest(R)).records] == ["c-root"]

    # --- retire, delete, fences (§6.8, §6.9) --------------------------------

    async def test_retire_reports_removed_and_absent_and_fences(self, env: LedgerEnv) -> None:
        await env.ledger.record(root_commit())
        removal = await env.ledger.retire([R, "never-started", R])
        assert removal == RolloutRemoval(removed=[R], absent=["never-started"])
        assert await env.ledger.retire([R, "never-started"]) == RolloutRemoval(absent=[R, "never-started"])
        assert not env.holds_rows(R)
        for rollout_id in (R, "never-started"):
            with pytest.raises(RolloutRetiredError):
                await env.ledger.manifest(rollout_id)
            with pytest.raises(RolloutRetiredError):
                await env.ledger.has_rows(rollout_id)
            for items in (ROOT_REQUEST, CHILD_REQUEST):
                resolution = await env.ledger.resolve(rollout_id, items)
                assert (resolution.status, resolution.match) == (LineageStatus.UNRESOLVED, None)

    async def test_fence_is_visible_to_another_instance_and_discards_writes(
        self, env: LedgerEnv, caplog: pytest.LogCaptureFixture
    ) -> None:
        caplog.set_level(logging.WARNING, logger="sink.ledger")
        await env.ledger.record(root_commit())
        await env.ledger.retire([R])
        async with env.second() as other:
            with pytest.raises(RolloutRetiredError):
                await other.manifest(R)
            await other.record(child_commit())  # discarded without error
            await other.record_failure(R, "c-late", UNRESOLVED_PARENT_REASON)
        assert f"{R}/c-child" in caplog.text
        assert sum("discarded" in rec.getMessage() for rec in caplog.records) == 2
        assert not env.holds_rows(R)
        with pytest.raises(RolloutRetiredError):
            await env.ledger.has_rows(R)

    async def test_delete_removes_ledger_and_fence_and_makes_the_id_reusable(self, env: LedgerEnv) -> None:
        await env.ledger.record(root_commit())
        await env.ledger.record(root_commit(rollout_id="r-2"))
        await env.ledger.retire(["r-2", "r-3"])
        removal = await env.ledger.delete([R, "r-2", "r-3", "unknown"])
        assert removal == RolloutRemoval(removed=[R], absent=["r-2", "r-3", "unknown"])
        for rollout_id in (R, "r-2", "r-3"):
            assert await env.ledger.has_rows(rollout_id) is False
            assert (await env.ledger.manifest(rollout_id)).records == []
        await env.ledger.record(root_commit(rollout_id="r-2"))
        assert [r.model_call_id for r in (await env.ledger.manifest("r-2")).records] == ["c-root"]

    async def test_batches_are_validated_whole_before_any_change(self, env: LedgerEnv) -> None:
        await env.ledger.record(root_commit())
        for operation in (env.ledger.retire, env.ledger.delete):
            with pytest.raises(ValueError, match="Invalid rollout id"):
                await operation([R, "bad id"])
            with pytest.raises(TypeError):
                await operation(R)
            assert await env.ledger.has_rows(R) is True
        assert await env.ledger.delete([]) == RolloutRemoval()

    async def test_writes_racing_a_retire_end_removed_or_discarded(
        self, env: LedgerEnv, caplog: pytest.LogCaptureFixture
    ) -> None:
        caplog.set_level(logging.WARNING, logger="sink.ledger")
        writers, calls_per_writer, retire_after = 8, 10, 10
        completed = 0
        some_landed = anyio.Event()
        removals: list[RolloutRemoval] = []

        async def write(writer: int) -> None:
            nonlocal completed
            for call in range(calls_per_writer):
                for _ in range((writer + call) % 3):
                    await anyio.lowlevel.checkpoint()  # spread the writes around the retire
                await env.ledger.record(root_commit(f"c{writer}-{call}"))
                completed += 1
                if completed == retire_after:
                    some_landed.set()

        async def retire() -> None:
            await some_landed.wait()
            removals.append(await env.ledger.retire([R]))

        async with anyio.create_task_group() as group:
            for writer in range(writers):
                group.start_soon(write, writer)
            group.start_soon(retire)

        # Every write either landed before the fence (and retire removed it) or was discarded after it.
        discarded = [rec for rec in caplog.records if "discarded" in rec.getMessage()]
        assert removals == [RolloutRemoval(removed=[R])]
        assert retire_after <= writers * calls_per_writer - len(discarded) < writers * calls_per_writer
        assert not env.holds_rows(R)
        with pytest.raises(RolloutRetiredError):
            await env.ledger.manifest(R)

    async def test_closed_ledger_refuses_work_and_close_is_idempotent(self, env: LedgerEnv) -> None:
        await env.ledger.aclose()
        await env.ledger.close()
        with pytest.raises(RuntimeError, match="closed"):
            await env.ledger.manifest(R)
        with pytest.raises(RuntimeError, match="closed"):
            await env.ledger.retire([R])


@pytest.mark.parametrize("text", ['{"record": NaN}', '{"r": -Infinity}', '{"a": 1', "[1]", '"row"', "\ud800"])
def test_a_row_that_is_not_a_canonical_json_object_is_corrupt(text: str) -> None:
    """Rows are canonical JSON objects (never NaN or infinities): anything else is a CodecError, never a parse."""
    with pytest.raises(CodecError, match="corrupt ledger row"):
        decode_row(text)
