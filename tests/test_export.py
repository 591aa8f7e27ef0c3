"""Keeping what was trained (sink.trainer.export, ``staging-sink export``): exported rows equal the verified rows."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import anyio
import pytest
import redis.asyncio as aioredis

from sink.errors import BatchInputError, RowUnavailableError, StagingError
from sink.trainer.export import ExportFormat, export_record, export_rollouts, read_export, write_export
from sink.trainer.pulled import PulledRollout
from sink.trainer.reader.rollout_reader import RolloutReader
from sink_cli.main import main
from tests.helpers.e2e import pull_until
from tests.helpers.rows import skipped_pulled, verified_pulled
from tests.helpers.trainer import publish

IDS = ["exp-0", "exp-1", "exp-2"]


def _expected(item: PulledRollout) -> dict[str, Any]:
    assert item.row is not None
    return {
        "rollout_id": item.rollout_id,
        "token_ids": list(item.row.token_ids),
        "token_mask": list(item.row.token_mask),
        "logprobs": list(item.row.logprobs),
        "reward": item.receipt.reward,
        "weight_versions": list(item.row.weight_versions),
        "model_call_ids": list(item.row.model_call_ids),
        "prompt_len": item.row.prompt_len,
    }


_KEYS = (
    "rollout_id",
    "token_ids",
    "token_mask",
    "logprobs",
    "reward",
    "weight_versions",
    "model_call_ids",
    "prompt_len",
)


@pytest.mark.anyio
@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
async def test_exported_rows_equal_the_verified_rows(redis_url: str, tmp_path: Path, fmt: str) -> None:
    await publish(redis_url, IDS, groups={"exp-0": ("g", 1)}, rewards={"exp-1": -0.5})
    path = tmp_path / f"rows.{fmt}"
    async with RolloutReader.from_url(redis_url) as reader:
        pulled = sorted(await pull_until(reader, len(IDS)), key=lambda p: p.rollout_id)
        assert write_export(pulled, path, fmt=fmt) == len(IDS)  # type: ignore[arg-type]
        await reader.ack([p.rollout_id for p in pulled])
    rows = read_export(path)
    assert [{k: r[k] for k in _KEYS} for r in rows] == [_expected(p) for p in pulled]
    assert rows[0]["group_id"] == "g" and rows[0]["group_size"] == 1 and rows[1]["group_id"] is None
    assert rows[1]["receipt"]["rollout_id"] == "exp-1" and rows[1]["reward"] == -0.5


def test_float_columns_survive_both_formats_exactly(tmp_path: Path) -> None:
    item = verified_pulled("z")
    record = export_record(item)
    assert record["logprobs"][0] == 0.0
    formats: tuple[ExportFormat, ...] = ("jsonl", "parquet")
    for fmt in formats:
        path = tmp_path / f"z.{fmt}"
        write_export([item, skipped_pulled("gone")], path, fmt=fmt)
        (row,) = read_export(path)  # the skipped rollout has no row
        assert row["token_mask"] == record["token_mask"] and row["logprobs"] == record["logprobs"]


def test_bad_export_input_is_a_typed_error(tmp_path: Path) -> None:
    with pytest.raises(BatchInputError, match="format"):
        write_export([], tmp_path / "x", fmt="csv")  # type: ignore[arg-type]
    with pytest.raises(BatchInputError, match="file path"):
        write_export([], io.StringIO(), fmt="parquet")
    with pytest.raises(BatchInputError):
        export_record(skipped_pulled("s"))
    assert not (tmp_path / "x").exists()


@pytest.mark.anyio
async def test_export_by_id_verifies_from_the_stored_receipts(redis_url: str) -> None:
    await publish(redis_url, IDS)
    out = io.StringIO()
    async with aioredis.Redis.from_url(redis_url) as client:
        assert await export_rollouts(client, IDS, out) == 3
        # The default format is JSON Lines, one row per rollout (kills the mutant of the `fmt` default).
        assert sorted(json.loads(line)["rollout_id"] for line in out.getvalue().splitlines()) == sorted(IDS)
        with pytest.raises(RowUnavailableError, match="no stored receipt") as info:
            await export_rollouts(client, ["exp-0", "nosuch"], io.StringIO())
        assert isinstance(info.value, StagingError)
        with pytest.raises(BatchInputError):
            await export_rollouts(client, ["bad id"], io.StringIO())
    async with RolloutReader.from_url(redis_url) as reader:
        pulled = sorted(await pull_until(reader, len(IDS)), key=lambda p: p.rollout_id)
        await reader.ack([p.rollout_id for p in pulled])
    exported = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [{k: r[k] for k in _KEYS} for r in exported] == [_expected(p) for p in pulled]


def test_the_export_command_writes_files_and_refuses_bad_input(
    redis_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    anyio.run(lambda: publish(redis_url, IDS))
    path = tmp_path / "rows.parquet"
    assert main(["export", *IDS, "--format", "parquet", "--output", str(path), "--redis-url", redis_url]) == 0
    assert [r["rollout_id"] for r in read_export(path)] == IDS
    assert main(["export", "exp-0", "--redis-url", redis_url]) == 0
    (line,) = capsys.readouterr().out.splitlines()
    assert json.loads(line)["rollout_id"] == "exp-0"
    missing = tmp_path / "missing.jsonl"
    assert main(["export", "exp-0", "nosuch", "-o", str(missing), "--redis-url", redis_url]) == 1
    assert not missing.exists() and not list(tmp_path.glob("*.partial"))
    assert "no stored receipt" in capsys.readouterr().err
    assert main(["export", "a b", "--redis-url", redis_url]) == 2
    assert main(["export", "exp-0", "--format", "parquet", "--redis-url", redis_url]) == 2
