"""An export by rollout id of a multi-chain rollout (contract §14.4, ``export_rollouts`` and ``staging-sink
export`` against a real server) writes exactly what the reader delivers: one line per healthy chain, each with its
own calls, tokens and terminal, never the receipt's chain alone under ``chain_index`` 0. A chain the reader skips
is not written (and is logged); a rollout with no healthy chain is refused like a poisoned single-chain one."""

from __future__ import annotations

import io
import json
import logging
from pathlib import Path

import anyio
import pytest
import redis.asyncio as aioredis

from sink.contract.chains import ChainPolicy
from sink.contract.records import StagedCallRecord
from sink.errors import RowUnavailableError
from sink.keys import DEFAULT_NAMESPACE, receipt_key, record_key
from sink.ledger.redis import RedisCaptureLedger
from sink.rollout.done_event import finished
from sink.trainer.export import export_rollouts, write_export
from sink.trainer.pulled import PulledRollout
from sink.trainer.reader.rollout_reader import RolloutReader
from sink_cli.main import main as cli_main
from tests.helpers.chains import stage_two_trees
from tests.helpers.e2e import pull_until, running_assembler
from tests.helpers.processes import until


async def _publish_two_trees(
    url: str, rollout_id: str, namespace: str = DEFAULT_NAMESPACE
) -> list[list[StagedCallRecord]]:
    """Stage two trees under ``roots`` (``a0 <- a1``, ``b0 <- b1 <- b2``), finish, and wait for the receipt."""
    trees = await stage_two_trees(url, rollout_id, ChainPolicy.ROOTS, namespace=namespace)
    async with aioredis.Redis.from_url(url) as client:
        await finished(client, rollout_id, reward=0.5, declared_response_id=f"resp-{rollout_id}-b2", namespace=namespace)
        async with running_assembler(url, block_ms=50, namespace=namespace):

            async def stored() -> bool:
                return bool(await client.exists(receipt_key(namespace, rollout_id)))

            await until(stored, f"the assembler stored no receipt for {rollout_id} within 30 s", timeout_s=30)
    return trees


async def _export_by_id(url: str, rollout_id: str, namespace: str = DEFAULT_NAMESPACE) -> list[dict[str, object]]:
    out = io.StringIO()
    async with aioredis.Redis.from_url(url) as client:
        written = await export_rollouts(client, [rollout_id], out, namespace=namespace)
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert written == len(lines)
    return lines


async def _pull(url: str) -> PulledRollout:
    async with RolloutReader.from_url(url) as reader:
        [pulled] = await pull_until(reader, 1)
        return pulled


def _lines_of(pulled: PulledRollout) -> list[dict[str, object]]:
    out = io.StringIO()
    write_export([pulled], out)
    return [json.loads(line) for line in out.getvalue().splitlines()]


def test_an_export_by_id_writes_one_line_per_chain_exactly_as_the_reader_delivers(redis_url: str) -> None:
    trees = anyio.run(_publish_two_trees, redis_url, "mc-exp")
    lines = anyio.run(_export_by_id, redis_url, "mc-exp")
    assert [(line["chain_index"], line["model_call_ids"]) for line in lines] == [
        (0, ["a0", "a1"]),
        (1, ["b0", "b1", "b2"]),
    ]
    for line, tree in zip(lines, trees, strict=True):
        assert line["token_ids"] == [token for record in tree for token in record.token_ids_delta]
        assert line["terminal_model_call_id"] == tree[-1].model_call_id
    assert lines == _lines_of(anyio.run(_pull, redis_url))  # the same rows the trainer got


def test_the_export_command_writes_every_chain(redis_url: str, tmp_path: Path) -> None:
    anyio.run(_publish_two_trees, redis_url, "mc-cli-exp")
    path = tmp_path / "rows.jsonl"
    assert cli_main(["export", "mc-cli-exp", "--redis-url", redis_url, "--output", str(path)]) == 0
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(row["rollout_id"], row["chain_index"]) for row in rows] == [("mc-cli-exp", 0), ("mc-cli-exp", 1)]


def test_a_chain_the_reader_skips_is_not_exported_and_is_logged(
    redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    anyio.run(_publish_two_trees, redis_url, "mc-half")

    async def drop_a1() -> None:
        async with aioredis.Redis.from_url(redis_url) as client:
            assert await client.delete(record_key(DEFAULT_NAMESPACE, "mc-half/a1")) == 1

    anyio.run(drop_a1)
    caplog.set_level(logging.WARNING)
    lines = anyio.run(_export_by_id, redis_url, "mc-half")
    assert [(line["chain_index"], line["model_call_ids"]) for line in lines] == [(1, ["b0", "b1", "b2"])]
    reason = "no staged record for 1 key(s): ['mc-half/a1']"
    logged = f"export of rollout 'mc-half': chain 0 (root a0) not written: missing_record ({reason})"
    assert [record.getMessage() for record in caplog.records if record.name == "sink.trainer.export"] == [logged]
    pulled = anyio.run(_pull, redis_url)
    assert lines == _lines_of(pulled) and [skip.chain_index for skip in pulled.chain_skips] == [0]


def test_a_multi_chain_rollout_with_no_healthy_chain_is_refused_and_nothing_is_written(redis_url: str) -> None:
    anyio.run(_publish_two_trees, redis_url, "mc-none")

    async def export_after_dropping() -> str:
        out = io.StringIO()
        async with aioredis.Redis.from_url(redis_url) as client:
            for call in ("a0", "b1"):
                assert await client.delete(record_key(DEFAULT_NAMESPACE, f"mc-none/{call}")) == 1
            with pytest.raises(RowUnavailableError) as info:
                await export_rollouts(client, ["mc-none"], out)
        assert out.getvalue() == ""
        return str(info.value)

    message = anyio.run(export_after_dropping)
    assert "'mc-none'" in message and "mc-none/a0" in message


def test_a_multi_chain_rollout_of_another_namespace_is_exported_from_its_own_ledger(redis_url: str) -> None:
    anyio.run(_publish_two_trees, redis_url, "mc-ns", "other")
    lines = anyio.run(_export_by_id, redis_url, "mc-ns", "other")
    assert [(line["chain_index"], line["model_call_ids"]) for line in lines] == [
        (0, ["a0", "a1"]),
        (1, ["b0", "b1", "b2"]),
    ]


def test_a_rollout_whose_ledger_was_retired_is_row_unavailable_naming_it(redis_url: str) -> None:
    anyio.run(_publish_two_trees, redis_url, "mc-retired")

    async def retire_then_export() -> str:
        async with RedisCaptureLedger.from_url(redis_url) as ledger:
            assert (await ledger.retire(["mc-retired"])).removed == ["mc-retired"]
        out = io.StringIO()
        async with aioredis.Redis.from_url(redis_url) as client:
            with pytest.raises(RowUnavailableError) as info:
                await export_rollouts(client, ["mc-retired"], out)
        assert out.getvalue() == ""
        return str(info.value)

    message = anyio.run(retire_then_export)
    assert "'mc-retired'" in message and "retired" in message

