"""Only a POST to a captured route is a captured call: a rollout's GET to ``/v1/chat/completions`` (the OpenAI list
of stored completions) is forwarded to the engine and answered by it, under either failure policy, and never admits,
poisons or counts a call of the rollout (real uvicorn servers)."""

from __future__ import annotations

import httpx
import pytest

from tests.helpers.proxy import RecordingEngine, manifest, proxy_before


@pytest.mark.parametrize("fail_closed", [True, False], ids=["fail-closed", "fail-open"])
def test_a_rollout_get_to_a_captured_route_is_forwarded_uncounted(redis_url: str, fail_closed: bool) -> None:
    engine = RecordingEngine()
    rollout_id = f"get-{int(fail_closed)}"
    with proxy_before(engine, redis_url, fail_closed=fail_closed, prefix_mode="verify") as (url, proxy):
        answer = httpx.get(f"{url}/r/{rollout_id}/v1/chat/completions", timeout=20)
    # The simulated engine serves no such GET: its own 404 comes back, untouched.
    assert answer.status_code == 404
    assert answer.json()["error"] == {
        "message": "no route GET /v1/chat/completions",
        "type": "NotFoundError",
        "param": None,
        "code": 404,
    }
    assert [(scope["method"], scope["path"]) for scope in engine.scopes] == [("GET", "/v1/chat/completions")]
    shown = manifest(redis_url, rollout_id)
    assert (shown.records, shown.failures) == ([], [])
    assert proxy.metrics.counts == {"captured": 0, "uncaptured": 0, "capture_failed": 0, "capture_error": 0}
