"""The staleness rule on a rollout pulled from a real server: the bound is the *oldest* generating call's version,
a lag equal to ``max_weight_lag`` is trainable, and no bound, no current version or a skipped rollout means no
staleness verdict at all."""

from __future__ import annotations

from dataclasses import replace

import pytest

from sink.contract.skip_codes import SkipCode
from sink.trainer.pulled import PulledRollout
from sink.trainer.reader.rollout_reader import RolloutReader
from sink.trainer.staleness import stale_skip
from tests.helpers.e2e import pull_until
from tests.helpers.trainer import publish


async def _pulled(redis_url: str) -> PulledRollout:
    await publish(redis_url, ["w-1"], calls=2)
    async with RolloutReader.from_url(redis_url) as reader:
        (pulled,) = await pull_until(reader, 1)
        await reader.ack([pulled.rollout_id])
    assert pulled.row is not None
    # Calls sampled on versions 7, 5 and 6: the oldest, 5, decides.
    return replace(pulled, row=replace(pulled.row, weight_versions=(7, 5, 6)))


@pytest.mark.anyio
async def test_the_oldest_version_decides_and_a_lag_equal_to_the_bound_is_trainable(redis_url: str) -> None:
    pulled = await _pulled(redis_url)
    assert stale_skip(pulled, 7, 2) is None  # 7 - 5 = 2: at the bound
    assert stale_skip(pulled, 5, 0) is None
    stale = stale_skip(pulled, 8, 2)
    assert stale is not None
    assert stale.row is None and stale.skip_code == SkipCode.STALE_WEIGHTS and stale.receipt == pulled.receipt
    assert stale.skip_reason == (
        "oldest generating call used weight version 5, 3 behind the trainer's 8 (max_weight_lag=2)"
    )


@pytest.mark.anyio
async def test_no_bound_no_current_version_or_a_skipped_rollout_gives_no_verdict(redis_url: str) -> None:
    pulled = await _pulled(redis_url)
    assert stale_skip(pulled, None, 2) is None  # the trainer never set its version
    assert stale_skip(pulled, 100, None) is None  # no max_weight_lag
    skipped = replace(pulled, row=None, skip_code="missing_record", skip_reason="gone")
    assert stale_skip(skipped, 100, 0) is None  # keeps its own skip code
