"""The capture proxy per route and upstream shape: completions (token-id prompts), Responses, NeMo Gym message-level
fields, re-tokenization drift (vllm kind) against an engine honouring the prefix (nemo-rl kind), streaming."""

from __future__ import annotations

import gzip
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from sink.contract.records import WORKER_CAPTURE_FAILED_REASON
from sink_tools.simulated.engine import IM_END, IM_START
from sink_tools.simulated.http_app import DRIFT_SPACE_ID, EngineApp
from sink_tools.simulated.options import EngineOptions
from tests.helpers.proxy import (
    SYSTEM,
    client_for,
    close_clients,
    expected_ids,
    finish,
    manifest,
    proxy_config,
    pull,
    run_agent,
    unset,
)
from worker.asgi import Message, Receive, Scope, Send, header, send_body
from worker.proxy.app import ProxyApp
from worker.proxy.serve import running_server


@pytest.fixture(autouse=True)
def _clients() -> Iterator[None]:
    """Every openai client of the test is closed at its end."""
    yield
    close_clients()


@pytest.fixture
def stack(request: pytest.FixtureRequest, redis_url: str) -> Iterator[tuple[EngineApp, ProxyApp, str]]:
    """(engine, proxy app, proxy URL); parametrize indirectly with ``(EngineOptions, proxy fields)``."""
    options, fields = getattr(request, "param", (EngineOptions(seed=3), {}))
    engine = EngineApp(options)
    with running_server(engine) as upstream:
        proxy = ProxyApp(proxy_config(redis_url, upstream, **fields))
        with running_server(proxy) as url:
            yield engine, proxy, url


def test_token_id_completion_is_captured_and_verified(redis_url: str, stack: tuple[EngineApp, ProxyApp, str]) -> None:
    engine, proxy, url = stack
    prompt = [IM_START, 40, 41, 42]
    completion = client_for(url, "cmpl-1").completions.create(
        model="simulated", prompt=prompt, max_tokens=6, extra_body={"min_tokens": 2}
    )
    choice = completion.choices[0]
    assert choice.text and choice.logprobs is None and unset(choice.model_extra or {}, "token_ids")
    finish(url, "cmpl-1", 1.0, completion.id)
    [pulled] = pull(redis_url, 1)
    assert pulled.row is not None
    generated = engine.engine.tokenizer.encode(choice.text) + [IM_END]
    assert list(pulled.row.token_ids) == prompt + generated
    assert list(pulled.row.token_mask) == [0.0] * len(prompt) + [1.0] * len(generated)
    assert proxy.metrics.counts["captured"] == 1


def test_text_completion_is_a_root(redis_url: str, stack: tuple[EngineApp, ProxyApp, str]) -> None:
    _, _, url = stack
    for _ in range(2):
        client_for(url, "cmpl-2").completions.create(model="simulated", prompt="hello", max_tokens=4)
    shown = manifest(redis_url, "cmpl-2")
    assert [r.mode for r in shown.records] == ["text", "text"] and not shown.failures


def test_responses_api_chain(redis_url: str, stack: tuple[EngineApp, ProxyApp, str]) -> None:
    _, _, url = stack
    client = client_for(url, "resp-1")
    items: list[Any] = [{"role": "user", "content": "plan the task"}]
    for turn in range(3):
        response = client.responses.create(
            model="simulated", input=items, max_output_tokens=10, extra_body={"min_tokens": 3}
        )
        [output] = response.output
        dumped = output.model_dump(exclude_none=True)
        assert "generation_token_ids" not in dumped and "prompt_token_ids" not in dumped
        items += [dumped, {"role": "user", "content": f"next {turn}"}]
    shown = manifest(redis_url, "resp-1")
    assert [r.mode for r in shown.records] == ["text", "token_in", "token_in"] and not shown.failures
    assert [r.parent_call_id for r in shown.records][1:] == [r.model_call_id for r in shown.records][:-1]


@pytest.mark.parametrize("stack", [(EngineOptions(seed=4, shape="nemo-gym"), {})], indirect=True)
def test_nemo_gym_message_fields(redis_url: str, stack: tuple[EngineApp, ProxyApp, str]) -> None:
    engine, _, url = stack
    conversation, last_id = run_agent([url], "gym-1", turns=3)
    finish(url, "gym-1", 1.0, last_id)
    [pulled] = pull(redis_url, 1)
    assert pulled.row is not None and list(pulled.row.token_ids) == expected_ids(engine, conversation)


@pytest.mark.parametrize("stack", [(EngineOptions(seed=5, drift=True), {})], indirect=True)
def test_drift_fires_the_token_in_check(redis_url: str, stack: tuple[EngineApp, ProxyApp, str]) -> None:
    _, proxy, url = stack
    _, last_id = run_agent([url], "drift-1", turns=2)  # both calls are served
    shown = manifest(redis_url, "drift-1")
    assert len(shown.records) == 1
    assert [f.reason for f in shown.failures] == [WORKER_CAPTURE_FAILED_REASON]
    assert proxy.metrics.counts == {"captured": 1, "uncaptured": 0, "capture_failed": 1, "capture_error": 0}
    finish(url, "drift-1", 1.0, last_id)
    [pulled] = pull(redis_url, 1)
    assert pulled.row is None and pulled.receipt.capture_poisoned


@pytest.mark.parametrize(
    "stack", [(EngineOptions(seed=6, drift=True, honour_prefix=True), {"upstream_kind": "nemo-rl"})], indirect=True
)
def test_nemo_rl_prefix_defeats_drift(redis_url: str, stack: tuple[EngineApp, ProxyApp, str]) -> None:
    _, _, url = stack
    conversation, last_id = run_agent([url], "nemo-rl-1", turns=3)
    finish(url, "nemo-rl-1", 1.0, last_id)
    [pulled] = pull(redis_url, 1)
    assert pulled.row is not None and not pulled.receipt.capture_poisoned
    # The exact ids of the generation, never the drifting re-tokenization of earlier assistant text.
    assert DRIFT_SPACE_ID not in pulled.row.token_ids
    assert list(pulled.row.token_ids) == expected_ids(EngineApp(), conversation)


def test_streaming_is_emitted_after_the_stage(redis_url: str, stack: tuple[EngineApp, ProxyApp, str]) -> None:
    _, _, url = stack
    messages: Any = [SYSTEM, {"role": "user", "content": "stream it"}]
    stream = client_for(url, "stream-1").chat.completions.create(
        model="simulated",
        messages=messages,
        max_tokens=8,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"min_tokens": 2},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text and chunks[-1].usage is not None and chunks[-1].usage.completion_tokens >= 2
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    shown = manifest(redis_url, "stream-1")
    assert len(shown.records) == 1 and shown.records[0].response_id == chunks[0].id


def _gzipping(app: EngineApp) -> Any:
    """*app*, answering with ``content-encoding: gzip`` whenever the request accepts it."""

    async def wrapped(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or b"gzip" not in (header(scope, b"accept-encoding") or "").encode():
            await app(scope, receive, send)
            return
        parts: list[Message] = []

        async def collect(message: Message) -> None:
            parts.append(message)

        await app(scope, receive, collect)
        body = gzip.compress(b"".join(m.get("body", b"") for m in parts[1:]))
        await send_body(send, parts[0]["status"], body, headers=[(b"content-encoding", b"gzip")])

    return wrapped


def test_compressing_upstream_is_still_captured(redis_url: str) -> None:
    with running_server(_gzipping(EngineApp(EngineOptions(seed=8)))) as upstream:
        direct = httpx.post(f"{upstream}/v1/models", headers={"accept-encoding": "gzip"})
        assert direct.status_code == 404 or direct.headers.get("content-encoding") == "gzip"
        with running_server(ProxyApp(proxy_config(redis_url, upstream))) as url:
            run_agent([url], "gzip-1", turns=2)
            models = httpx.get(f"{url}/v1/models", headers={"accept-encoding": "gzip"})
            assert models.json()["data"][0]["id"] == "simulated"
    shown = manifest(redis_url, "gzip-1")
    assert len(shown.records) == 2 and not shown.failures


def test_streaming_completions_and_responses(redis_url: str, stack: tuple[EngineApp, ProxyApp, str]) -> None:
    _, _, url = stack
    client = client_for(url, "stream-2")
    chunks = list(client.completions.create(model="simulated", prompt="once", max_tokens=6, stream=True))
    assert "".join(c.choices[0].text for c in chunks) and chunks[-1].choices[0].finish_reason == "stop"
    events = list(client.responses.create(model="simulated", input="go on", max_output_tokens=6, stream=True))
    assert [e.type for e in events] == ["response.created", "response.completed"]
    completed = events[-1]
    assert completed.type == "response.completed" and completed.response.output_text
    assert len(manifest(redis_url, "stream-2").records) == 2
