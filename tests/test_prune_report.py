"""What an operator reads from ``staging-sink prune``: the ``--json`` object names every count (and a
``--dry-run`` reports exactly what the pass then does, changing nothing), ages are counted to the real clock
when no ``now_s`` is given, and a user that may not delete gets a refusal naming the namespace, with nothing
changed."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest
import redis.asyncio as aioredis

from sink.errors import StagingRefusedError
from sink.keys import calls_stream, dead_letter_stream, done_stream, fence_key
from sink.ops.prune import prune_namespace
from sink.settings import PruneSettings
from sink.store.connection import Topology
from sink_cli.common import EXIT_OK
from sink_cli.main import main
from tests.helpers.acl import AclServer, start_acl_server
from tests.helpers.e2e import stage_rollouts
from tests.helpers.prune import key_state, newest_entry_ms, next_millisecond


async def _setup_a_bit_of_everything(url: str, abandon_after_s: float, idle_s: float) -> None:
    """A stale rollout, a consumed one without a TTL, three dead letters, an idle consumer name; returns once
    the rollout is *abandon_after_s* old and the consumer *idle_s* idle by the real clock."""
    await stage_rollouts(url, ["stale"], calls=1)
    async with aioredis.Redis.from_url(url) as client:
        await client.set(fence_key("stg", "retired"), "1")
        for index in range(3):
            await client.xadd(dead_letter_stream("stg", "done-0"), {"n": str(index)})
        await client.xgroup_create(done_stream("stg", 0), "assemblers", id="0", mkstream=True)
        await client.xgroup_createconsumer(done_stream("stg", 0), "assemblers", "gone")
        line_ms = max(await newest_entry_ms(client, calls_stream("stg", "stale")), int(time.time() * 1000))
        while time.time() * 1000 <= line_ms + max(abandon_after_s, idle_s) * 1000 + 1:
            await next_millisecond()


def test_the_json_report_names_every_count_and_the_dry_run_matches_the_pass(
    redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    anyio.run(_setup_a_bit_of_everything, redis_url, 0.05, 0.02)

    async def keys() -> dict[str, tuple[str, int, int]]:
        async with aioredis.Redis.from_url(redis_url) as client:
            return await key_state(client, "stg:*")

    options = ["--abandon-after-s", "0.05", "--consumer-idle-max-s", "0.02", "--dead-letter-max-entries", "1"]
    expected = {
        "rollouts_seen": 2,
        "retained": ["retired"],
        "abandoned": ["stale"],
        "dead_letters_trimmed": {dead_letter_stream("stg", "done-0"): 2},
        "consumers_removed": [f"{done_stream('stg', 0)} assemblers gone"],
        "skipped": {},
    }
    before = anyio.run(keys)
    assert main(["prune", "--redis-url", redis_url, "--dry-run", "--json", *options]) == EXIT_OK
    assert json.loads(capsys.readouterr().out) == {"dry_run": True, **expected}
    assert anyio.run(keys) == before  # the dry run changed nothing
    assert main(["prune", "--redis-url", redis_url, "--json", *options]) == EXIT_OK
    assert json.loads(capsys.readouterr().out) == {"dry_run": False, **expected}
    assert main(["prune", "--redis-url", redis_url, *options]) == EXIT_OK
    assert "2 rollout(s) seen" in capsys.readouterr().out  # both now fenced, with a TTL: nothing left to do


@pytest.fixture(scope="module")
def acl_server(server_binary: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[AclServer]:
    server = start_acl_server(server_binary, tmp_path_factory.mktemp("acl-prune-refused"))
    with server:
        yield server


@pytest.mark.anyio
async def test_a_user_that_may_not_delete_is_refused_with_the_namespace_named_and_nothing_changes(
    acl_server: AclServer,
) -> None:
    await stage_rollouts(acl_server.role_url("admin"), ["stale"], calls=1)
    async with aioredis.Redis.from_url(acl_server.role_url("admin")) as admin:
        await admin.set(fence_key("stg", "retired"), "1")
        before = await key_state(admin, "stg:*")
        settings = PruneSettings(abandon_after_s=600, retention_s=60)
        async with aioredis.Redis.from_url(acl_server.role_url("ops")) as ops:
            topology = Topology.borrow(ops, settings)
            now_s = await next_millisecond() + 3600
            assert (await prune_namespace(topology, settings, dry_run=True, now_s=now_s)).abandoned == ["stale"]
            with pytest.raises(StagingRefusedError, match="prune namespace 'stg'") as refused:
                await prune_namespace(topology, settings, now_s=now_s)
            await topology.aclose()
        assert refused.value.code == "NOPERM"
        assert await key_state(admin, "stg:*") == before
