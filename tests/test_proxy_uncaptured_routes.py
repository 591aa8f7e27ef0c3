"""Under ``--fail-closed`` a rollout-tagged POST to a route the proxy does not capture (the engine's token-in/token-out
routes, audio, Anthropic messages...) is refused, never forwarded uncaptured; fail-open forwards it (and counts it
uncaptured). Requests without a rollout id, GETs and the non-generating ``/tokenize`` / ``/detokenize`` pass."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from sink_tools.simulated.http_app import EngineApp
from sink_tools.simulated.options import EngineOptions
from tests.helpers.logging_hop import running_hop
from tests.helpers.proxy import proxy_config
from tests.helpers.tls import tls
from worker.proxy.app import ProxyApp
from worker.proxy.serve import running_server

GENERATE = {"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 2, "logprobs": 0}, "model": "simulated"}
UNCAPTURED = [
    "/inference/v1/generate",
    "/v1/completions/render",
    "/v1/chat/completions/render",
    "/v1/responses/render",
    "/v1/audio/transcriptions",
    "/v1/messages",
    "/v1/%63ompletions/render",  # spelled with a percent-escape: routed on the decoded path
]


@pytest.fixture
def engine_url() -> Iterator[str]:
    with running_server(EngineApp(EngineOptions(seed=3, scale_out=True))) as url:
        yield url


@pytest.mark.parametrize("path", UNCAPTURED)
def test_fail_closed_refuses_rollout_calls_to_uncaptured_routes(redis_url: str, engine_url: str, path: str) -> None:
    with running_hop(engine_url) as (hop, hop_url):
        app = ProxyApp(proxy_config(redis_url, hop_url, fail_closed=True, prefix_mode="verify"))
        with running_server(app) as url:
            tagged = httpx.post(f"{url}/r/gen-1{path}", json=GENERATE, timeout=20, verify=tls())
            header = httpx.post(
                f"{url}{path}", json=GENERATE, headers={"X-Staging-Rollout-Id": "gen-2"}, timeout=20, verify=tls()
            )
            seen = [exchange.path for exchange in hop.exchanges]
    for answer in (tagged, header):
        assert answer.status_code == 503, answer.text
        assert answer.json()["error"]["type"] == "UncapturedRoute"
    assert seen == []  # nothing reached the engine
    assert app.metrics.counts["capture_failed"] == 2


def test_fail_closed_still_forwards_what_generates_nothing(redis_url: str, engine_url: str) -> None:
    app = ProxyApp(proxy_config(redis_url, engine_url, fail_closed=True, prefix_mode="verify"))
    with running_server(app) as url:
        tokenize = httpx.post(f"{url}/r/gen-3/tokenize", json={"prompt": "ab"}, timeout=20)
        models = httpx.get(f"{url}/r/gen-3/v1/models", timeout=20)
        untagged = httpx.post(f"{url}/inference/v1/generate", json=GENERATE, timeout=20)
    assert tokenize.status_code == 200 and tokenize.json()["count"] == 2
    assert models.status_code == 200
    assert untagged.status_code == 200 and untagged.json()["choices"][0]["token_ids"]


def test_fail_open_forwards_and_counts_uncaptured(redis_url: str, engine_url: str) -> None:
    app = ProxyApp(proxy_config(redis_url, engine_url, prefix_mode="verify"))
    with running_server(app) as url:
        answer = httpx.post(f"{url}/r/gen-4/inference/v1/generate", json=GENERATE, timeout=20)
    assert answer.status_code == 200 and answer.json()["choices"][0]["token_ids"]
    assert app.metrics.counts["uncaptured"] == 1
