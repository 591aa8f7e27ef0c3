"""Weight versions: the engine's span labels mapped to the record's integer version (oldest span wins), and the
trainer's published version (one Redis key per namespace) read by proxies and workers with bounded staleness."""

from __future__ import annotations

import pytest
import redis.asyncio as aioredis
from hypothesis import given
from hypothesis import strategies as st

from sink.keys import weight_version_key
from sink.trainer.reader import RolloutReader
from sink.trainer.weights import WeightVersionKeyError, read_published_weight_version
from worker.weight_version import PublishedWeightVersion, WeightLabelRule, WeightVersionError, version_of_spans

pytestmark = pytest.mark.anyio


def test_labels_map_by_the_documented_rule() -> None:
    assert WeightLabelRule().version_of("7") == 7
    assert WeightLabelRule(default_version=3).version_of("default") == 3
    with pytest.raises(WeightVersionError, match="configure the version of 'default'"):
        WeightLabelRule().version_of("default")
    for label in ("v2", "-1", "1.5", "", "٣", None, 4):
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
        with pytest.raises(ValueError, match="non-negative"):
            await reader.publish_weight_version(-1)
        assert await read_published_weight_version(client, "stg") == 3


async def test_a_garbled_published_version_is_refused(redis_url: str) -> None:
    async with aioredis.from_url(redis_url) as client:
        await client.set(weight_version_key("stg"), "seven")
        with pytest.raises(WeightVersionKeyError, match="seven"):
            await read_published_weight_version(client, "stg")


def test_the_weights_command_publishes_and_shows(redis_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    from sink.cli.main import main

    assert main(["weights", "show", "--redis-url", redis_url]) == 1
    assert "no weight version published" in capsys.readouterr().out
    assert main(["weights", "set", "7", "--redis-url", redis_url]) == 0
    assert "weight version 7" in capsys.readouterr().out
    assert main(["weights", "show", "--redis-url", redis_url, "--namespace", "other"]) == 1
    capsys.readouterr()
    assert main(["weights", "show", "--redis-url", redis_url]) == 0
    assert "weight version 7" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["weights", "set", "-1", "--redis-url", redis_url])
