"""The proxy's per-call timings: engine waits counted once when they overlap, and the opt-in Server-Timing header."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from sink_tools.bench.proxy import server_timing
from sink_tools.simulated.http_app import EngineApp
from sink_tools.simulated.options import EngineOptions
from tests.helpers.proxy import proxy_config
from worker.proxy.app import ProxyApp
from worker.proxy.call_timing import CallClock, call_clock, current_call_clock, engine_span, timing_headers
from worker.proxy.serve import running_server


def test_overlapping_engine_waits_count_once() -> None:
    clock = CallClock(started=0.0, engine_spans=[(1.0, 3.0), (2.0, 4.0), (6.0, 7.0), (6.5, 6.8)])
    assert clock.engine_s == pytest.approx(4.0)  # [1, 4] and [6, 7]
    assert CallClock(started=0.0).engine_s == 0.0


def test_spans_count_only_inside_a_clock() -> None:
    with engine_span() as outside:
        pass
    assert outside.seconds >= 0 and current_call_clock() is None and timing_headers() == []
    with call_clock() as clock:
        with engine_span() as span:
            pass
        assert clock.engine_spans == [(span.started, span.started + span.seconds)]
        [(name, value)] = timing_headers()
        assert name == b"server-timing"
        engine, capture, total = server_timing(value.decode())
        assert engine == pytest.approx(span.seconds, abs=1e-5) and capture == 0.0 and total >= engine
    assert current_call_clock() is None  # reset when the block ends


def test_a_header_without_its_figures_is_refused() -> None:
    with pytest.raises(ValueError, match="total"):
        server_timing("engine;dur=1.0, capture;dur=0.5")


@pytest.fixture
def engine_url() -> Iterator[str]:
    with running_server(EngineApp(EngineOptions(seed=3, scale_out=True))) as url:
        yield url


@pytest.mark.parametrize("mode", ["verify", "exact"])
def test_captured_calls_carry_server_timing_when_asked(redis_url: str, engine_url: str, mode: str) -> None:
    body = {"model": "simulated", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    config = proxy_config(redis_url, engine_url, prefix_mode=mode, server_timing=True, namespace=f"timing-{mode}")
    with running_server(ProxyApp(config)) as url:
        answer = httpx.post(f"{url}/r/timing-{mode}/v1/chat/completions", json=body, timeout=20)
        uncaptured = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=20)
    assert answer.status_code == 200 and uncaptured.status_code == 200
    engine, capture, total = server_timing(answer.headers["server-timing"])
    assert 0 < engine < total and 0 < capture < total
    assert "server-timing" not in uncaptured.headers  # only captured calls are timed
    with running_server(ProxyApp(proxy_config(redis_url, engine_url, namespace=f"plain-{mode}"))) as url:
        plain = httpx.post(f"{url}/r/plain-{mode}/v1/chat/completions", json=body, timeout=20)
    assert plain.status_code == 200 and "server-timing" not in plain.headers  # off by default
