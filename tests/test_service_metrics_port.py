"""`staging-sink assembler|trainer --metrics-port`: each service serves its own counters, and they move."""

from __future__ import annotations

import signal
import urllib.request

import anyio
import pytest
import redis.asyncio as aioredis

from sink.rollout.done_event import finished
from tests.helpers.commands import staging_sink
from tests.helpers.processes import wait_for

pytestmark = pytest.mark.redis


def _scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as response:
        body: bytes = response.read()
    return body.decode()


def test_the_assembler_serves_its_receipt_counter(redis_url: str) -> None:
    namespace = "svcport"
    command = ("assembler", "--redis-url", redis_url, "--namespace", namespace, "--metrics-port", "0")
    with staging_sink(*command) as cmd:
        line = cmd.wait_for(r"assembler metrics at http://")
        url = next(word for word in line.split() if word.startswith("http://"))
        assert f'staging_sink_stages_total{{namespace="{namespace}",result="ok"}} 0.0' in _scrape(url)

        async def announce() -> None:
            async with aioredis.Redis.from_url(redis_url) as client:
                await finished(client, "r1", reward=1.0, namespace=namespace)

        anyio.run(announce)
        published = "staging_sink_receipts_published_total"
        bodies = [""]

        def counted() -> bool:
            bodies.append(_scrape(url))
            return f"{published}{{namespace=" in bodies[-1]

        wait_for(counted, lambda: f"no {published} series: {bodies[-1]}", cmd.process)
        body = bodies[-1]
        assert f'{published}{{namespace="{namespace}",shard=' in body and body.split(published)[-1].split()[1] == "1.0"
        cmd.process.send_signal(signal.SIGTERM)
        assert cmd.wait(timeout_s=30) == 0, cmd.lines("stderr")
