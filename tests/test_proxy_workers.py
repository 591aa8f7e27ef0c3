"""``staging-sink proxy --workers N`` as real processes: every scrape of any worker sees every worker's counts
(prometheus-client multiprocess mode), the stage series are served, and the workers log with the parent's
``-v`` / ``--log-format``."""

from __future__ import annotations

import contextlib
import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from tests.helpers.proxy import close_clients, manifest, run_agent

ROOT = Path(__file__).resolve().parents[1]
TEXT_LOG = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}\+00:00 (INFO|WARNING|ERROR) [\w.]+: ")


@pytest.fixture(autouse=True)
def _clients() -> Iterator[None]:
    yield
    close_clients()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@contextlib.contextmanager
def _service(*args: str, health: str) -> Iterator[list[str]]:
    """Run ``staging-sink ARGS`` until the block ends (SIGTERM); yields its stderr lines as they arrive."""
    process = subprocess.Popen(
        [sys.executable, "-m", "sink", *args], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    lines: list[str] = []
    stream = process.stderr
    assert stream is not None
    reader = threading.Thread(target=lambda: lines.extend(line.rstrip("\n") for line in stream), daemon=True)
    reader.start()
    try:
        _wait(lambda: _healthy(health), f"{args[0]} did not come up: {lines}", process)
        yield lines
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)
        reader.join(timeout=10)
        stream.close()


def _healthy(url: str) -> bool:
    with contextlib.suppress(httpx.HTTPError):
        return httpx.get(url, timeout=1).status_code == 200
    return False


def _wait(condition: Callable[[], bool], message: str, process: subprocess.Popen[str] | None = None) -> None:
    deadline = time.monotonic() + 60
    while not condition():
        assert process is None or process.poll() is None, message
        assert time.monotonic() < deadline, message
        time.sleep(0.1)


def _value(body: str, series: str) -> float:
    match = re.search(rf"^{re.escape(series)} (\S+)$", body, re.MULTILINE)
    assert match, f"{series} not in the scrape:\n{body}"
    return float(match.group(1))


@pytest.mark.slow
def test_every_scrape_of_a_four_worker_proxy_sees_every_call(redis_url: str) -> None:
    engine_port, proxy_port = _free_port(), _free_port()
    engine = f"http://127.0.0.1:{engine_port}"
    base = f"http://127.0.0.1:{proxy_port}"
    rollouts, turns = 3, 4
    with (
        _service("engine", "--port", str(engine_port), health=f"{engine}/health"),
        _service(
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
        assert _value(body, "staging_proxy_upstream_seconds_count") == calls
        assert _value(body, 'staging_sink_stages_total{namespace="stg",result="ok"}') == calls
        assert _value(body, 'staging_sink_stage_latency_seconds_count{namespace="stg"}') == calls
        assert _value(body, 'staging_sink_staged_bytes_total{namespace="stg"}') > 0
        assert "_created" not in body


@pytest.mark.slow
@pytest.mark.parametrize("log_format", ["json", "text"])
def test_proxy_workers_log_with_the_parents_options(redis_url: str, log_format: str) -> None:
    engine_port, proxy_port = _free_port(), _free_port()
    engine = f"http://127.0.0.1:{engine_port}"
    base = f"http://127.0.0.1:{proxy_port}"
    with (
        _service("engine", "--port", str(engine_port), health=f"{engine}/health"),
        _service(
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
        ) as lines,
    ):
        # Each worker logs one INFO line when it builds its app: wait for both.
        _wait(lambda: sum("proxy worker " in line for line in lines) >= 2, f"workers did not log: {lines}")
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
