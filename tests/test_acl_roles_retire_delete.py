"""Retire and delete run under the generated ACL roles, all-or-nothing per id
(real Valkey 8 / Redis 7.0 servers loading the file ``staging-sink acl`` renders).

``retire`` is the gate's and the trainer's (the reader's ``ack``); ``delete`` is the trainer's
(``staging-sink delete`` removes every key of the rollout). A role the table does not grant it to is
refused, and a refused operation changes nothing.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import anyio
import pytest
import redis

from sink.errors import StagingConnectionError
from sink.keys import fence_key, ledger_ids_key, ledger_stream
from sink.ledger.redis import RedisCaptureLedger
from sink.server import DurableServer
from sink.store.sink import AsyncRedisStagingSink
from sink_cli.main import main as cli_main
from tests.helpers.acl import AclServer, start_acl_server
from tests.helpers.e2e import stage_rollout
from tests.helpers.processes import wait_for
from tests.helpers.staging import make_record


@pytest.fixture(scope="module")
def roles(server_binary: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[AclServer]:
    server = start_acl_server(server_binary, tmp_path_factory.mktemp("roles"))
    with server:
        yield server


@pytest.fixture
def fresh_roles(roles: AclServer) -> AclServer:
    with roles.client() as admin:
        admin.flushall()
    return roles


def _keys(server: AclServer, rollout_id: str) -> list[bytes]:
    with server.client() as admin:
        return sorted(admin.scan_iter(match=f"stg:{{{rollout_id}}}:*"))


async def _stage_as_roles(server: AclServer, rollout_id: str) -> None:
    """The worker stages, the gate records the ledger rows: each as its own user."""
    async with (
        AsyncRedisStagingSink.from_url(server.role_url("worker")) as sink,
        RedisCaptureLedger.from_url(server.role_url("gate")) as ledger,
    ):
        await stage_rollout(sink, ledger, rollout_id, calls=2)


@pytest.mark.anyio
@pytest.mark.parametrize("role", ["gate", "trainer"])
async def test_retire_runs_as_the_gate_and_the_trainer(fresh_roles: AclServer, role: str) -> None:
    await _stage_as_roles(fresh_roles, "rt")
    async with RedisCaptureLedger.from_url(fresh_roles.role_url(role)) as ledger:
        assert (await ledger.retire(["rt", "never"])).removed == ["rt"]
        assert (await ledger.retire(["rt"])).absent == ["rt"]  # idempotent
    with fresh_roles.client() as admin:
        assert admin.exists(fence_key("stg", "rt"), fence_key("stg", "never")) == 2
        assert admin.exists(ledger_stream("stg", "rt"), ledger_ids_key("stg", "rt")) == 0


@pytest.mark.anyio
@pytest.mark.parametrize("role", ["assembler", "worker", "ops"])
async def test_retire_by_a_role_without_it_is_refused_and_changes_nothing(fresh_roles: AclServer, role: str) -> None:
    await _stage_as_roles(fresh_roles, "rt")
    before = _keys(fresh_roles, "rt")
    async with RedisCaptureLedger.from_url(fresh_roles.role_url(role)) as ledger:
        with pytest.raises(StagingConnectionError, match="(?i)noperm|no permissions|acl|can.t run"):
            await ledger.retire(["rt"])
    assert _keys(fresh_roles, "rt") == before


def test_the_trainer_runs_staging_sink_delete_and_the_id_is_reusable(
    fresh_roles: AclServer, capsys: pytest.CaptureFixture[str]
) -> None:
    anyio.run(_stage_as_roles, fresh_roles, "rd")
    assert len(_keys(fresh_roles, "rd")) == 5
    assert cli_main(["delete", "rd", "--json", "--redis-url", fresh_roles.role_url("trainer")]) == 0
    [report] = json.loads(capsys.readouterr().out)["rollouts"]
    assert report == {"rollout_id": "rd", "ledger_removed": True, "fence_removed": False, "other_removed": True}
    assert _keys(fresh_roles, "rd") == []

    async def restage() -> bool:
        async with AsyncRedisStagingSink.from_url(fresh_roles.role_url("worker")) as sink:
            return (await sink.stage(make_record("rd", "c0", n_tokens=11))).ok

    assert anyio.run(restage)


@pytest.mark.parametrize("role", ["gate", "assembler", "worker", "ops"])
def test_delete_by_a_role_without_it_is_refused_and_changes_nothing(
    fresh_roles: AclServer, role: str, capsys: pytest.CaptureFixture[str]
) -> None:
    anyio.run(_stage_as_roles, fresh_roles, "rd")
    before = _keys(fresh_roles, "rd")
    assert cli_main(["delete", "rd", "--redis-url", fresh_roles.role_url(role)]) != 0
    assert "Traceback" not in capsys.readouterr().err
    assert _keys(fresh_roles, "rd") == before


def test_the_replica_role_is_a_working_masteruser_and_nothing_else(
    fresh_roles: AclServer, server_binary: Path, tmp_path: Path
) -> None:
    """``masteruser replica``: the link replicates, and the same credentials run no command on data."""
    link = {"masteruser": "replica", "masterauth": fresh_roles.passwords["replica"]}
    with fresh_roles.client() as admin:
        admin.config_set("repl-diskless-sync-delay", 0)  # the first sync starts at once
    primary = (fresh_roles.host, fresh_roles.port)
    with DurableServer(
        binary=server_binary, data_dir=tmp_path / "replica", replica_of=primary, extra_config=link
    ) as replica:
        with fresh_roles.client() as admin:
            admin.set("stg:{rep}:receipt", b"copied")
        deadline = time.monotonic() + 15
        with replica.client() as reader:
            wait_for(lambda: reader.get("stg:{rep}:receipt") == b"copied", replica.log_tail, timeout_s=15)
            # After a full sync the replica rewrites its AOF and refuses to shut down until it is written.
            wait_for(
                lambda: (
                    not any(
                        int(reader.info("persistence")[k]) for k in ("aof_rewrite_in_progress", "aof_rewrite_scheduled")
                    )
                ),
                replica.log_tail,
                timeout_s=max(deadline - time.monotonic(), 0.0),
            )
    with fresh_roles.role_client("replica") as link_user:
        for command in (("GET", "stg:{rep}:receipt"), ("SET", "stg:{rep}:receipt", "x"), ("CONFIG", "GET", "*")):
            with pytest.raises(redis.exceptions.NoPermissionError):
                cast(Any, link_user).execute_command(*command)
