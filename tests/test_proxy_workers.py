"""``staging-sink proxy --workers N`` as real processes: every scrape of any worker sees every worker's counts
(prometheus-client multiprocess mode), the stage series are served, and the workers log with the parent's
``-v`` / ``--log-format``."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.helpers.processes import free_port, service
from tests.helpers.proxy import close_clients, manifest, run_agent

ROOT = Path(__file__).resolve().parents[1]
TEXT_LOG = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}\+00:00 (INFO|WARNING|ERROR) [\w.]+: ")


@pytest.fixture(autouse=True)
def _clients() -> Iterator[None]:
    yield
    close_clients()


def _value(body: str, series: str) -> float:
    match = re.search(rf"^{re.escape(series)} (\S+)$", body, re.MULTILINE)
    assert match, f"{series} not in the scrape:\n{body}"
    return float(match.group(1))


@pytest.mark.slow
def test_every_scrape_of_a_four_worker_proxy_sees_every_call(redis_url: str) -> None:
    engine_port, proxy_port = free_port(), free_port()
    engine = f"http://127.0.0.1:{engine_port}"
    base = f"http://127.0.0.1:{proxy_port}"
    rollouts, turns = 3, 4
    with (
        service("engine", "--port", str(engine_port), health=f"{engine}/health"),
        service(
            "proxy",
            "--upstream",
            engine,
            "--redis-url",
            redis_url,
            "--port",
            str(proxy_port),
            "--workers",
            "4",
            health=f"{base}/health",
        ),
    ):
        for index in range(rollouts):
            run_agent([base], f"workers-{index}", turns=turns)
        calls = rollouts * turns
        staged = sum(len(manifest(redis_url, f"workers-{i}").records) for i in range(rollouts))
        assert staged == calls
        scrapes = [httpx.get(f"{base}/staging-sink/metrics", timeout=10).text for _ in range(12)]
    for body in scrapes:  # whichever worker answered
        assert _value(body, 'staging_proxy_calls_total{outcome="captured"}') == calls
        assert _value(body, 'staging_proxy_calls_total{outcome="capture_failed"}') == 0
        assert _value(body, 'staging_proxy_upstream_seconds_count{route="/v1/chat/completions"}') == calls
        assert _value(body, 'staging_sink_stages_total{namespace="stg",result="ok"}') == calls
        assert _value(body, 'staging_sink_stage_latency_seconds_count{namespace="stg"}') == calls
        assert _value(body, 'staging_sink_staged_bytes_total{namespace="stg"}') > 0
        assert "_created" not in body


@pytest.mark.slow
@pytest.mark.parametrize("log_format", ["json", "text"])
def test_proxy_workers_log_with_the_parents_options(redis_url: str, log_format: str) -> None:
    engine_port, proxy_port = free_port(), free_port()
    engine = f"http://127.0.0.1:{engine_port}"
    base = f"http://127.0.0.1:{proxy_port}"
    with (
        service("engine", "--port", str(engine_port), health=f"{engine}/health"),
        service(
            "proxy",
            "--upstream",
            engine,
            "--redis-url",
            redis_url,
            "--port",
            str(proxy_port),
            "--workers",
            "2",
            "-v",
            "--log-format",
            log_format,
            health=f"{base}/health",
        ) as output,
    ):
        # Each worker logs one INFO line when it builds its app: wait for both.
        output.wait_for("proxy worker ", count=2)
    lines = output.lines()
    logged = [line for line in lines if not line.startswith("capture proxy on ")]
    assert logged, lines
    if log_format == "json":
        records = [json.loads(line) for line in logged]
        assert all({"time", "level", "logger", "message"} <= set(r) for r in records)
        ready = [r for r in records if r["logger"] == "worker.proxy" and r["message"].startswith("proxy worker ")]
        assert len({r["message"].split()[2] for r in ready}) == 2 and all(r["level"] == "INFO" for r in ready)
    else:
        assert all(TEXT_LOG.match(line) for line in logged if not line.startswith("Traceback")), logged
        ready = [line for line in logged if " INFO worker.proxy: proxy worker " in line]
        assert len(ready) == 2, logged
