"""Weight versions: the engine's span labels mapped to the record's integer version (oldest span wins), and the
trainer's published version (one Redis key per namespace) read by proxies and workers with bounded staleness."""

from __future__ import annotations

import json

import pytest
import redis
import redis.asyncio as aioredis
from hypothesis import given
from hypothesis import strategies as st

from sink.keys import weight_version_key
from sink.trainer.reader.rollout_reader import RolloutReader
from sink.trainer.weights import (
    InvalidWeightVersionError,
    WeightVersionKeyError,
    publish_weight_version,
    read_published_weight_version,
)
from worker.weight_version import PublishedWeightVersion, WeightLabelRule, WeightVersionError, version_of_spans

pytestmark = pytest.mark.anyio

U64_LIMIT = 1 << 64  # the record's weight_version is a u64 (contract §4.3, sink.contract.record_schema)


def test_labels_map_by_the_documented_rule() -> None:
    assert WeightLabelRule().version_of("7") == 7
    assert WeightLabelRule().version_of(str(U64_LIMIT - 1)) == U64_LIMIT - 1
    assert WeightLabelRule(default_version=3).version_of("default") == 3
    with pytest.raises(WeightVersionError, match="configure the version of 'default'"):
        WeightLabelRule().version_of("default")
    for label in ("v2", "-1", "1.5", "", "٣", None, 4, str(U64_LIMIT), "9" * 5000):
        with pytest.raises(WeightVersionError, match="not a non-negative integer"):
            WeightLabelRule(default_version=0).version_of(label)


@given(st.lists(st.tuples(st.integers(0, 50), st.integers(1, 5)), min_size=1, max_size=6))
def test_a_call_across_updates_gets_its_oldest_version(parts: list[tuple[int, int]]) -> None:
    spans, start = [], 0
    for version, length in parts:
        spans.append({"version": str(version), "start": start, "end": start + length})
        start += length
    assert version_of_spans(spans, start, WeightLabelRule()) == min(version for version, _ in parts)


def test_spans_that_do_not_tile_the_output_are_refused() -> None:
    rule = WeightLabelRule(default_version=0)
    assert version_of_spans([{"version": "default", "start": 0, "end": 4}], 4, rule) == 0
    for spans, length in (
        ([], 0),
        ([{"version": "1", "start": 1, "end": 4}], 4),
        ([{"version": "1", "start": 0, "end": 2}, {"version": "2", "start": 3, "end": 4}], 4),
        ([{"version": "1", "start": 0, "end": 3}], 4),
        (["1"], 1),
    ):
        with pytest.raises(WeightVersionError):
            version_of_spans(spans, length, rule)


async def test_published_version_is_read_with_bounded_staleness(redis_url: str) -> None:
    now = [100.0]
    async with RolloutReader.from_url(redis_url) as reader, aioredis.from_url(redis_url) as client:
        published = PublishedWeightVersion(client, "stg", max_staleness_s=5.0, clock=lambda: now[0])
        assert await published.current() is None  # nothing published yet
        await reader.publish_weight_version(2)
        assert reader.weight_version == 2
        assert await published.current() is None  # read 0 s ago: within the bound, not re-read
        now[0] += 5.0
        assert await published.current() == 2  # older than the bound: re-read
        await reader.publish_weight_version(3)
        now[0] += 4.9
        assert await published.current() == 2
        now[0] += 0.1
        assert await published.current() == 3
        assert await read_published_weight_version(client, "other") is None  # one key per namespace
        with pytest.raises(ValueError, match="not an integer"):
            await reader.publish_weight_version(-1)
        assert await read_published_weight_version(client, "stg") == 3


async def test_a_garbled_published_version_is_refused(redis_url: str) -> None:
    async with aioredis.from_url(redis_url) as client:
        await client.set(weight_version_key("stg"), "seven")
        with pytest.raises(WeightVersionKeyError, match="seven"):
            await read_published_weight_version(client, "stg")


def test_the_weights_command_publishes_and_shows(redis_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    from sink_cli.main import main

    assert main(["weights", "show", "--redis-url", redis_url]) == 1
    assert "no weight version published" in capsys.readouterr().out
    assert main(["weights", "set", "7", "--redis-url", redis_url]) == 0
    assert "weight version 7" in capsys.readouterr().out
    assert main(["weights", "show", "--redis-url", redis_url, "--namespace", "other"]) == 1
    capsys.readouterr()
    assert main(["weights", "show", "--redis-url", redis_url]) == 0
    assert "weight version 7" in capsys.readouterr().out



def test_weights_set_refuses_what_the_record_cannot_carry(redis_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    from sink_cli.common import EXIT_USAGE
    from sink_cli.main import main

    assert main(["weights", "set", str(U64_LIMIT - 1), "--redis-url", redis_url]) == 0  # the largest u64
    assert f"weight version {U64_LIMIT - 1}" in capsys.readouterr().out
    for text in (str(U64_LIMIT), str(U64_LIMIT * 10), "-1"):
        assert main(["weights", "set", text, "--redis-url", redis_url]) == EXIT_USAGE
        captured = capsys.readouterr()
        assert captured.out == ""
        refusal = f"weight version {text} is not an integer in [0, 2**64) (the record's u64 weight_version)"
        assert captured.err.splitlines() == [f"staging-sink: error: {refusal}"]
    with redis.Redis.from_url(redis_url) as client:
        assert client.get(weight_version_key("stg")) == str(U64_LIMIT - 1).encode()  # nothing written


async def test_publishing_refuses_what_the_record_cannot_carry(redis_url: str) -> None:
    async with RolloutReader.from_url(redis_url) as reader, aioredis.from_url(redis_url) as client:
        await reader.publish_weight_version(3)
        for version in (U64_LIMIT, -1, True, 2.0):
            with pytest.raises(InvalidWeightVersionError, match=r"not an integer in \[0, 2\*\*64\)"):
                await reader.publish_weight_version(version)  # type: ignore[arg-type]
            with pytest.raises(InvalidWeightVersionError):
                await publish_weight_version(client, "stg", version)  # type: ignore[arg-type]
        assert reader.weight_version == 3 and await read_published_weight_version(client, "stg") == 3
        await reader.publish_weight_version(U64_LIMIT - 1)
        assert await read_published_weight_version(client, "stg") == U64_LIMIT - 1


async def test_a_published_key_beyond_the_record_is_refused_when_read(redis_url: str) -> None:
    async with aioredis.from_url(redis_url) as client:
        await client.set(weight_version_key("stg"), str(U64_LIMIT))  # written by hand (redis-cli SET)
        with pytest.raises(WeightVersionKeyError) as raised:
            await read_published_weight_version(client, "stg")
    assert str(raised.value) == (
        f"stg:weight_version holds '{U64_LIMIT}', not an integer in [0, 2**64) (the record's u64 weight_version)"
    )


def _state(published: int | None, deleted: int | None, unusable: str | None = None) -> dict[str, object]:
    return {"published": published, "deleted": deleted, "unusable": unusable}


def test_stats_check_fails_while_a_published_version_is_deleted(
    redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from sink_cli.common import EXIT_FAILURE
    from sink_cli.main import main

    stats = ["stats", "--check", "--redis-url", redis_url]
    assert main([*stats, "--json"]) == 0  # never published: the documented fallback, not a problem
    assert json.loads(capsys.readouterr().out)["weight_version"] == _state(None, None)
    assert main(["weights", "set", "5", "--redis-url", redis_url]) == 0
    capsys.readouterr()
    assert main([*stats, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["weight_version"] == _state(5, None)
    with redis.Redis.from_url(redis_url) as client:
        client.delete(weight_version_key("stg"))  # by hand (redis-cli DEL)
    problem = (
        "weight version 5 was published and stg:weight_version is gone: proxies with --weight-source published "
        "stamp their --weight-version (publish again: staging-sink weights set N)"
    )
    assert main([*stats, "--json"]) == EXIT_FAILURE
    snapshot = json.loads(capsys.readouterr().out)
    assert snapshot["weight_version"] == _state(None, 5)
    assert snapshot["check"]["problems"] == [problem]
    assert main(stats) == EXIT_FAILURE
    assert f"  - {problem}" in capsys.readouterr().out
    assert main(["weights", "show", "--redis-url", redis_url]) == EXIT_FAILURE
    assert "no weight version published in namespace 'stg' (5 was, and the key was deleted)" in (
        capsys.readouterr().out
    )
    assert main(["weights", "set", "6", "--redis-url", redis_url]) == 0
    capsys.readouterr()
    assert main(stats) == 0
    capsys.readouterr()
    with redis.Redis.from_url(redis_url) as client:
        client.set(weight_version_key("stg"), "seven")  # by hand: every proxy call would be refused
    assert main([*stats, "--json"]) == EXIT_FAILURE
    snapshot = json.loads(capsys.readouterr().out)
    unusable = "stg:weight_version holds 'seven', not an integer in [0, 2**64) (the record's u64 weight_version)"
    assert snapshot["weight_version"] == _state(None, None, unusable)
    assert snapshot["check"]["problems"] == [
        f"{unusable}: proxies with --weight-source published refuse every call (staging-sink weights set N)"
    ]
