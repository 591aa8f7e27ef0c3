"""The mutation check: tests that kill the mutants that survived a first run and change behaviour.

The mutants were of the durability check, the confirmation replies, the staging script, verification, the
gate, key ownership, the ACL table and generation cuts (now run with mutmut, ``[tool.mutmut]`` in
``pyproject.toml``); each test below names the mutant it kills. Pure tests first, then real servers (Valkey 8 / Redis 7.0).
"""

from __future__ import annotations

import re
import stat
import time
from dataclasses import FrozenInstanceError
from pathlib import Path

import anyio
import pytest
import redis.asyncio as aioredis

from sink.contract.codec import decode_packed_record, encode_record
from sink.contract.records import CaptureLedgerCommit, StagedCallRecord, StagedCallSnapshot
from sink.errors import StagingKeyOwnershipError
from sink.ledger.redis import RedisCaptureLedger
from sink.ops.access.render import PLACEHOLDER_HASH, ROLE_POLICIES, KeyPattern, render_acl_example, write_private_file
from sink.server import DurableServer
from sink.settings import SinkSettings
from sink.store.durability import supports_waitaof
from sink.store.sink import AsyncRedisStagingSink
from sink.trainer.verify import linearize, verify_and_linearize
from tests.helpers.e2e import call_record_of
from tests.helpers.staging import make_chain, make_record
from tests.test_verify import example_case
from tests.test_worker_generation_cut import (
    CHUNK_END,
    CUT_AT,
    TOTAL,
    WEIGHTS,
    Checkpointed,
    checkpoint,
    child_admission,
    uninterrupted,
)
from worker import CaptureError, GenerationCutError, RolloutTokenCapture
from worker.call import ActiveCall
from worker.generation_cut import (
    CUT_DECODE_WINDOW,
    build_cut_continuation,
    build_generation_chunk_record,
    build_prefix_record,
    cut_refusal_reason,
    fetch_cut_prefix,
    plan_cut_continuation,
    rebuild_cut_prefix,
)

# --- generation cuts ----------------------------------------------------------------------------------


def test_the_cut_refusal_decodes_exactly_the_last_eight_tokens() -> None:
    """Kills ``CUT_DECODE_WINDOW = 8 -> 9`` (contract §9.2: decoding the last <= 8 tokens)."""
    seen: list[list[int]] = []

    def decode(ids: list[int]) -> str:
        seen.append(ids)
        return "ok"

    generated = list(range(100, 120))
    assert cut_refusal_reason(generated_token_ids=generated, decode=decode, effective_output_limit=64) is None
    assert CUT_DECODE_WINDOW == 8 and seen == [generated[-8:]]


def _cut_call(ck: Checkpointed, *, current: int = WEIGHTS) -> ActiveCall:
    admission = child_admission("r1-a1", "c2b", ck.root, ck.root_full, ck.continuation)
    snapshot = fetch_cut_prefix(admission, ck.store, current_weight_version=current)
    capture = RolloutTokenCapture(sink=ck.store, weight_version_fn=lambda: current)
    return capture.begin_call(
        admission, generation_cut=snapshot, generation_cut_staging_keys=ck.continuation.staging_keys
    )


def test_a_plan_needs_both_the_cut_admission_and_its_snapshot() -> None:
    """Kills ``cut is None or snapshot is None`` -> ``and``."""
    call = _cut_call(checkpoint())
    without_snapshot = ActiveCall(call.admission, call.weight_version, call.prefix_token_ids, None)
    with pytest.raises(CaptureError, match="generation cut"):
        plan_cut_continuation(without_snapshot)


def test_terminal_and_boundary_budgets() -> None:
    """Kills the ``0`` constants of the terminal plan and ``remaining <= 0`` -> ``<= 1``; the plan is frozen."""
    ck = checkpoint()
    terminal = ck.continuation.model_copy(update={"terminal_finish_reason": "length"})
    admission = child_admission("r1-a1", "c2b", ck.root, ck.root_full, terminal)
    snapshot = fetch_cut_prefix(admission, ck.store, current_weight_version=WEIGHTS)
    capture = RolloutTokenCapture(sink=ck.store, weight_version_fn=lambda: WEIGHTS)
    call = capture.begin_call(admission, generation_cut=snapshot, generation_cut_staging_keys=terminal.staging_keys)
    plan = plan_cut_continuation(call, min_tokens=50)
    assert (plan.max_tokens, plan.min_tokens, plan.finished) == (0, 0, True)
    with pytest.raises(FrozenInstanceError):
        plan.max_tokens = 3  # type: ignore[misc]
    one_left = plan_cut_continuation(_cut_call(checkpoint(limit=CHUNK_END + 1)), min_tokens=CHUNK_END + 1)
    assert (one_left.finished, one_left.max_tokens, one_left.min_tokens) == (False, 1, 1)


def test_a_cut_from_newer_weights_names_the_newest_chunk_version() -> None:
    """Kills ``versions[-1] -> versions[-2]`` in the message."""
    ck = checkpoint(chunk_weight=WEIGHTS + 3)
    admission = child_admission("r1-a1", "c2b", ck.root, ck.root_full, ck.continuation)
    with pytest.raises(GenerationCutError, match=rf"newer weights \({WEIGHTS + 3} > current {WEIGHTS}\)"):
        fetch_cut_prefix(admission, ck.store, current_weight_version=WEIGHTS)


def test_generated_tokens_inside_the_first_chunk_must_not_return_to_prompt_carry() -> None:
    """Kills ``1.0 in masks`` -> ``not in`` (masks ``0... 1 0 1...`` accepted)."""
    ck = checkpoint()
    first = ck.records[0]
    masks, logprobs = list(first.token_mask_delta), list(first.generation_log_probs_delta)
    flipped = masks.index(1.0) + 1
    masks[flipped], logprobs[flipped] = 0.0, 0.0
    forged = StagedCallRecord.from_components(
        rollout_id=first.rollout_id,
        model_call_id=first.model_call_id,
        parent_call_id=first.parent_call_id,
        mode=first.mode,
        prev_len=first.prev_len,
        delta_len=first.delta_len,
        cum_len=first.cum_len,
        weight_version=first.weight_version,
        token_ids_delta=list(first.token_ids_delta),
        token_mask_delta=masks,
        generation_log_probs_delta=logprobs,
        extras=None,
        extras_digest=first.extras_digest,
        chain_hash=first.chain_hash,
        cumulative_hash=first.cumulative_hash,
    )
    snapshots = [StagedCallSnapshot.model_validate(r.model_dump()) for r in (forged, ck.records[1])]
    admission = child_admission("r1-a1", "c2b", ck.root, ck.root_full, ck.continuation)
    with pytest.raises(GenerationCutError, match="zeros followed by ones"):
        rebuild_cut_prefix(admission, snapshots, current_weight_version=WEIGHTS)


def test_a_cut_of_three_chunks_with_rising_weights_continues_exactly() -> None:
    """A prefix and two chunks, the last from newer weights: the rebuilt prefix keeps the oldest version,
    a current version below the newest chunk is refused, and the continuation equals an uninterrupted run."""
    base = checkpoint()
    store = base.store
    capture = RolloutTokenCapture(sink=store, weight_version_fn=lambda: WEIGHTS)
    call = capture.begin_call(child_admission("r1", "c2", base.root, base.root_full))
    ids, lps = base.generation.token_ids, base.generation.logprobs
    middle = (CUT_AT + CHUNK_END) // 2
    rows = [
        build_prefix_record(
            call, prompt_token_ids=base.prompt, generated_token_ids=ids[:CUT_AT], generated_logprobs=lps[:CUT_AT]
        ),
        build_generation_chunk_record(call, chunk_token_ids=ids[CUT_AT:middle], chunk_logprobs=lps[CUT_AT:middle]),
    ]
    rows.append(
        build_generation_chunk_record(
            call,
            chunk_token_ids=ids[middle:CHUNK_END],
            chunk_logprobs=lps[middle:CHUNK_END],
            weight_version=WEIGHTS + 1,
        )
    )
    keys = []
    for sequence, row in enumerate(rows):
        result = store.stage_generation_prefix(row, checkpoint_id="ck3", chunk_sequence=sequence)
        assert result.ok and result.staging_key is not None
        keys.append(result.staging_key)
    continuation = build_cut_continuation(call, rows, keys, effective_output_limit=TOTAL)
    assert continuation.prefix_token_count == CHUNK_END and len(continuation.staging_keys) == 3
    admission = child_admission("r1-a1", "c2b", base.root, base.root_full, continuation)
    with pytest.raises(GenerationCutError, match="newer weights"):
        fetch_cut_prefix(admission, store, current_weight_version=WEIGHTS)
    snapshot = fetch_cut_prefix(admission, store, current_weight_version=WEIGHTS + 1)
    assert (
        snapshot.weight_version == WEIGHTS and snapshot.delta_len == len(rows[0].token_ids_delta) + CHUNK_END - CUT_AT
    )
    resumed = RolloutTokenCapture(sink=store, weight_version_fn=lambda: WEIGHTS + 1)
    live = resumed.begin_call(admission, generation_cut=snapshot, generation_cut_staging_keys=continuation.staging_keys)
    plan = plan_cut_continuation(live)
    assert plan.prompt_token_ids == base.prompt + ids[:CHUNK_END] and plan.max_tokens == TOTAL - CHUNK_END
    coords = resumed.complete_call(
        live,
        prompt_token_ids=plan.prompt_token_ids,
        generated_token_ids=ids[CHUNK_END:],
        generated_logprobs=lps[CHUNK_END:],
    )
    assert coords.model_dump() == uninterrupted(base, WEIGHTS).model_dump()
    # Swapping the last two chunks makes the versions decrease.
    with pytest.raises(GenerationCutError, match="decrease"):
        build_cut_continuation(call, [rows[0], rows[2], rows[1]], keys, effective_output_limit=TOTAL)


# --- verification -------------------------------------------------------------------------------------


def test_verify_names_a_string_passed_as_snapshots() -> None:
    """Kills ``not isinstance(snapshots, Sequence) or isinstance(snapshots, str...)`` -> ``and``."""
    receipt, _snapshots = example_case()
    with pytest.raises(TypeError, match="snapshots must be a sequence"):
        verify_and_linearize(receipt, "not snapshots")  # type: ignore[arg-type]


def test_verify_refuses_packed_snapshots_it_did_not_decode() -> None:
    """Kills ``own_decode and isinstance(snapshot, PackedSnapshot)`` -> ``or``."""
    receipt, snapshots = example_case()
    packed = [decode_packed_record(encode_record(StagedCallRecord.model_validate(s.model_dump()))) for s in snapshots]
    with pytest.raises(TypeError, match="not a StagedCallBaseSnapshot"):
        verify_and_linearize(receipt, packed)  # type: ignore[arg-type]


def test_linearize_checks_both_id_types() -> None:
    """Kills ``type(rollout_id) is not str or type(terminal_hint) is not str`` -> ``and``."""
    receipt, snapshots = example_case()
    with pytest.raises(TypeError, match="must be str"):
        linearize(5, snapshots, receipt.manifest, terminal_hint="main")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="must be str"):
        linearize("r1", snapshots, receipt.manifest, terminal_hint=7)  # type: ignore[arg-type]


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


# --- the staging script (real servers) ------------------------------------------------------------------


@pytest.mark.anyio
async def test_an_identical_restage_writes_nothing_without_replicas(redis_url: str) -> None:
    """Kills ``rewrite_present = ARGV[2] == '1'`` -> ``~=`` (a rewrite on every retry with ``min_replicas=0``)."""
    root, child = make_chain("quiet", 2)
    async with AsyncRedisStagingSink.from_url(redis_url) as sink, aioredis.Redis.from_url(redis_url) as client:
        assert all([(await sink.stage(root)).ok, (await sink.stage(child)).ok])
        before = int((await client.info("persistence"))["rdb_changes_since_last_save"])
        with anyio.fail_after(10):
            assert (await sink.stage(child)).ok
        after = int((await client.info("persistence"))["rdb_changes_since_last_save"])
        assert after == before, "an identical re-stage wrote the record again"
        assert sink.statistics().already_present == 1


# --- durability re-checks and confirmation replies (real servers) --------------------------------------


def _calls(stats: dict[str, object], command: str) -> int:
    entry = stats.get(f"cmdstat_{command}")
    return int(entry["calls"]) if isinstance(entry, dict) else 0


@pytest.mark.anyio
async def test_the_sink_verifies_at_open_and_confirms_each_batch_without_reverifying(redis_url: str) -> None:
    """Kills ``report(force=False)`` -> ``True`` and the cache condition's ``is None`` -> ``is not None``
    (a full re-verification on every stage), ``supports_waitaof = True`` -> ``False`` /
    ``durability == "fsync"`` -> ``!=`` (no ``WAITAOF`` where the server has it), and ``WAITAOF 1 0`` ->
    ``WAITAOF 1 1`` (every batch waiting confirm_timeout_s for a replica that does not exist)."""
    async with aioredis.Redis.from_url(redis_url) as client:
        server = await client.info("server")
        has_waitaof = supports_waitaof(server)
        before = await client.info("commandstats")
        async with AsyncRedisStagingSink.from_url(redis_url) as sink:
            # Well under confirm_timeout_s (5 s): WAITAOF waits for the local fsync only, never a replica.
            with anyio.fail_after(3.0):
                for record in make_chain("counted", 6):
                    assert (await sink.stage(record)).ok
        after = await client.info("commandstats")
    info_calls = _calls(after, "info") - _calls(before, "info") - 1  # minus our own first INFO
    assert info_calls == 1, f"the sink ran INFO {info_calls} times for 6 stages (once at open expected)"
    waitaof_calls = _calls(after, "waitaof") - _calls(before, "waitaof")
    assert (waitaof_calls >= 6) if has_waitaof else (waitaof_calls == 0), (has_waitaof, waitaof_calls)
    # Every batch read the four persistence settings back; the open check read them once more.
    assert _calls(after, "config|get") - _calls(before, "config|get") == 4 * 6 + 4


@pytest.mark.anyio
async def test_min_replicas_without_a_replica_fails_on_the_wait_reply(redis_url: str) -> None:
    """Kills ``report.problem is not None or not replicas`` -> ``and`` (a standalone primary without
    replicas must fail on ``WAIT``, not on an empty replica check)."""
    async with AsyncRedisStagingSink.from_url(redis_url, min_replicas=1, confirm_timeout_s=0.2) as sink:
        result = await sink.stage(make_record("lonely", "c0"))
    assert not result.ok and result.error is not None
    assert "only 0 of 1 required replicas acknowledged" in result.error, result.error


# --- the ACL table ----------------------------------------------------------------------------------------


def _worker_rules(server_version: str) -> set[str]:
    text = render_acl_example(server_version=server_version)
    [line] = [line for line in text.splitlines() if line.startswith("user worker ")]
    return {word.strip("()") for word in line.split()}


@pytest.mark.parametrize(
    ("version", "present", "absent"),
    [
        ("6.2", {"+evalsha", "+eval", "+script|load"}, {"+fcall", "+fcall_ro", "+waitaof", "+cluster|shards"}),
        ("7.0", {"+fcall", "+fcall_ro", "+cluster|shards"}, {"+evalsha", "+eval", "+script|load", "+waitaof"}),
        ("7.1", {"+fcall"}, {"+waitaof", "+client|setinfo", "+eval"}),
        ("7.2", {"+fcall", "+waitaof", "+client|setinfo"}, {"+eval", "+evalsha"}),
        ("8.0", {"+fcall", "+waitaof", "+client|setinfo", "+cluster|shards"}, {"+eval", "+evalsha", "+script|load"}),
    ],
)
def test_each_command_appears_exactly_from_its_first_version(version: str, present: set[str], absent: set[str]) -> None:
    """Kills every mutant of ``COMMANDS_SINCE`` / ``COMMANDS_UNTIL`` (each boundary is one version)."""
    rules = _worker_rules(version)
    assert present <= rules, present - rules
    assert not absent & rules, absent & rules


def test_the_acl_building_blocks_are_immutable_and_the_placeholder_is_a_sha256() -> None:
    """Kills ``frozen=True`` -> ``False`` on the table's dataclasses and ``"0" * 64`` -> ``65``."""
    policy = ROLE_POLICIES["worker"]
    with pytest.raises(FrozenInstanceError):
        policy.purpose = "x"  # type: ignore[misc]
    with pytest.raises(FrozenInstanceError):
        policy.grants[0].commands = ()  # type: ignore[misc]
    with pytest.raises(FrozenInstanceError):
        KeyPattern("<ns>:x").access = "W"  # type: ignore[misc]
    assert re.fullmatch("[0-9a-f]{64}", PLACEHOLDER_HASH)


def test_private_files_are_written_owner_only(tmp_path: Path) -> None:
    """Kills ``mode=0o600`` -> ``0o601``."""
    path = tmp_path / "secret.env"
    write_private_file(path, "STG_X=1\n")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and path.read_text() == "STG_X=1\n"


@pytest.mark.anyio
async def test_a_script_error_reply_is_reported_with_its_cause(redis_url: str) -> None:
    """A refused write names its cause. (The mutant ``explain_refusal(...) or describe_redis_error(reply)``
    -> ``and`` is killed by ``test_acl_no_user_code.py::test_roles_stage_only_after_setup...``.)"""
    async with AsyncRedisStagingSink.from_url(redis_url) as sink, aioredis.Redis.from_url(redis_url) as client:
        await client.config_set("maxmemory", 1)
        try:
            result = await sink.stage(make_record("full", "c0", n_tokens=512))
        finally:
            await client.config_set("maxmemory", 0)
    assert not result.ok and result.error is not None
    assert "OutOfMemoryError" in result.error or "OOM" in result.error, result.error


@pytest.mark.anyio
async def test_a_retry_while_the_replica_is_frozen_is_not_acknowledged(server_binary: Path, tmp_path: Path) -> None:
    """Kills ``"1" if min_replicas > 0`` -> ``> 1`` (no rewrite of a present record with ``min_replicas=1``).

    The retrying sink opens (and verifies the replica) before the freeze, so only the rewrite makes its
    ``WAIT`` cover the record: without it the connection has written nothing and ``WAIT`` answers 1 at once.
    """
    fast = {"repl-diskless-sync-delay": "0"}
    with (
        DurableServer(binary=server_binary, data_dir=tmp_path / "p", extra_config=fast) as primary,
        DurableServer(
            binary=server_binary, data_dir=tmp_path / "r", replica_of=(primary.host, primary.port)
        ) as replica,
    ):
        with primary.client() as admin:
            deadline = time.monotonic() + 15
            admin.set("probe", "1")  # WAIT counts replicas up to this connection's last write
            while int(admin.execute_command("WAIT", 1, 200)) < 1:
                assert time.monotonic() < deadline, "the replica never acknowledged"
        record = make_record("frozen", "c1")
        settings = SinkSettings(min_replicas=1, confirm_timeout_s=1.0)
        async with (
            AsyncRedisStagingSink.from_url(primary.url, settings) as first,
            AsyncRedisStagingSink.from_url(primary.url, settings) as retrying,
        ):
            assert (await first.stage(make_record("frozen", "c0"))).ok
            assert (await retrying.stage(make_record("other", "c0"))).ok
            replica.pause()
            try:
                assert not (await first.stage(record)).ok  # written, not confirmed
                retried = await retrying.stage(record)
            finally:
                replica.resume()
    assert not retried.ok and retried.error is not None and "replicas" in retried.error, retried
