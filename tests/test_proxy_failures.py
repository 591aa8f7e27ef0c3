"""Capture-proxy failure policy: fail-open serves (INV-4) and writes a failure row; --fail-closed answers 503.
Redis unreachable, non-durable server, upstream errors and timeouts, client disconnects, oversized and malformed
upstream responses, each with its log line."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from sink.contract.records import WORKER_CAPTURE_FAILED_REASON, RolloutManifest
from sink.server import DurableServer
from sink_tools.simulated.http_app import EngineApp
from sink_tools.simulated.options import EngineOptions
from tests.helpers.processes import wait_for
from tests.helpers.proxy import SYSTEM, client_for, close_clients, fixed_upstream, manifest, proxy_config, unset
from worker.proxy.app import ProxyApp
from worker.proxy.serve import running_server

MESSAGES: list[Any] = [SYSTEM, {"role": "user", "content": "go"}]


@pytest.fixture(autouse=True)
def _clients() -> Iterator[None]:
    """Every openai client of the test is closed at its end."""
    yield
    close_clients()


@pytest.fixture
def engine_url() -> Iterator[str]:
    with running_server(EngineApp(EngineOptions(seed=11))) as url:
        yield url


def _chat(url: str, rollout_id: str, **options: Any) -> openai.types.chat.ChatCompletion:
    completion: openai.types.chat.ChatCompletion = client_for(url, rollout_id).chat.completions.create(
        model="simulated", messages=MESSAGES, max_tokens=8, **options
    )
    return completion


def _failures(redis_url: str, rollout_id: str) -> list[str]:
    return [failure.reason for failure in manifest(redis_url, rollout_id).failures]


MALFORMED = {
    "id": "chatcmpl-bad",
    "object": "chat.completion",
    "created": 0,
    "model": "simulated",
    "prompt_token_ids": [1, True],
    "choices": [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "fine"},
            "logprobs": {"content": [{"token": "token_id:5", "logprob": -0.5}]},
            "token_ids": [5],
            "finish_reason": "stop",
        }
    ],
}


@pytest.mark.parametrize("fail_closed", [False, True], ids=["fail-open", "fail-closed"])
def test_malformed_payload(redis_url: str, fail_closed: bool, caplog: pytest.LogCaptureFixture) -> None:
    with running_server(fixed_upstream(MALFORMED)) as upstream:
        proxy = ProxyApp(proxy_config(redis_url, upstream, fail_closed=fail_closed))
        with running_server(proxy) as url:
            if fail_closed:
                with pytest.raises(openai.InternalServerError) as raised:
                    _chat(url, "bad-1")
                assert raised.value.status_code == 503
            else:
                completion = _chat(url, "bad-1")
                assert completion.choices[0].message.content == "fine"
                assert unset(completion.model_extra, "prompt_token_ids")
    assert _failures(redis_url, "bad-1") == [WORKER_CAPTURE_FAILED_REASON]
    assert proxy.metrics.counts["capture_failed"] == 1
    assert "malformed engine payload" in caplog.text and "prompt_token_ids" in caplog.text


@pytest.mark.parametrize("fail_closed", [False, True], ids=["fail-open", "fail-closed"])
def test_upstream_error_passes_through_with_its_status(
    redis_url: str, engine_url: str, fail_closed: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """An engine 4xx generated nothing: its answer passes through (in both policies) and no failure row is written,
    so a retry continues the rollout."""
    with running_server(ProxyApp(proxy_config(redis_url, engine_url, fail_closed=fail_closed))) as url:
        with pytest.raises(openai.BadRequestError) as raised:
            _chat(url, "err-1", extra_body={"min_tokens": 20})  # min_tokens > max_tokens: the engine answers 400
        assert raised.value.status_code == 400 and "min_tokens" in str(raised.value)
        assert httpx.get(f"{url}/health").status_code == 200
    assert _failures(redis_url, "err-1") == []
    assert "upstream answered 400 (nothing generated)" in caplog.text and "min_tokens <= max_tokens" in caplog.text


def test_upstream_timeout(redis_url: str, caplog: pytest.LogCaptureFixture) -> None:
    with running_server(EngineApp(EngineOptions(delay_s=0.8))) as upstream:
        app = ProxyApp(proxy_config(redis_url, upstream, upstream_timeout_s=0.2))
        with running_server(app) as url, pytest.raises(openai.APIStatusError) as raised:
            _chat(url, "slow-1")
        assert raised.value.status_code == 504
    assert _failures(redis_url, "slow-1") == [WORKER_CAPTURE_FAILED_REASON]
    assert "timed out" in caplog.text and "upstream answered 504" in caplog.text


def _settled(redis_url: str, rollout_id: str, timeout_s: float = 10.0) -> RolloutManifest:
    """*rollout_id*'s manifest once it shows a record or a failure (fails the test after *timeout_s*)."""
    shown: list[RolloutManifest] = []

    def settled() -> bool:
        shown[:] = [manifest(redis_url, rollout_id)]
        return bool(shown[0].records or shown[0].failures)

    wait_for(settled, f"{rollout_id} shows neither a record nor a failure after {timeout_s} s", timeout_s=timeout_s)
    return shown[0]


def test_client_disconnect_mid_call_never_half_writes(redis_url: str, caplog: pytest.LogCaptureFixture) -> None:
    with (
        running_server(EngineApp(EngineOptions(delay_s=0.6))) as upstream,
        running_server(ProxyApp(proxy_config(redis_url, upstream))) as url,
    ):
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(
                f"{url}/r/gone-1/v1/chat/completions",
                json={"model": "simulated", "messages": MESSAGES, "max_tokens": 4},
                timeout=0.2,
            )
        shown = _settled(redis_url, "gone-1")
        wait_for(lambda: "client disconnected mid-call" in caplog.text, "the proxy logged no disconnect", timeout_s=5)
    assert len(shown.records) + len(shown.failures) == 1  # committed, or recorded failed: never neither
    assert "client disconnected mid-call" in caplog.text


def test_oversized_response_is_served_uncaptured(
    redis_url: str, engine_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    with running_server(ProxyApp(proxy_config(redis_url, engine_url, max_response_bytes=300))) as url:
        completion = _chat(url, "big-1", extra_body={"min_tokens": 8})
        assert completion.choices[0].message.content
    assert _failures(redis_url, "big-1") == [WORKER_CAPTURE_FAILED_REASON]
    assert "exceeds max_response_bytes=300" in caplog.text


def test_non_durable_server_fails_capture_not_the_call(
    everysec_server: DurableServer, engine_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    url_redis = everysec_server.url
    with running_server(ProxyApp(proxy_config(url_redis, engine_url))) as url:
        assert _chat(url, "nd-1").choices[0].message.content is not None
    assert _failures(url_redis, "nd-1") == [WORKER_CAPTURE_FAILED_REASON]
    assert "appendfsync" in caplog.text


def test_redis_unreachable(fresh_server: DurableServer, engine_url: str, caplog: pytest.LogCaptureFixture) -> None:
    fields: dict[str, Any] = {"redis_timeout_s": 0.5}
    open_app = ProxyApp(proxy_config(fresh_server.url, engine_url, **fields))
    closed_app = ProxyApp(proxy_config(fresh_server.url, engine_url, fail_closed=True, **fields))
    with running_server(open_app) as open_url, running_server(closed_app) as closed_url:
        fresh_server.stop()
        assert _chat(open_url, "down-1").choices[0].message.content is not None
        with pytest.raises(openai.InternalServerError) as raised:
            _chat(closed_url, "down-1")
        assert raised.value.status_code == 503
    assert "capture admission failed (ledger unreachable?)" in caplog.text
    assert open_app.metrics.counts["capture_failed"] == closed_app.metrics.counts["capture_failed"] == 1


def test_rollout_ids_and_finished_are_checked(redis_url: str, engine_url: str) -> None:
    app: ProxyApp = ProxyApp(proxy_config(redis_url, engine_url))
    with running_server(app) as url:
        bad = httpx.post(f"{url}/r/bad%20id/v1/chat/completions", json={"messages": MESSAGES})
        assert bad.status_code == 400 and "Invalid rollout id" in bad.text
        header = httpx.post(
            f"{url}/v1/chat/completions",
            json={"model": "simulated", "messages": MESSAGES, "max_tokens": 4},
            headers={"X-Staging-Rollout-Id": "hdr-1"},
        )
        assert header.status_code == 200 and unset(header.json(), "prompt_token_ids")
        assert httpx.post(f"{url}/r/hdr-1/finished", json={"reward": "high"}).status_code == 422
        assert httpx.post(f"{url}/r/hdr-1/finished", json={"reward": 1.0, "extra": 1}).status_code == 422
        assert httpx.post(f"{url}/r/hdr-1/finished", json={"reward": None}).status_code == 200
        httpx.post(f"{url}/v1/completions", json={"model": "simulated", "prompt": "x", "max_tokens": 2})
        metrics = httpx.get(f"{url}/staging-sink/metrics").text
    assert len(manifest(redis_url, "hdr-1").records) == 1
    assert app.metrics.counts == {"captured": 1, "uncaptured": 1, "capture_failed": 0, "capture_error": 0}
    assert 'staging_proxy_calls_total{outcome="captured"} 1.0' in metrics


@pytest.mark.parametrize("fail_closed", [False, True], ids=["fail-open", "fail-closed"])
def test_requests_capture_cannot_take(redis_url: str, engine_url: str, fail_closed: bool) -> None:
    """n > 1 is out of capture's scope: forwarded uncaptured, or refused when fail-closed; bad JSON reaches the
    upstream, which answers it, and the rollout records a capture failure, or is refused by the proxy itself when
    fail-closed (never forwarded)."""
    app = ProxyApp(proxy_config(redis_url, engine_url, fail_closed=fail_closed))
    with running_server(app) as url:
        many = httpx.post(f"{url}/r/many-1/v1/chat/completions", json={"messages": MESSAGES, "n": 2})
        broken = httpx.post(f"{url}/r/many-1/v1/chat/completions", content=b"{not json")
    assert many.status_code == (503 if fail_closed else 400)  # the simulated engine serves n == 1 only
    assert broken.status_code == 400
    # Fail-open records the body it could not parse as a capture failure; fail-closed never forwarded it.
    shown = manifest(redis_url, "many-1")
    assert [f.reason for f in shown.failures] == ([] if fail_closed else [WORKER_CAPTURE_FAILED_REASON])
    assert not shown.records
    if fail_closed:
        assert app.metrics.counts["capture_failed"] == 2
    else:
        assert (app.metrics.counts["uncaptured"], app.metrics.counts["capture_failed"]) == (1, 1)
