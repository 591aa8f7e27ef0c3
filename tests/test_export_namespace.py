"""An export by rollout id reads the namespace it is given (sink.trainer.export.export_rollouts and
``staging-sink export --namespace``, against a real server): the receipts and the staged records both."""

from __future__ import annotations

import io
import json
from pathlib import Path

import anyio
import pytest
import redis.asyncio as aioredis

from sink.errors import RowUnavailableError
from sink.trainer.export import export_rollouts, read_export
from sink_cli.main import main
from tests.helpers.trainer import publish

NS = "exp-ns"
IDS = ["nsx-0", "nsx-1"]


@pytest.mark.anyio
async def test_export_by_id_reads_receipts_and_staged_records_of_its_namespace(redis_url: str) -> None:
    staged = await publish(redis_url, IDS, namespace=NS, calls=2)
    out = io.StringIO()
    async with aioredis.Redis.from_url(redis_url) as client:
        assert await export_rollouts(client, IDS, out, namespace=NS) == 2
        with pytest.raises(RowUnavailableError):
            await export_rollouts(client, IDS[:1], io.StringIO())  # nothing of them in the default namespace
    rows = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [(row["rollout_id"], row["token_ids"]) for row in rows] == [(i, staged[i].token_ids) for i in IDS]


def test_the_export_command_reads_the_namespace_option(redis_url: str, tmp_path: Path) -> None:
    staged = anyio.run(lambda: publish(redis_url, IDS, namespace=NS, calls=2))
    path = tmp_path / "rows.parquet"
    argv = ["export", *IDS, "--format", "parquet", "-o", str(path), "--namespace", NS, "--redis-url", redis_url]
    assert main(argv) == 0
    assert [(row["rollout_id"], row["logprobs"]) for row in read_export(path)] == [(i, staged[i].logprobs) for i in IDS]
