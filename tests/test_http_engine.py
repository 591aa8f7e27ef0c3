"""The simulated engine over HTTP answers like vLLM's OpenAI server (driven with the official openai client), and
the capture middleware runs in-process around it as vLLM's ``--middleware`` would."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from sink.contract.records import UNCOMMITTED_CALL_REASON
from sink_tools.simulated.engine import BYTE_OFFSET, IM_END
from sink_tools.simulated.http_app import DRIFT_SPACE_ID, EngineApp
from sink_tools.simulated.options import EngineOptions
from tests.helpers.proxy import SYSTEM, client_for, close_clients, expected_ids, finish, manifest, pull, run_agent
from worker.asgi import Receive, Scope, Send
from worker.proxy.in_process import EnvCaptureMiddleware, config_from_environment
from worker.proxy.serve import running_server

MESSAGES: Any = [SYSTEM, {"role": "user", "content": "count to three"}]


@pytest.fixture(autouse=True)
def _clients() -> Iterator[None]:
    """Every openai client of the test is closed at its end."""
    yield
    close_clients()


@pytest.fixture
def engine() -> Iterator[tuple[EngineApp, str]]:
    app = EngineApp(EngineOptions(seed=21))
    with running_server(app) as url:
        yield app, url


def test_chat_token_fields_like_vllm(engine: tuple[EngineApp, str]) -> None:
    app, url = engine
    completion = client_for(url).chat.completions.create(
        model="simulated",
        messages=MESSAGES,
        max_tokens=6,
        logprobs=True,
        top_logprobs=0,
        extra_body={"return_token_ids": True, "return_tokens_as_token_ids": True, "min_tokens": 3},
    )
    choice = completion.choices[0]
    extra = completion.model_extra or {}
    assert extra["prompt_token_ids"] == app.render(MESSAGES)
    ids = (choice.model_extra or {})["token_ids"]
    assert choice.logprobs is not None and choice.logprobs.content is not None
    assert [entry.token for entry in choice.logprobs.content] == [f"token_id:{t}" for t in ids]
    assert all(entry.logprob < 0 for entry in choice.logprobs.content) and ids[-1] == IM_END
    assert completion.usage is not None and completion.usage.completion_tokens == len(ids)
    assert completion.usage.prompt_tokens == len(extra["prompt_token_ids"])
    assert app.engine.tokenizer.decode(ids) == choice.message.content


def test_plain_requests_carry_no_token_fields(engine: tuple[EngineApp, str]) -> None:
    _, url = engine
    completion = client_for(url).chat.completions.create(model="simulated", messages=MESSAGES, max_tokens=4)
    assert completion.choices[0].logprobs is None  # vLLM 0.32 writes the token fields it was not asked for as null
    assert (completion.model_extra or {})["prompt_token_ids"] is None
    assert (completion.choices[0].model_extra or {})["token_ids"] is None
    text = client_for(url).completions.create(model="simulated", prompt=[1, 20, 30], max_tokens=3, logprobs=0)
    logprobs = text.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens is not None and len(logprobs.tokens) == text.usage.completion_tokens  # type: ignore[union-attr]
    assert text.usage is not None and text.usage.prompt_tokens == 3


def test_tokenize_and_drift() -> None:
    drifting = EngineApp(EngineOptions(drift=True))
    history = [*MESSAGES, {"role": "assistant", "content": "one two"}, {"role": "user", "content": "more"}]
    with running_server(drifting) as url:
        tokens = httpx.post(f"{url}/tokenize", json={"messages": history}).json()["tokens"]
        assert httpx.get(f"{url}/health").status_code == 200
        with pytest.raises(openai.BadRequestError):
            client_for(url).chat.completions.create(model="simulated", messages=MESSAGES, max_tokens=0)
    plain = EngineApp().render(history)
    assert len(tokens) == len(plain) and tokens != plain
    assert [i for i, (a, b) in enumerate(zip(tokens, plain, strict=True)) if a != b] == [
        i for i, t in enumerate(plain) if t == BYTE_OFFSET + 0x20 and tokens[i] == DRIFT_SPACE_ID
    ]


def test_in_process_middleware_around_the_engine(redis_url: str) -> None:
    env = {"STAGING_SINK_REDIS_URL": redis_url, "STAGING_SINK_WEIGHT_VERSION": "3"}
    engine = EngineApp(EngineOptions(seed=22))
    with running_server(EnvCaptureMiddleware(engine, env)) as url:
        conversation, last_id = run_agent([url], "inproc-1", turns=2)
        finish(url, "inproc-1", 1.0, last_id)
    assert [r.weight_version for r in manifest(redis_url, "inproc-1").records] == [3, 3]
    [pulled] = pull(redis_url, 1)
    assert pulled.row is not None and list(pulled.row.token_ids) == expected_ids(engine, conversation)
    with pytest.raises(ValueError, match="STAGING_SINK_REDIS_URL"):
        config_from_environment({})
    with pytest.raises(ValueError, match="UPSTREAM_KIND"):
        config_from_environment({"STAGING_SINK_REDIS_URL": redis_url, "STAGING_SINK_UPSTREAM_KIND": "tgi"})


def test_inner_app_failure_records_the_abandoned_call(redis_url: str) -> None:
    """An admitted call whose inner app raises is recorded failed at middleware exit (contract §6.6 step 12)."""

    async def broken(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        raise RuntimeError("engine crashed")

    env = {"STAGING_SINK_REDIS_URL": redis_url, "STAGING_SINK_UPSTREAM_KIND": "nemo-rl"}
    with running_server(EnvCaptureMiddleware(broken, env)) as url:
        answer = httpx.post(f"{url}/r/crash-1/v1/chat/completions", json={"messages": MESSAGES})
    assert answer.status_code == 500
    assert [f.reason for f in manifest(redis_url, "crash-1").failures] == [UNCOMMITTED_CALL_REASON]
