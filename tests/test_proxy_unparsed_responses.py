"""Fail-open, a rollout's ``/v1/responses`` request the proxy cannot parse (``NaN``, which Python's JSON parser in
the engine reads) is served the engine's answer without the token fields of its output items, which the client
cannot have asked for, and the rollout records the capture failure (real uvicorn servers)."""

from __future__ import annotations

from typing import Any

import httpx

from sink.contract.records import WORKER_CAPTURE_FAILED_REASON
from tests.helpers.proxy import fixed_upstream, manifest, proxy_config
from worker.proxy.app import ProxyApp
from worker.proxy.serve import running_server

MESSAGE: dict[str, Any] = {
    "id": "msg-1",
    "type": "message",
    "role": "assistant",
    "status": "completed",
    "content": [{"type": "output_text", "text": "fine", "annotations": []}],
}
RESPONSE: dict[str, Any] = {
    "id": "resp-fixed",
    "object": "response",
    "created_at": 0,
    "model": "simulated",
    "status": "completed",
    "output": [{**MESSAGE, "prompt_token_ids": [1, 2], "generation_token_ids": [3], "generation_log_probs": [-0.5]}],
}


def test_an_unparsed_responses_call_is_served_without_the_token_fields_of_its_output(redis_url: str) -> None:
    with running_server(fixed_upstream(RESPONSE)) as engine:
        proxy = ProxyApp(proxy_config(redis_url, engine, prefix_mode="verify"))
        with running_server(proxy) as url:
            answer = httpx.post(
                f"{url}/r/unparsed-responses-1/v1/responses",
                content=b'{"model": "simulated", "input": "go", "temperature": NaN}',
                headers={"content-type": "application/json"},
                timeout=20,
            )
    assert answer.status_code == 200
    assert answer.json() == {**RESPONSE, "output": [MESSAGE]}
    shown = manifest(redis_url, "unparsed-responses-1")
    assert [f.reason for f in shown.failures] == [WORKER_CAPTURE_FAILED_REASON] and not shown.records
