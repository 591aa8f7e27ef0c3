"""Requests the capture proxy refuses itself answer one exact OpenAI error object, and nothing reaches the engine
nor the rollout's ledger (real uvicorn servers, the official openai client's error shape): an unknown
``X-Staging-Chains`` value (400 ``InvalidChainPolicy``), a path that becomes a captured route only after a further
decoding (400 ``InvalidPath``) and a body over ``max_request_bytes`` (413 ``RequestTooLarge``, fail-open too)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.helpers.proxy import SYSTEM, RecordingEngine, client_for, close_clients, manifest, proxy_before

BODY: dict[str, Any] = {"model": "simulated", "messages": [SYSTEM, {"role": "user", "content": "go"}], "max_tokens": 4}


@pytest.fixture(autouse=True)
def _clients() -> Iterator[None]:
    yield
    close_clients()


def _error(status: int, message: str, kind: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": None, "code": status}}


def _refused(redis_url: str, rollout_id: str, engine: RecordingEngine) -> None:
    """Nothing of the refused request reached the engine or the ledger."""
    assert engine.paths == []
    shown = manifest(redis_url, rollout_id)
    assert (shown.records, shown.failures) == ([], [])


def test_an_unknown_chain_policy_header_is_one_precise_openai_error(redis_url: str) -> None:
    engine = RecordingEngine()
    with proxy_before(engine, redis_url) as (url, _):
        client = client_for(url, "chains-1")
        with pytest.raises(openai.BadRequestError) as raised:
            client.chat.completions.create(**BODY, extra_headers={"X-Staging-Chains": "everything"})
    assert raised.value.status_code == 400
    message = "X-Staging-Chains must be single, roots or branches, not 'everything'"
    assert raised.value.response.json() == _error(400, message, "InvalidChainPolicy")
    _refused(redis_url, "chains-1", engine)


def test_a_path_captured_only_after_a_second_decoding_is_one_precise_openai_error(redis_url: str) -> None:
    engine = RecordingEngine()
    with proxy_before(engine, redis_url, fail_closed=True) as (url, _):
        answer = httpx.post(f"{url}/r/twice-1/v1/%252E/chat/completions", json=BODY, timeout=20)
    assert answer.status_code == 400
    message = "path '/r/twice-1/v1/%2E/chat/completions' is ambiguously encoded"
    assert answer.json() == _error(400, message, "InvalidPath")
    _refused(redis_url, "twice-1", engine)


def test_a_body_over_the_request_limit_is_refused_with_413_even_fail_open(redis_url: str) -> None:
    engine = RecordingEngine()
    long_body = {**BODY, "messages": [SYSTEM, {"role": "user", "content": "x" * 2000}]}
    with proxy_before(engine, redis_url, max_request_bytes=1024) as (url, proxy):
        client = client_for(url, "large-1")
        fits = client.chat.completions.create(**BODY)
        with pytest.raises(openai.APIStatusError) as raised:
            client.chat.completions.create(**long_body)
    assert fits.choices[0].message.content  # a body within the limit is captured as usual
    assert raised.value.status_code == 413
    assert raised.value.response.json() == _error(413, "request body larger than 1024 bytes", "RequestTooLarge")
    assert engine.paths == ["/v1/chat/completions"]  # the first call only
    shown = manifest(redis_url, "large-1")
    assert (len(shown.records), shown.failures) == (1, [])
    assert proxy.metrics.counts == {"captured": 1, "uncaptured": 0, "capture_failed": 0, "capture_error": 0}


def test_fail_closed_refuses_a_body_that_is_not_a_json_object_with_one_precise_openai_error(redis_url: str) -> None:
    engine = RecordingEngine()
    with proxy_before(engine, redis_url, fail_closed=True) as (url, proxy):
        answer = httpx.post(f"{url}/r/array-1/v1/chat/completions", json=[BODY], timeout=20)
    assert answer.status_code == 400
    message = "the proxy cannot parse this body (not a JSON object); --fail-closed does not forward it"
    assert answer.json() == _error(400, message, "InvalidRequest")
    _refused(redis_url, "array-1", engine)
    assert proxy.metrics.counts["capture_failed"] == 1
