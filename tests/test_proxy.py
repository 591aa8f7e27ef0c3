"""The capture proxy end to end: the official openai client -> proxy (uvicorn) -> HTTP engine (uvicorn) -> Redis."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import anyio
import openai
import pytest
import redis

from sink.keys import DEFAULT_NAMESPACE
from sink.ledger.redis import RedisCaptureLedger
from sink.pulled import PulledRollout
from sink.reader import RolloutReader
from sink.records import RolloutManifest
from tests.helpers.e2e import pull_until, running_assembler
from worker.engine import IM_END
from worker.http import EngineApp, EngineOptions, ProxyConfig, build_proxy, running_server

SYSTEM = {"role": "system", "content": "You are a careful agent."}


@pytest.fixture
def engine() -> Iterator[tuple[EngineApp, str]]:
    app = EngineApp(EngineOptions(seed=7))
    with running_server(app) as url:
        yield app, url


def _proxy(redis_url: str, upstream: str, **fields: Any) -> ProxyConfig:
    return ProxyConfig(upstream_url=upstream, redis_url=redis_url, redis_timeout_s=2.0, **fields)


@pytest.fixture
def proxy(redis_url: str, engine: tuple[EngineApp, str]) -> Iterator[str]:
    with running_server(build_proxy(_proxy(redis_url, engine[1]))) as url:
        yield url


def client_for(base: str, rollout_id: str | None = None) -> openai.OpenAI:
    path = f"/r/{rollout_id}/v1" if rollout_id else "/v1"
    return openai.OpenAI(base_url=base + path, api_key="unused", max_retries=0, timeout=20)


def run_agent(bases: list[str], rollout_id: str, turns: int) -> tuple[list[dict[str, Any]], str]:
    """A multi-turn agent whose calls alternate over *bases*; returns the final conversation and last response id."""
    messages: list[dict[str, Any]] = [SYSTEM, {"role": "user", "content": f"task {rollout_id}"}]
    last_id = ""
    for turn in range(turns):
        client = client_for(bases[turn % len(bases)], rollout_id)
        completion = client.chat.completions.create(
            model="simulated",
            messages=messages,  # type: ignore[arg-type]
            max_tokens=12,
            extra_body={"min_tokens": 4},
        )
        choice = completion.choices[0]
        assert choice.logprobs is None and completion.model_extra is not None
        assert "prompt_token_ids" not in completion.model_extra
        assert "token_ids" not in (choice.model_extra or {})
        messages.append({"role": "assistant", "content": choice.message.content})
        messages.append({"role": "tool", "content": f"result {turn}", "tool_call_id": f"t{turn}"})
        last_id = completion.id
    return messages[:-1], last_id


def finish(base: str, rollout_id: str, reward: float, response_id: str) -> None:
    import httpx

    answer = httpx.post(f"{base}/r/{rollout_id}/finished", json={"reward": reward, "declared_response_id": response_id})
    assert answer.status_code == 200, answer.text
    assert answer.json()["rollout_id"] == rollout_id


def pull(redis_url: str, count: int) -> list[PulledRollout]:
    async def main() -> list[PulledRollout]:
        async with running_assembler(redis_url, block_ms=50), RolloutReader.from_url(redis_url) as reader:
            pulled = await pull_until(reader, count)
            await reader.ack([item.rollout_id for item in pulled])
            return pulled

    return anyio.run(main)


def manifest(redis_url: str, rollout_id: str) -> RolloutManifest:
    async def main() -> RolloutManifest:
        async with RedisCaptureLedger.from_url(redis_url) as ledger:
            return await ledger.manifest(rollout_id)

    return anyio.run(main)


def expected_ids(app: EngineApp, conversation: list[dict[str, Any]]) -> list[int]:
    """The exact sequence of the last call: its prompt rendered by the engine, then its generation."""
    *prompt_items, last = conversation
    return app.render(prompt_items) + app.engine.tokenizer.encode(last["content"]) + [IM_END]


def test_rollout_through_proxy_is_pulled_and_verified(
    redis_url: str, engine: tuple[EngineApp, str], proxy: str
) -> None:
    app, _ = engine
    conversation, last_id = run_agent([proxy], "proxy-r1", turns=3)
    finish(proxy, "proxy-r1", 1.0, last_id)
    [pulled] = pull(redis_url, 1)
    assert pulled.row is not None, pulled.skip_reason
    assert list(pulled.row.token_ids) == expected_ids(app, conversation)
    assert pulled.receipt.capture_poisoned is False
    assert sum(pulled.row.token_mask) == sum(
        len(app.engine.tokenizer.encode(m["content"])) + 1 for m in conversation if m["role"] == "assistant"
    )


def test_two_proxies_serve_one_rollout_alternately(redis_url: str, engine: tuple[EngineApp, str]) -> None:
    app, upstream = engine
    with (
        running_server(build_proxy(_proxy(redis_url, upstream))) as one,
        running_server(build_proxy(_proxy(redis_url, upstream))) as two,
    ):
        conversation, last_id = run_agent([one, two], "proxy-two", turns=4)
        finish(two, "proxy-two", 0.5, last_id)
    shown = manifest(redis_url, "proxy-two")
    assert len(shown.records) == 4 and not shown.failures
    assert [r.parent_call_id for r in shown.records][1:] == [r.model_call_id for r in shown.records][:-1]
    [pulled] = pull(redis_url, 1)
    assert pulled.row is not None and list(pulled.row.token_ids) == expected_ids(app, conversation)


def test_requests_without_rollout_are_forwarded_uncaptured(redis_url: str, proxy: str) -> None:
    completion = client_for(proxy).chat.completions.create(
        model="simulated", messages=[{"role": "user", "content": "hi"}], max_tokens=4
    )
    assert completion.choices[0].message.content is not None
    models = client_for(proxy).models.list()
    assert [m.id for m in models.data] == ["simulated"]
    with redis.Redis.from_url(redis_url) as client:
        assert not list(client.scan_iter(f"{DEFAULT_NAMESPACE}:*ledger*"))
