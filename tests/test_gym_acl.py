"""The NeMo Gym transport's ACL roles on a real server: gym_sink writes, gym_source freezes and drops, and
neither can do the other's job (nor any other role's); the read-only ops role sees the rollouts in
``inspect`` and ``stats``."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from sink.cli.common import EXIT_OK
from sink.cli.main import main
from sink.errors import CaptureWriteError
from sink.gym import RedisTokenSink, RedisTokenSource
from tests.helpers.acl import AclServer, start_acl_server
from tests.helpers.gym import make_entry


@pytest.fixture(scope="module")
def gym_acl_server(server_binary: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[AclServer]:
    server = start_acl_server(server_binary, tmp_path_factory.mktemp("gym-acl"))
    with server:
        yield server


@pytest.mark.anyio
async def test_each_gym_role_does_its_own_job_only(gym_acl_server: AclServer) -> None:
    sink = RedisTokenSink(redis_url=gym_acl_server.role_url("gym_sink"), namespace="stg")
    source = RedisTokenSource(redis_url=gym_acl_server.role_url("gym_source"), namespace="stg")
    sink_as_source = RedisTokenSource(redis_url=gym_acl_server.role_url("gym_sink"), namespace="stg")
    worker = RedisTokenSink(redis_url=gym_acl_server.role_url("worker"), namespace="stg")
    try:
        await sink.begin_call("acl-1", "c1")
        await sink.put(make_entry("acl-1", "c1"))
        await sink.mark_incomplete("acl-1", "c2")
        with pytest.raises(CaptureWriteError):
            await sink_as_source.freeze("acl-1")  # the sink role may not read entries back
        with pytest.raises(CaptureWriteError):
            await worker.put(make_entry("acl-1", "c3"))  # the staging worker has no gym keys
        snapshot = await source.freeze("acl-1")
        assert snapshot.incomplete and [e.model_call_id for e in snapshot.entries] == ["c1"]
        assert await source.drop("acl-1", snapshot_id=snapshot.snapshot_id, version=snapshot.version)
    finally:
        for transport in (sink, source, sink_as_source, worker):
            await transport.close()


async def _seed_ops_rollouts(gym_acl_server: AclServer) -> tuple[Any, Any]:
    """An open rollout (one intent without its entry), a frozen one and a dropped one; their snapshots."""
    sink = RedisTokenSink(redis_url=gym_acl_server.role_url("gym_sink"), namespace="stg")
    source = RedisTokenSource(redis_url=gym_acl_server.role_url("gym_source"), namespace="stg")
    try:
        for call_id in ("c1", "c2"):
            await sink.begin_call("ops-open", call_id)
        await sink.put(make_entry("ops-open", "c1"))  # c2 announced, never put
        await sink.put(make_entry("ops-frozen", "c1"))
        frozen = await source.freeze("ops-frozen")
        await sink.put(make_entry("ops-dropped", "c1"))
        dropped = await source.freeze("ops-dropped")
        assert await source.drop("ops-dropped", snapshot_id=dropped.snapshot_id, version=dropped.version)
    finally:
        await sink.close()
        await source.close()
    return frozen, dropped


def test_inspect_and_stats_show_gym_rollouts_to_the_ops_role(
    gym_acl_server: AclServer, capsys: pytest.CaptureFixture[str]
) -> None:
    ops_url = gym_acl_server.role_url("ops")
    frozen, dropped = anyio.run(_seed_ops_rollouts, gym_acl_server)
    assert main(["inspect", "ops-open", "--redis-url", ops_url, "--json"]) == EXIT_OK
    gym = json.loads(capsys.readouterr().out)["gym"]
    assert gym["frozen"] is False and gym["incomplete"] is False and gym["entries"] == 1
    assert list(gym["digests"]) == ["c1"] and gym["intents_without_entry"] == ["c2"]
    assert main(["inspect", "ops-frozen", "--redis-url", ops_url, "--json"]) == EXIT_OK
    gym = json.loads(capsys.readouterr().out)["gym"]
    assert gym["frozen"] is True and gym["snapshot_id"] == frozen.snapshot_id and gym["version"] == frozen.version
    assert main(["inspect", "ops-dropped", "--redis-url", ops_url]) == EXIT_OK
    assert f"dropped (snapshot {dropped.snapshot_id}:{dropped.version})" in capsys.readouterr().out
    assert main(["stats", "--redis-url", ops_url, "--json"]) == EXIT_OK
    totals = json.loads(capsys.readouterr().out)["gym_rollouts"]
    assert totals == {"rollouts": 2, "frozen": 1, "incomplete": 0, "entries": 2}
    assert main(["stats", "--redis-url", ops_url]) == EXIT_OK
    assert "2 held (1 frozen, 0 incomplete), 2 entries" in capsys.readouterr().out
