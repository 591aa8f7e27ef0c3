"""Multi-chain rollouts below the proxy (contract §14): gate admission, per-chain terminals, the chain record, and
the reader's per-chain rows and skips against a real server."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anyio
import pytest
import redis.asyncio as aioredis

from sink.contract.chains import ChainEntry, ChainPolicy, RolloutChains
from sink.contract.records import ManifestFailure, RolloutManifest, StagedCallRecord
from sink.keys import DEFAULT_NAMESPACE
from sink.ledger.gate import CaptureGate
from sink.ledger.memory import MemoryCaptureLedger
from sink.ledger.rows import ChainLedgerView, ClaimedFailure
from sink.rollout.chains import build_chains
from sink.rollout.done_event import finished
from sink.rollout.receipt import build_receipt
from sink.trainer.batch import chain_weights, collate
from sink.trainer.export import read_export, write_export
from sink.trainer.groups import GroupReader, RolloutGroup
from sink.trainer.packing import pack
from sink.trainer.pulled import PulledRollout
from sink.trainer.reader.rollout_reader import RolloutReader
from sink_cli.main import main as cli_main
from sink_tools.bench.chains import run_chain_benchmark
from tests.helpers.chains import chain_tree, stage_two_trees
from tests.helpers.e2e import call_record_of, pull_until, running_assembler, stage_rollouts

USER = {"role": "user", "content": "hello"}
REPLY = {"role": "assistant", "content": "a reply nobody committed"}


def test_gate_admits_an_unresolved_call_as_a_root_only_under_a_multi_chain_policy() -> None:
    async def main() -> None:
        async with MemoryCaptureLedger() as ledger:
            # A committed row exists, so an unresolved continuation is not "seeded history" (§6.6 step 5).
            await ledger.record_failure("r-single", "seed", "worker_capture_failed", root=True)
            await ledger.record_failure("r-roots", "seed", "worker_capture_failed", root=True)
            single = await CaptureGate(ledger).admit("r-single", [USER, REPLY, USER])
            assert single is None
            roots = await CaptureGate(ledger, chain_policy=ChainPolicy.ROOTS).admit("r-roots", [USER, REPLY, USER])
            assert roots is not None and roots.mode == "text" and roots.parent_call_id is None
            opted = await CaptureGate(ledger).admit("r-opt", [USER, REPLY], chain_policy=ChainPolicy.BRANCHES)
            assert opted is not None and opted.mode == "text"
            _, view = await ledger.manifest_and_chains("r-roots")
            assert view.policy is ChainPolicy.ROOTS
            assert view.failures == (ClaimedFailure("seed", "worker_capture_failed", None, True),)
            # The first recorded policy wins; the manifest never shows the policy row.
            assert await ledger.record_chain_policy("r-opt", ChainPolicy.ROOTS) is ChainPolicy.BRANCHES
            assert await ledger.chain_policy("r-opt") is ChainPolicy.BRANCHES
            assert await ledger.chain_policy("r-single") is ChainPolicy.SINGLE
            # A later call of the opted-in rollout, without the opt-in (or with single), follows the recorded policy.
            await ledger.record_failure("r-opt", "seed", "worker_capture_failed", root=True)
            for opt_in in (None, ChainPolicy.SINGLE):
                later = await CaptureGate(ledger).admit("r-opt", [USER, REPLY, USER], chain_policy=opt_in)
                assert later is not None and later.mode == "text"
            manifest_single, view_single = await ledger.manifest_and_chains("r-single")
            assert view_single.policy is ChainPolicy.SINGLE
            assert [f.reason for f in manifest_single.failures] == ["worker_capture_failed", "unresolved_parent"]
            with pytest.raises(ValueError, match="multi-chain"):
                await ledger.record_chain_policy("r-opt", ChainPolicy.SINGLE)

    anyio.run(main)


def _manifest(rollout_id: str, records: list[StagedCallRecord], failures: list[ManifestFailure]) -> RolloutManifest:
    rows = [call_record_of(record, admitted_at=100.0 + index) for index, record in enumerate(records)]
    return RolloutManifest(rollout_id=rollout_id, records=rows, failures=failures)


def test_build_chains_selects_a_terminal_per_tree_and_holds_failures_to_their_chain() -> None:
    records = chain_tree("r", "a0", ("a1", "a0"), ("a2", "a1")) + chain_tree("r", "b0", ("b1", "b0"))
    failures = [ManifestFailure(model_call_id="bx", reason="worker_capture_failed")]
    manifest = _manifest("r", records, failures)
    receipt = build_receipt(manifest, rollout_id="r", reward=1.0, declared_response_id="resp-r-b1")
    assert receipt.capture_poisoned and receipt.terminal_model_call_id == "b1"  # the seed view: conservative
    view = ChainLedgerView(ChainPolicy.ROOTS, (ClaimedFailure("bx", "worker_capture_failed", "b0", False),))
    chains = build_chains(receipt, manifest, view)
    assert chains is not None and chains.failure_reason is None
    assert [(c.root_call_id, c.terminal_call_id, c.selection, c.failure_reason) for c in chains.chains] == [
        ("a0", "a2", "heuristic", None),
        ("b0", "b1", "declared", "worker_capture_failed"),
    ]
    assert chains.chains[0].call_ids == ("a0", "a1", "a2") and chains.chains[1].tree_call_ids == ("b0", "b1")
    assert build_chains(receipt, manifest, ChainLedgerView(ChainPolicy.SINGLE)) is None
    # A failure nobody can be held to poisons every chain.
    orphan = ChainLedgerView(ChainPolicy.ROOTS, (ClaimedFailure("bx", "worker_capture_failed", None, False),))
    whole = build_chains(receipt, manifest, orphan)
    assert whole is not None and whole.failure_reason == "worker_capture_failed"


def test_build_chains_branches_are_leaves_with_identical_retries_collapsed() -> None:
    records = chain_tree("r", "t0", ("x1", "t0"), ("y1", "t0"))
    # Same tokens as x1 under another call id: an identical retry (§7.3), collapsed to the smaller id.
    retry = records[1].model_copy(update={"model_call_id": "x9"})
    manifest = _manifest("r", [*records, retry], [])
    receipt = build_receipt(manifest, rollout_id="r", reward=0.0, declared_response_id="resp-r-y1")
    chains = build_chains(receipt, manifest, ChainLedgerView(ChainPolicy.BRANCHES))
    assert chains is not None
    assert [(c.terminal_call_id, c.selection) for c in chains.chains] == [("x1", "leaf"), ("y1", "leaf")]


def test_chain_record_rejects_inconsistent_shapes() -> None:
    with pytest.raises(ValueError, match="root_call_id to terminal_call_id"):
        ChainEntry(
            index=0, root_call_id="a", terminal_call_id="b", call_ids=("b",), tree_call_ids=("a", "b"), selection="leaf"
        )
    with pytest.raises(ValueError, match="failure_reason"):
        ChainEntry(index=0, root_call_id="a", tree_call_ids=("a",), selection="heuristic")
    entry = ChainEntry(
        index=1, root_call_id="a", terminal_call_id="a", call_ids=("a",), tree_call_ids=("a",), selection="leaf"
    )
    with pytest.raises(ValueError, match="indexes"):
        RolloutChains(rollout_id="r", policy=ChainPolicy.ROOTS, chains=(entry,))
    with pytest.raises(ValueError, match="single-chain"):
        RolloutChains(rollout_id="r", policy=ChainPolicy.SINGLE, failure_reason="x")


def _columns(records: list[StagedCallRecord]) -> tuple[list[int], list[float], list[float]]:
    return (
        [t for r in records for t in r.token_ids_delta],
        [m for r in records for m in r.token_mask_delta],
        [lp for r in records for lp in r.generation_log_probs_delta],
    )


async def _pull_one(url: str, rollout_id: str, **reader_fields: Any) -> PulledRollout:
    async with aioredis.Redis.from_url(url) as client:
        await finished(client, rollout_id, reward=0.5, declared_response_id=f"resp-{rollout_id}-b2")
    async with running_assembler(url, block_ms=50), RolloutReader.from_url(url, **reader_fields) as reader:
        [pulled] = await pull_until(reader, 1)
        await reader.ack([pulled.rollout_id])
        return pulled


def test_reader_delivers_one_exact_row_per_chain(redis_url: str) -> None:
    trees = anyio.run(stage_two_trees, redis_url, "mc-rows", ChainPolicy.ROOTS)
    pulled = anyio.run(_pull_one, redis_url, "mc-rows")
    assert pulled.row is None and not pulled.chain_skips and len(pulled.rows) == 2
    for index, (row, tree) in enumerate(zip(pulled.rows, trees, strict=True)):
        ids, mask, logprobs = _columns(tree)
        assert (row.chain_index, row.rollout_id) == (index, "mc-rows")
        assert (list(row.token_ids), list(row.token_mask), list(row.logprobs)) == (ids, mask, logprobs)
        assert row.model_call_ids == tuple(record.model_call_id for record in tree)
        assert row.weight_versions == tuple(record.weight_version for record in tree)


def test_missing_record_poisons_only_its_chain_or_the_whole_rollout(redis_url: str) -> None:
    async def drop(rollout_id: str, call_id: str) -> None:
        async with aioredis.Redis.from_url(redis_url) as client:
            assert await client.delete(f"{DEFAULT_NAMESPACE}:{{{rollout_id}}}:rec:{call_id}") == 1

    anyio.run(stage_two_trees, redis_url, "mc-miss", ChainPolicy.ROOTS)
    anyio.run(drop, "mc-miss", "a1")
    pulled = anyio.run(_pull_one, redis_url, "mc-miss")
    [row] = pulled.rows
    assert row.chain_index == 1 and row.model_call_ids == ("b0", "b1", "b2")
    [skip] = pulled.chain_skips
    assert (skip.chain_index, skip.root_call_id, skip.skip_code) == (0, "a0", "missing_record")

    anyio.run(stage_two_trees, redis_url, "mc-whole", ChainPolicy.ROOTS)
    anyio.run(drop, "mc-whole", "b1")
    whole = anyio.run(lambda: _pull_one(redis_url, "mc-whole", chain_failure_policy="skip_rollout"))
    assert not whole.trainable and whole.skip_code == "missing_record"
    assert whole.skip_reason is not None and whole.skip_reason.startswith("chain 1 (root b0)")


def test_staleness_is_per_chain(redis_url: str) -> None:
    anyio.run(stage_two_trees, redis_url, "mc-stale", ChainPolicy.ROOTS)

    async def main() -> PulledRollout:
        async with aioredis.Redis.from_url(redis_url) as client:
            await finished(client, "mc-stale", reward=0.5)
        async with (
            running_assembler(redis_url, block_ms=50),
            RolloutReader.from_url(redis_url, max_weight_lag=1) as reader,
        ):
            reader.set_weight_version(2)  # every chain's oldest call ran on version 0: both stale
            [pulled] = await pull_until(reader, 1)
            await reader.ack([pulled.rollout_id])
            return pulled

    pulled = anyio.run(main)
    assert not pulled.trainable and pulled.skip_code == "stale_weights"
    assert [skip.skip_code for skip in pulled.chain_skips] == ["stale_weights", "stale_weights"]


def test_collate_pack_and_export_round_trip_one_row_per_chain(redis_url: str, tmp_path: Path) -> None:
    trees = anyio.run(stage_two_trees, redis_url, "mc-batch", ChainPolicy.ROOTS)
    single = anyio.run(stage_rollouts, redis_url, ["mc-one"])
    pulled = anyio.run(_pull_all, redis_url, ["mc-batch", "mc-one"])
    by_id = {item.rollout_id: item for item in pulled}
    ordered = [by_id["mc-batch"], by_id["mc-one"]]
    batch = collate(ordered)
    assert batch.rollout_ids == ("mc-batch", "mc-batch", "mc-one") and batch.chain_indices == (0, 1, 0)
    assert batch.ack_ids == ("mc-batch", "mc-one")
    expected = [_columns(trees[0])[0], _columns(trees[1])[0], single[0].token_ids]
    for index, ids in enumerate(expected):
        assert batch.input_ids[index, : len(ids)].tolist() == ids
    assert batch.rewards.tolist() == [0.5, 0.5, 0.5]  # every chain shares its rollout's reward
    assert chain_weights(batch.rollout_ids, "split").tolist() == [0.5, 0.5, 1.0]
    assert chain_weights(batch.rollout_ids).tolist() == [1.0, 1.0, 1.0]
    packed = pack(ordered, max_tokens=64)
    assert packed.rollout_ids == batch.rollout_ids and packed.chain_indices == (0, 1, 0)
    path = tmp_path / "rows.jsonl"
    assert write_export(ordered, path) == 3
    lines = read_export(path)
    assert [(line["rollout_id"], line["chain_index"]) for line in lines] == [
        ("mc-batch", 0),
        ("mc-batch", 1),
        ("mc-one", 0),
    ]
    for line, ids, tree_or_none in zip(lines, expected, [trees[0], trees[1], None], strict=True):
        assert line["token_ids"] == ids and line["reward"] == 0.5
        if tree_or_none is not None:
            assert line["model_call_ids"] == [record.model_call_id for record in tree_or_none]
            assert line["terminal_model_call_id"] == tree_or_none[-1].model_call_id
    assert lines[1]["terminal_selection"] == "declared" and lines[0]["terminal_selection"] == "heuristic"


async def _pull_all(url: str, rollout_ids: list[str]) -> list[PulledRollout]:
    async with aioredis.Redis.from_url(url) as client:
        for rollout_id in rollout_ids:
            declared = f"resp-{rollout_id}-b2" if rollout_id == "mc-batch" else None  # the other: the §7.4 walk
            await finished(client, rollout_id, reward=0.5, declared_response_id=declared)
    async with running_assembler(url, block_ms=50), RolloutReader.from_url(url) as reader:
        pulled = await pull_until(reader, len(rollout_ids))
        await reader.ack([item.rollout_id for item in pulled])
        return pulled


def test_group_statistics_are_per_rollout_with_multi_chain_members(redis_url: str) -> None:
    anyio.run(stage_two_trees, redis_url, "mc-g1", ChainPolicy.ROOTS)
    anyio.run(stage_rollouts, redis_url, ["mc-g2"])

    async def main() -> list[RolloutGroup]:
        async with aioredis.Redis.from_url(redis_url) as client:
            await finished(client, "mc-g1", reward=1.0, group_id="g", group_size=2)
            await finished(client, "mc-g2", reward=0.0, group_id="g", group_size=2)
        async with running_assembler(redis_url, block_ms=50), RolloutReader.from_url(redis_url) as reader:
            groups = GroupReader(reader)
            delivered: list[RolloutGroup] = []
            with anyio.fail_after(20):
                while not delivered:
                    delivered += await groups.pull_groups(4, block_ms=100)
            await reader.ack([member.rollout_id for group in delivered for member in group.members])
            return delivered

    [group] = anyio.run(main)
    assert group.complete and sorted(group.rollout_ids) == ["mc-g1", "mc-g2"]
    # Two members, whatever their chains: the mean and spread of 1.0 and 0.0, not of three chain rows.
    assert (group.reward_mean, group.reward_std) == (0.5, 0.5)
    rows = [row for member in group.members for row in member.rows]
    assert len(rows) == 3


def test_chain_benchmark_runs_every_chain_count_and_cleans_up(redis_url: str) -> None:
    figures = anyio.run(
        lambda: run_chain_benchmark(
            redis_url, chain_counts=(1, 2), rollouts=2, calls=4, tokens=128, repeats=1, namespace="mc-bench"
        )
    )
    assert set(figures) == {1, 2} and all(value > 0 for value in figures.values())

    async def leftover() -> list[bytes]:
        async with aioredis.Redis.from_url(redis_url) as client:
            return [key async for key in client.scan_iter(match="mc-bench*")]

    assert anyio.run(leftover) == []
    with pytest.raises(ValueError, match="divide"):
        anyio.run(lambda: run_chain_benchmark(redis_url, chain_counts=(3,), calls=4, namespace="mc-bench"))


def test_inspect_and_verify_show_the_chains(redis_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    anyio.run(stage_two_trees, redis_url, "mc-cli", ChainPolicy.ROOTS)
    assert cli_main(["inspect", "mc-cli", "--redis-url", redis_url, "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["chains"]["policy"] == "roots"
    assert [chain["root_call_id"] for chain in shown["chains"]["chains"]] == ["a0", "b0"]
    assert cli_main(["verify", "mc-cli", "--redis-url", redis_url, "--json"]) == 0
    verified = json.loads(capsys.readouterr().out)
    assert verified["verified"] is True
    assert [(chain["index"], chain["verified"]) for chain in verified["chains"]] == [(0, True), (1, True)]
    assert cli_main(["verify", "mc-cli", "--redis-url", redis_url]) == 0
    text = capsys.readouterr().out
    assert "chain 0 (root a0)" in text and "chain 1 (root b0)" in text
