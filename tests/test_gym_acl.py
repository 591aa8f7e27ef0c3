"""The NeMo Gym transport's ACL roles on a real server: gym_sink writes, gym_source freezes and drops, and
neither can do the other's job (nor any other role's)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from sink.errors import CaptureWriteError
from sink.gym import RedisTokenSink, RedisTokenSource
from tests.helpers.acl import AclServer, start_acl_server
from tests.helpers.gym import make_entry

pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module")
def gym_acl_server(server_binary: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[AclServer]:
    server = start_acl_server(server_binary, tmp_path_factory.mktemp("gym-acl"))
    with server:
        yield server


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
