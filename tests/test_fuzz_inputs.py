"""Bad-input suite (hypothesis): decoders, wire models and the sink meet garbage.

- ``decode_record`` (and ``decode_packed_record``, which must agree) on random bytes, mutated and
  truncated valid blobs, and msgpack of random structures: only :class:`CodecError`, never another
  exception, never a record that does not verify.
- ``model_validate`` of the wire models on random JSON-like dicts: only ``pydantic.ValidationError``
  (and ``TypeError`` for ``StagedCallRecord``'s extras, as contract §2 documents).
- ``stage()`` of records built with ``model_construct`` and garbage fields: ``ok=False`` or
  ``TypeError``, never another exception, never a hang, and never a stored record that does not verify.
"""

from __future__ import annotations

import argparse
import functools
from contextlib import redirect_stderr, redirect_stdout
from datetime import timedelta
from io import StringIO
from typing import Any, Literal

import anyio
import msgpack
import pytest
import redis
from anyio.from_thread import start_blocking_portal
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, ValidationError

from sink.contract.codec import decode_packed_record, decode_record, encode_record
from sink.contract.records import (
    CallRecord,
    CaptureAdmission,
    CommitCoords,
    RolloutReceipt,
    StagedCallRecord,
    StageResult,
)
from sink.errors import CodecError
from sink.store.sink import AsyncRedisStagingSink
from sink.store.source import AsyncRedisStagingSource
from sink_cli import dispatch as cli
from sink_cli.main import main as cli_main
from tests.helpers.processes import free_port
from tests.helpers.reliability import audit_keyspace, record_measurement
from tests.helpers.staging import make_chain, make_record

EXAMPLES = 250
# derandomize: the same examples on every run, so a CI failure reproduces and the table's counts are stable.
PURE = settings(
    max_examples=EXAMPLES,
    deadline=timedelta(seconds=2),
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
SERVER = settings(max_examples=200, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
STAGE_BOUND_S = 5.0

_ROOT, _CHILD = make_chain("fz", 2, n_tokens=16)
_EXTRAS = make_record("fz", "x", extras={"k": [1, 2.5, "s", None, {"n": True}]})
_BLOBS = [encode_record(record) for record in (_ROOT, _CHILD, _EXTRAS)]

_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=24),
    st.sampled_from(["", "0" * 64, "f" * 64, "text", "token_in", "r1", "r1/c1", "a b", "é"]),
)
_json = st.recursive(
    _scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
_msgpack_ints = st.integers(min_value=-(2**63), max_value=2**64 - 1)
_msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | _msgpack_ints
    | st.floats(allow_nan=True)
    | st.text(max_size=24)
    | st.binary(max_size=24)
    | st.sampled_from(["0" * 64, "text", "token_in", "fz"]),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8) | _msgpack_ints, inner, max_size=4),
    max_leaves=12,
)
_garbage = _json | st.binary(max_size=16) | st.lists(st.integers(min_value=-(2**65), max_value=2**65), max_size=20)


def _decode_or_codec_error(blob: bytes) -> None:
    try:
        snapshot = decode_record(blob)
    except CodecError:
        # The packed decode reaches the same verdict.
        with pytest.raises(CodecError):
            decode_packed_record(blob)
        return
    # Anything that decodes was fully verified: its digest is the recomputed one.
    assert snapshot.digest == snapshot.recompute_digest()
    assert decode_packed_record(blob).to_snapshot() == snapshot


# --- decode_record ------------------------------------------------------------------------------------


@PURE
@given(st.binary(max_size=512))
def test_decode_random_bytes_raises_only_codec_error(blob: bytes) -> None:
    _decode_or_codec_error(blob)


@PURE
@given(st.sampled_from(_BLOBS), st.data())
def test_decode_mutated_blobs_raises_only_codec_error(blob: bytes, data: st.DataObject) -> None:
    mutated = bytearray(blob)
    for _ in range(data.draw(st.integers(1, 4))):
        position = data.draw(st.integers(0, len(mutated) - 1))
        action = data.draw(st.sampled_from(["flip", "set", "insert", "delete"]))
        if action == "flip":
            mutated[position] ^= 1 << data.draw(st.integers(0, 7))
        elif action == "set":
            mutated[position] = data.draw(st.integers(0, 255))
        elif action == "insert":
            mutated[position:position] = data.draw(st.binary(min_size=1, max_size=8))
        elif len(mutated) > 1:
            del mutated[position]
    _decode_or_codec_error(bytes(mutated))


@PURE
@given(st.sampled_from(_BLOBS), st.data())
def test_decode_truncated_blobs_always_raises_codec_error(blob: bytes, data: st.DataObject) -> None:
    cut = data.draw(st.integers(0, len(blob) - 1))
    with pytest.raises(CodecError):
        decode_record(blob[:cut])


@PURE
@given(_msgpack_values)
def test_decode_msgpack_of_random_structures_raises_only_codec_error(value: Any) -> None:
    _decode_or_codec_error(msgpack.packb(value, use_bin_type=True))


@PURE
@given(st.sampled_from(_BLOBS), st.data())
def test_decode_valid_layout_with_a_garbage_field_raises_only_codec_error(blob: bytes, data: st.DataObject) -> None:
    fields = msgpack.unpackb(blob, raw=False)
    name = data.draw(st.sampled_from(sorted(fields)))
    replacement = data.draw(_msgpack_values)
    assume(replacement != fields[name])
    fields[name] = replacement
    _decode_or_codec_error(msgpack.packb(fields, use_bin_type=True))


# --- wire models ----------------------------------------------------------------------------------------


def _call_row() -> dict[str, Any]:
    return CallRecord(
        model_call_id=_ROOT.model_call_id,
        prev_len=0,
        delta_len=_ROOT.delta_len,
        cum_len=_ROOT.cum_len,
        weight_version=0,
        digest=_ROOT.digest,
        extras_digest=_ROOT.extras_digest,
        staging_key=_ROOT.staging_key,
        mode="text",
        chain_hash=_ROOT.chain_hash,
        cumulative_hash=_ROOT.cumulative_hash,
        response_id="resp",
    ).model_dump()


_VALID: dict[type[BaseModel], dict[str, Any]] = {
    StagedCallRecord: _CHILD.model_dump(),
    CaptureAdmission: {"rollout_id": "fz", "model_call_id": "c9", "mode": "text"},
    CommitCoords: {
        "rollout_id": "fz",
        "model_call_id": _ROOT.model_call_id,
        "prev_len": 0,
        "delta_len": _ROOT.delta_len,
        "cum_len": _ROOT.cum_len,
        "weight_version": 0,
        "digest": _ROOT.digest,
        "extras_digest": _ROOT.extras_digest,
        "staging_key": _ROOT.staging_key,
        "chain_hash": _ROOT.chain_hash,
        "cumulative_hash": _ROOT.cumulative_hash,
    },
    RolloutReceipt: {
        "rollout_id": "fz",
        "terminal_model_call_id": _ROOT.model_call_id,
        "manifest": [_call_row()],
        "terminal_selection": "declared",
    },
}
# Contract §2: a TypeError raised inside a validator (the extras encoder) propagates unchanged.
_DOCUMENTED: dict[type[BaseModel], tuple[type[Exception], ...]] = {
    StagedCallRecord: (ValidationError, TypeError),
    CaptureAdmission: (ValidationError,),
    CommitCoords: (ValidationError,),
    RolloutReceipt: (ValidationError,),
}


@pytest.mark.parametrize("model", list(_VALID), ids=lambda m: m.__name__)
def test_valid_bases_validate(model: type[BaseModel]) -> None:
    assert model.model_validate(_VALID[model]).model_dump() == model.model_validate(_VALID[model]).model_dump()


@pytest.mark.parametrize("model", list(_VALID), ids=lambda m: m.__name__)
def test_model_validate_random_dicts_raises_only_documented_errors(model: type[BaseModel]) -> None:
    names = sorted(model.model_fields)

    @PURE
    @given(
        st.one_of(
            st.dictionaries(st.sampled_from(names) | st.text(max_size=8), _json, max_size=len(names) + 2),
            st.builds(
                lambda replaced, value: {**_VALID[model], replaced: value},
                st.sampled_from(names),
                _garbage,
            ),
            _json,
        )
    )
    def check(payload: Any) -> None:
        try:
            model.model_validate(payload)
        except _DOCUMENTED[model]:
            pass  # the documented, typed rejection

    check()


# --- the sink -------------------------------------------------------------------------------------------


async def _bounded_stage(sink: AsyncRedisStagingSink, record: StagedCallRecord) -> StageResult:
    with anyio.fail_after(STAGE_BOUND_S):
        return await sink.stage(record)


def test_staging_constructed_garbage_returns_a_result_or_type_error_and_refusals_write_nothing(
    redis_url: str,
) -> None:
    """Every garbage record: a ``StageResult`` or ``TypeError`` in bounded time; ``ok=False`` writes nothing.

    Every ``ok=True`` garbage record must verify when fetched (``written_unverifiable`` stays 0).
    """
    base = _CHILD.model_dump()
    names = sorted(base)
    outcomes = {"ok": 0, "refused": 0, "type_error": 0, "written_unverifiable": 0}
    with (
        redis.Redis.from_url(redis_url) as client,
        start_blocking_portal(backend="asyncio") as portal,
        portal.wrap_async_context_manager(AsyncRedisStagingSink.from_url(redis_url)) as sink,
        portal.wrap_async_context_manager(AsyncRedisStagingSource.from_url(redis_url)) as source,
    ):

        @SERVER
        @given(st.dictionaries(st.sampled_from(names), _garbage, min_size=1, max_size=4))
        def check(changes: dict[str, Any]) -> None:
            client.flushall()
            record = StagedCallRecord.model_construct(**{**base, **changes})
            try:
                result = portal.call(_bounded_stage, sink, record)
            except TypeError:
                outcomes["type_error"] += 1
                assert client.dbsize() == 0
                return
            assert isinstance(result, StageResult)
            if not result.ok:
                outcomes["refused"] += 1
                assert result.error, "a refusal must say why"
                assert client.dbsize() == 0, f"refused ({result.error}) but wrote {client.keys()}"
                return
            outcomes["ok"] += 1
            assert result.staging_key is not None
            audit_keyspace([client]).assert_consistent()  # the record and its calls entry, together
            try:
                portal.call(source.fetch, [result.staging_key])
            except CodecError:
                outcomes["written_unverifiable"] += 1

        check()
    assert outcomes["refused"] > 0
    assert outcomes["written_unverifiable"] == 0
    examples = sum(outcomes.values()) - outcomes["written_unverifiable"]
    record_measurement("fuzz_stage_model_construct", examples=examples, **outcomes)


_UNVERIFIABLE_CHANGES: list[dict[str, Any]] = [
    {"delta_len": b""},
    {"weight_version": -1},
    {"chain_hash": b""},
    {"digest": "0" * 64},
    {"prev_len": "7"},
]


def test_staging_constructed_garbage_never_stores_an_unverifiable_record(redis_url: str) -> None:
    base = _CHILD.model_dump()
    stored_unverifiable: list[str] = []

    async def run() -> None:
        async with (
            AsyncRedisStagingSink.from_url(redis_url) as sink,
            AsyncRedisStagingSource.from_url(redis_url) as source,
        ):
            for index, changes in enumerate(_UNVERIFIABLE_CHANGES):
                record = StagedCallRecord.model_construct(**{**base, **changes, "model_call_id": f"g{index}"})
                result = await _bounded_stage(sink, record)
                if result.ok and result.staging_key is not None:
                    try:
                        await source.fetch([result.staging_key])
                    except CodecError:
                        stored_unverifiable.append(repr(changes))

    anyio.run(run)
    assert stored_unverifiable == []


def test_a_record_without_ids_is_refused_not_raised(redis_url: str) -> None:
    async def run() -> StageResult:
        async with AsyncRedisStagingSink.from_url(redis_url) as sink:
            return await _bounded_stage(
                sink, StagedCallRecord.model_construct(**{**_CHILD.model_dump(), "rollout_id": None})
            )

    result = anyio.run(run)
    assert not result.ok and result.error


def test_a_garbage_record_does_not_fail_valid_records_staged_with_it(redis_url: str) -> None:
    """One caller's garbage must not take down the innocent records that share its batch."""
    valid = [make_record("fz-batch", f"c{i}") for i in range(40)]
    garbage = StagedCallRecord.model_construct(**{**_CHILD.model_dump(), "digest": None})

    async def run() -> list[StageResult]:
        async with AsyncRedisStagingSink.from_url(redis_url, writer_connections=1) as sink:
            results: list[StageResult] = []

            async def stage(record: StagedCallRecord) -> None:
                results.append(await _bounded_stage(sink, record))

            async with anyio.create_task_group() as group:
                group.start_soon(stage, garbage)
                for record in valid:
                    group.start_soon(stage, record)
            return results

    results = anyio.run(run)
    assert sum(not r.ok for r in results) <= 1, [r.error for r in results if not r.ok][:3]


# --- the command line -----------------------------------------------------------------------------------

_COMMANDS = ["demo", "server", "stats", "assembler", "trainer", "metrics", "inspect", "verify", "tail"]
_COMMANDS += ["retire", "delete", "acl", "bench", "--bogus", ""]
_OPTIONS = ["--redis-url", "--namespace", "--cluster", "--json", "--count", "--timeout-s", "--port", "--watch"]
_OPTIONS += ["--max-rollouts", "--batch", "--shards", "--rollouts", "--seed", "--server-version", "-v", "--", "-x"]
_TOKENS = st.sampled_from(_OPTIONS) | st.text(max_size=12) | st.integers(-5, 10**6).map(str) | st.just("1e309")
_ARGV = st.tuples(st.sampled_from(_COMMANDS), st.lists(_TOKENS, max_size=6)).map(lambda t: [t[0], *t[1]])


@functools.cache
def _parser() -> argparse.ArgumentParser:
    """The command line's parser, built once for every example (parsing leaves an argparse parser as it was)."""
    return cli.build_parser(env={})


@PURE
@given(_ARGV)
def test_cli_argument_parsing_exits_cleanly(argv: list[str]) -> None:
    """Parsing alone (no command runs): a namespace, or a clean exit 0 (help) / 2 (usage)."""
    with redirect_stdout(StringIO()), redirect_stderr(StringIO()):
        try:
            _parser().parse_args(argv)
        except SystemExit as exc:
            assert exc.code in (0, 2), exc.code


def test_cli_commands_on_bad_input_exit_with_documented_codes(monkeypatch: pytest.MonkeyPatch) -> None:
    """``main`` on safe commands with garbage ids and URLs: exit 0-3, never a traceback or a hang.

    URLs are an unreachable loopback port or strings that are not URLs, so nothing leaves the machine.
    """
    for name in (cli.ENV_REDIS_URL, cli.ENV_GATE_REDIS_URL, cli.ENV_NAMESPACE):
        monkeypatch.delenv(name, raising=False)
    dead = f"redis://127.0.0.1:{free_port()}"
    urls = st.sampled_from([dead, f"{dead}/0", "redis://127.0.0.1:99999", "redis://127.0.0.1:0", "redis://", "nope"])
    surrogates: tuple[Literal["Cs"]] = ("Cs",)
    urls |= st.text(alphabet=st.characters(blacklist_characters=":/@\\", blacklist_categories=surrogates), max_size=10)
    codes: dict[int, int] = {}
    _valid_ids = st.sampled_from(["r1", "r-2", "a.b_c", "X9"])

    @settings(max_examples=120, deadline=timedelta(seconds=10), derandomize=True)
    @given(
        st.sampled_from(["inspect", "verify", "retire", "delete"]),
        st.lists(
            _valid_ids | _valid_ids | st.text(max_size=10) | st.sampled_from(["a b", "x/y", "é", "-"]),
            min_size=1,
            max_size=3,
        ),
        st.none() | urls | st.just(dead),
        st.booleans(),
    )
    def check(command: str, ids: list[str], url: str | None, as_json: bool) -> None:
        ids = ids[:1] if command in ("inspect", "verify") else ids  # these take exactly one rollout
        argv = [command, *(["--redis-url", url] if url is not None else []), *(["--json"] if as_json else [])]
        with redirect_stdout(StringIO()), redirect_stderr(StringIO()):
            try:
                code = cli_main([*argv, "--", *ids])
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else -1
        assert code in (0, 1, 2, 3), (argv, ids, code)
        codes[code] = codes.get(code, 0) + 1

    check()
    assert codes.get(2, 0) > 0 and codes.get(3, 0) > 0, codes  # both the usage and the unreachable paths ran
    record_measurement("fuzz_cli", examples=sum(codes.values()), **{f"exit_{k}": v for k, v in sorted(codes.items())})
