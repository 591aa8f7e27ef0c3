"""`staging-sink assembler|trainer --metrics-port`: each service serves its own counters, and they move."""

from __future__ import annotations

import signal
import subprocess
import sys
import urllib.request

import anyio
import pytest
import redis.asyncio as aioredis

from sink.rollout.done_event import finished

pytestmark = pytest.mark.redis


def _url_from(process: subprocess.Popen[str], prefix: str) -> str:
    assert process.stderr is not None
    for _ in range(20):
        line = process.stderr.readline()
        if prefix in line:
            return next(word for word in line.split() if word.startswith("http://"))
    raise AssertionError(f"no {prefix!r} line")


def _scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as response:
        body: bytes = response.read()
    return body.decode()


def test_the_assembler_serves_its_receipt_counter(redis_url: str) -> None:
    namespace = "svcport"
    command = [sys.executable, "-m", "sink", "assembler", "--redis-url", redis_url, "--namespace", namespace]
    with subprocess.Popen([*command, "--metrics-port", "0"], stderr=subprocess.PIPE, text=True) as process:
        try:
            url = _url_from(process, "assembler metrics at")
            assert f'staging_sink_stages_total{{namespace="{namespace}",result="ok"}} 0.0' in _scrape(url)

            async def announce() -> None:
                async with aioredis.Redis.from_url(redis_url) as client:
                    await finished(client, "r1", reward=1.0, namespace=namespace)

            anyio.run(announce)
            published = "staging_sink_receipts_published_total"
            for _ in range(100):
                body = _scrape(url)
                if published in body:
                    break
                anyio.run(anyio.sleep, 0.1)
            assert (
                f'{published}{{namespace="{namespace}",shard=' in body and body.split(published)[-1].split()[1] == "1.0"
            )
        finally:
            process.send_signal(signal.SIGTERM)
            assert process.wait(timeout=30) == 0
