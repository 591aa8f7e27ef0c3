"""An export by rollout id that cannot be done (sink.trainer.export.export_rollouts, against a real server): the
typed error of each cause, naming the rollout, and nothing written."""

from __future__ import annotations

import io

import pytest
import redis.asyncio as aioredis

from sink.contract.skip_codes import SkipCode
from sink.errors import BatchInputError, CodecError, ReceiptVerificationError, RowUnavailableError
from sink.keys import DEFAULT_NAMESPACE, receipt_key, record_key
from sink.ledger.redis import RedisCaptureLedger
from sink.trainer.export import export_rollouts
from tests.helpers.trainer import publish


@pytest.mark.anyio
async def test_a_rollout_whose_capture_failed_is_refused_with_the_readers_skip_code_and_nothing_is_written(
    redis_url: str,
) -> None:
    async with RedisCaptureLedger.from_url(redis_url) as ledger:
        await ledger.record_failure("bad-0", "c9", "worker_capture_failed")
    await publish(redis_url, ["ok-0", "bad-0"], calls=2)  # bad-0's staged records are whole; its receipt is poisoned
    out = io.StringIO()
    async with aioredis.Redis.from_url(redis_url) as client:
        with pytest.raises(ReceiptVerificationError) as info:
            await export_rollouts(client, ["ok-0", "bad-0"], out)
    assert info.value.code == SkipCode.ROLLOUT_FAILED  # the code the reader skips it with
    assert "'bad-0'" in info.value.detail
    assert out.getvalue() == ""


@pytest.mark.anyio
async def test_a_staged_record_gone_is_row_unavailable_naming_the_record_and_nothing_is_written(
    redis_url: str,
) -> None:
    staged = await publish(redis_url, ["ok-0", "cut-0"], calls=3)
    gone = staged["cut-0"].staging_keys[1]
    out = io.StringIO()
    async with aioredis.Redis.from_url(redis_url) as client:
        assert await client.delete(record_key(DEFAULT_NAMESPACE, gone)) == 1
        with pytest.raises(RowUnavailableError) as info:
            await export_rollouts(client, ["ok-0", "cut-0"], out)
    assert "'cut-0'" in str(info.value) and gone in str(info.value)
    assert out.getvalue() == ""


@pytest.mark.anyio
async def test_a_corrupt_stored_receipt_is_a_codec_error_naming_the_rollout(redis_url: str) -> None:
    await publish(redis_url, ["ok-0", "torn-0"], calls=2)
    out = io.StringIO()
    async with aioredis.Redis.from_url(redis_url) as client:
        text = await client.get(receipt_key(DEFAULT_NAMESPACE, "torn-0"))
        assert isinstance(text, bytes)
        await client.set(receipt_key(DEFAULT_NAMESPACE, "torn-0"), text[: len(text) // 2])
        with pytest.raises(CodecError) as info:
            await export_rollouts(client, ["ok-0", "torn-0"], out)
    assert "'torn-0'" in str(info.value)
    assert out.getvalue() == ""


@pytest.mark.anyio
async def test_an_invalid_rollout_id_or_a_single_str_is_refused_naming_it(redis_url: str) -> None:
    async with aioredis.Redis.from_url(redis_url) as client:
        with pytest.raises(BatchInputError) as bad_id:
            await export_rollouts(client, ["ok-0", "bad id"], io.StringIO())
        with pytest.raises(BatchInputError) as single:
            await export_rollouts(client, "ok-0", io.StringIO())
    assert "'bad id'" in str(bad_id.value)
    assert "single str" in str(single.value)


@pytest.mark.anyio
async def test_a_corrupt_staged_record_is_a_codec_error_naming_the_rollout_and_nothing_is_written(
    redis_url: str,
) -> None:
    staged = await publish(redis_url, ["ok-0", "torn-rec-0"], calls=2)
    key = record_key(DEFAULT_NAMESPACE, staged["torn-rec-0"].staging_keys[1])
    out = io.StringIO()
    async with aioredis.Redis.from_url(redis_url) as client:
        blob = await client.get(key)
        assert isinstance(blob, bytes)
        await client.set(key, blob[: len(blob) // 2])
        with pytest.raises(CodecError) as info:
            await export_rollouts(client, ["ok-0", "torn-rec-0"], out)
    assert "'torn-rec-0'" in str(info.value) and "corrupt" in str(info.value)
    assert out.getvalue() == ""
