"""What the agent receives, byte for byte, from the capture proxy (real uvicorn servers, a real HTTP client).

An answer from which nothing is stripped (the agent asked for every token field it holds, as an RL harness asks
for ``logprobs`` and ``return_token_ids``) is served as the engine's own bytes, not parsed and serialised again:
vLLM writes its JSON with Python's ``json`` (Starlette's ``JSONResponse``), whose spelling of a float such as
``-1.1920928955078125e-07`` differs from the proxy's serialiser. An answer the proxy strips is served as before.
The real-vLLM comparison is in ``test_proxy_verify_mode.py``.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import orjson
import pytest

from tests.helpers.proxy import fixed_upstream, manifest, proxy_config
from worker.proxy.app import ProxyApp
from worker.proxy.serve import running_server

ANSWER: dict[str, Any] = {
    "id": "chatcmpl-fixed",
    "object": "chat.completion",
    "created": 1765000000,
    "model": "simulated",
    "choices": [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "déjà", "refusal": None, "tool_calls": []},
            "logprobs": {
                "content": [
                    {"token": "dé", "logprob": -1.1920928955078125e-07, "bytes": [100, 195, 169], "top_logprobs": []},
                    {"token": "jà", "logprob": -2.5, "bytes": [106, 195, 160], "top_logprobs": []},
                ]
            },
            "finish_reason": "stop",
            "stop_reason": None,
            "token_ids": [5, 6],
        }
    ],
    "usage": {"prompt_tokens": 3, "total_tokens": 5, "completion_tokens": 2},
    "prompt_logprobs": None,
    "prompt_token_ids": [1, 2, 3],
}
VLLM_BYTES = json.dumps(ANSWER, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":")).encode()
"""The answer as vLLM's server writes it (Starlette's ``JSONResponse.render``)."""


def _ask(url: str, rollout_id: str, **token_fields: Any) -> httpx.Response:
    request = {"model": "simulated", "messages": [{"role": "user", "content": "go"}], **token_fields}
    return httpx.post(f"{url}/r/{rollout_id}/v1/chat/completions", json=request, timeout=20)


def test_the_serialisers_spell_the_answer_differently() -> None:
    """The premise: serialising the parsed answer again does not give vLLM's bytes (the same values)."""
    assert orjson.dumps(orjson.loads(VLLM_BYTES)) != VLLM_BYTES
    assert orjson.loads(orjson.dumps(orjson.loads(VLLM_BYTES))) == ANSWER


@pytest.mark.parametrize("stream", [False, None], ids=["stream-false", "stream-unset"])
def test_an_answer_with_every_token_field_asked_for_is_served_as_the_engines_bytes(
    redis_url: str, stream: bool | None
) -> None:
    options: dict[str, Any] = {"logprobs": True, "return_token_ids": True}
    if stream is not None:
        options["stream"] = stream
    with running_server(fixed_upstream(VLLM_BYTES)) as engine:
        proxy = ProxyApp(proxy_config(redis_url, engine, prefix_mode="verify"))
        with running_server(proxy) as url:
            answer = _ask(url, "bytes-1", **options)
    assert answer.status_code == 200, answer.text
    assert answer.content == VLLM_BYTES
    assert answer.headers["content-type"] == "application/json"
    [record] = manifest(redis_url, "bytes-1").records  # and the call was staged
    assert (record.prev_len, record.delta_len, record.cum_len) == (0, 5, 5)


@pytest.mark.parametrize(
    ("asked", "nulled"),
    [
        ({}, {"prompt_token_ids", "token_ids", "logprobs"}),
        ({"logprobs": True}, {"prompt_token_ids", "token_ids"}),
        ({"return_token_ids": True}, {"logprobs"}),
    ],
    ids=["nothing", "logprobs", "token-ids"],
)
def test_an_answer_with_fields_stripped_is_the_engines_answer_less_those_fields(
    redis_url: str, asked: dict[str, Any], nulled: set[str]
) -> None:
    with running_server(fixed_upstream(VLLM_BYTES)) as engine:
        proxy = ProxyApp(proxy_config(redis_url, engine, prefix_mode="verify"))
        with running_server(proxy) as url:
            answer = _ask(url, "bytes-2", **asked)
    assert answer.status_code == 200, answer.text
    served = answer.json()
    expected = json.loads(VLLM_BYTES)
    choice = expected["choices"][0]
    for name in nulled:
        (expected if name == "prompt_token_ids" else choice)[name] = None
    assert served == expected
    assert len(manifest(redis_url, "bytes-2").records) == 1
