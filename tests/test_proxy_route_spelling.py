"""Each spelling of a request path has one outcome through the capture proxy (real uvicorn servers, requests sent
byte for byte with ``http.client``): a spelling that normalizes to a captured route is captured and the engine
sees the canonical route; one that becomes a captured route only after a further decoding is refused with 400
and never reaches the engine; other paths pass through as normalized, escapes and all."""

from __future__ import annotations

import http.client
import json
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest

from tests.helpers.proxy import SYSTEM, RecordingEngine, manifest, proxy_before

BODY: dict[str, Any] = {
    "model": "simulated",
    "messages": [SYSTEM, {"role": "user", "content": "go"}],
    "max_tokens": 4,
    "min_tokens": 2,
}


def _raw_post(base: str, path: str, headers: dict[str, str]) -> tuple[int, dict[str, Any]]:
    """POST *path* byte for byte (no client-side normalization, unlike httpx and the openai client)."""
    parts = urlsplit(base)
    connection = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port, timeout=20)
    try:
        connection.request("POST", path, json.dumps(BODY), {"content-type": "application/json", **headers})
        response = connection.getresponse()
        data = response.read()
    finally:
        connection.close()
    decoded = json.loads(data) if data.startswith(b"{") else {}
    return response.status, decoded if isinstance(decoded, dict) else {}


CAPTURED = [
    "/r/{id}/v1/chat/completions",
    "/r/{id}/v1/./chat/completions",
    "/r/{id}/v1/../v1/chat/completions",
    "/r/{id}//v1/chat/completions",
    "/r/{id}/v1/chat/completions/",
    "/r/{id}/v1/%63hat/completions",
    "/r/{id}/v1/%2E/chat/completions",
    "/r/{id}/../../r/{id}/v1/chat/completions",
    "//v1/chat/completions",
    "/v1/./chat/completions",
]
REFUSED = [
    "/r/{id}/v1/%252E/chat/completions",
    "/r/{id}/v1/%25252E%25252E/v1/chat/completions",
    "/v1/%252E/chat/completions",
]


@pytest.mark.parametrize("fail_closed", [True, False], ids=["fail-closed", "fail-open"])
def test_each_spelling_has_one_outcome(redis_url: str, fail_closed: bool) -> None:
    engine = RecordingEngine()
    with proxy_before(engine, redis_url, fail_closed=fail_closed) as (url, _):
        for index, spelling in enumerate(CAPTURED):
            rollout_id = f"spelt-{int(fail_closed)}-{index}"
            headers = {} if "{id}" in spelling else {"X-Staging-Rollout-Id": rollout_id}
            engine.paths.clear()
            status, answer = _raw_post(url, spelling.format(id=rollout_id), headers)
            assert status == 200, (spelling, status, answer)
            assert [r.response_id for r in manifest(redis_url, rollout_id).records] == [answer["id"]], spelling
            assert engine.paths == ["/v1/chat/completions"], spelling
        for index, spelling in enumerate(REFUSED):
            rollout_id = f"refused-{int(fail_closed)}-{index}"
            headers = {} if "{id}" in spelling else {"X-Staging-Rollout-Id": rollout_id}
            engine.paths.clear()
            status, answer = _raw_post(url, spelling.format(id=rollout_id), headers)
            assert (status, answer["error"]["type"]) == (400, "InvalidPath"), (spelling, answer)
            assert engine.paths == [], spelling
        # Escapes on a route that is not captured pass through, normalized, however deep; a rollout-tagged
        # one is refused under fail-closed (an uncaptured route never serves a rollout) and never forwarded.
        for path in ("/r/spelt-x/v1/files/a%25b", "/r/spelt-x/v1/files/%2525252525252561", "/v1/./files//x/"):
            engine.paths.clear()
            status, answer = _raw_post(url, path, {})
            if fail_closed and path.startswith("/r/"):
                assert (status, answer["error"]["type"]) == (503, "UncapturedRoute"), (path, answer)
                assert engine.paths == [], path
                continue
            assert (status, answer["error"]["type"]) == (404, "NotFoundError"), (path, answer)
            assert len(engine.paths) == 1 and engine.paths[0].startswith("/v1/files/"), (path, engine.paths)


def test_a_fail_closed_refusal_is_one_precise_openai_error(redis_url: str) -> None:
    engine = RecordingEngine()
    with proxy_before(engine, redis_url, fail_closed=True) as (url, _):
        answer = httpx.post(f"{url}/r/refuse-1/v1/chat/completions", json={**BODY, "n": 2}, timeout=20)
    assert answer.status_code == 503
    assert answer.json() == {
        "error": {
            "message": "capture failed (capture needs n == 1); --fail-closed refuses",
            "type": "CaptureFailed",
            "param": None,
            "code": 503,
        }
    }
    assert engine.paths == []  # never forwarded


def test_an_invalid_rollout_id_is_one_precise_openai_error(redis_url: str) -> None:
    engine = RecordingEngine()
    with proxy_before(engine, redis_url, fail_closed=True) as (url, _):
        status, answer = _raw_post(url, "/r/bad%20id/v1/chat/completions", {})
    assert status == 400
    error = answer["error"]
    assert (error["type"], error["code"], error["param"]) == ("InvalidRolloutId", 400, None)
    assert "bad id" in error["message"]
    assert engine.paths == []  # never forwarded
