"""Helpers of the capture-proxy tests: engine and proxy servers, an openai-client agent, ledger and reader reads."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import anyio
import httpx
import openai
import orjson

from sink.contract.records import RolloutManifest
from sink.ledger.redis import RedisCaptureLedger
from sink.settings import ProxySettings
from sink.trainer.pulled import PulledRollout
from sink.trainer.reader.rollout_reader import RolloutReader
from sink_tools.simulated.engine import IM_END
from sink_tools.simulated.http_app import EngineApp
from sink_tools.simulated.options import EngineOptions
from tests.helpers.e2e import pull_until, running_assembler
from tests.helpers.tls import openai_client, tls
from worker.asgi import ASGIApp, Receive, Scope, Send, read_body, send_body
from worker.proxy.app import ProxyApp
from worker.proxy.serve import running_server

__all__ = (
    "SYSTEM",
    "RecordingEngine",
    "client_for",
    "close_clients",
    "expected_ids",
    "finish",
    "fixed_upstream",
    "manifest",
    "proxy_before",
    "proxy_config",
    "pull",
    "run_agent",
    "unset",
)

SYSTEM = {"role": "system", "content": "You are a careful agent."}


class RecordingEngine:
    """The simulated engine, recording every HTTP request it receives: its path, and its whole ASGI scope."""

    def __init__(self) -> None:
        self.app = EngineApp(EngineOptions(seed=3))
        self.paths: list[str] = []
        self.scopes: list[Scope] = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            self.paths.append(scope["path"])
            self.scopes.append(scope)
        await self.app(scope, receive, send)


def fixed_upstream(payload: dict[str, Any] | bytes) -> ASGIApp:
    """An upstream that answers every POST with *payload* (JSON; bytes are sent as they are), whatever the body (it
    never parses it)."""
    body = payload if isinstance(payload, bytes) else orjson.dumps(payload)

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        await read_body(receive)
        await send_body(send, 200, body)

    return app


def unset(mapping: Any, *names: str) -> bool:
    """Whether each of *names* is absent from *mapping* or ``None``: a token field the client did not ask for (the
    proxy answers ``null`` where vLLM has the key, as vLLM does without ``return_token_ids``)."""
    return isinstance(mapping, dict) and all(mapping.get(name) is None for name in names)


def proxy_config(redis_url: str, upstream: str, **fields: Any) -> ProxySettings:
    return ProxySettings(upstream_url=upstream, redis_url=redis_url, **{"redis_timeout_s": 2.0, **fields})


@contextmanager
def proxy_before(engine: RecordingEngine, redis_url: str, **fields: Any) -> Iterator[tuple[str, ProxyApp]]:
    """*engine* and a proxy in front of it (:func:`proxy_config` with *fields*), each on its own uvicorn server:
    yields the proxy's URL and app, with the engine's record of the proxy's start-up requests (its probe) cleared."""
    with running_server(engine) as engine_url:
        proxy = ProxyApp(proxy_config(redis_url, engine_url, **fields))
        with running_server(proxy) as url:
            engine.paths.clear()
            engine.scopes.clear()
            yield url, proxy


_OPEN_CLIENTS: list[openai.OpenAI] = []


def client_for(base: str, rollout_id: str | None = None) -> openai.OpenAI:
    """An openai client on *base* (the rollout's route when given); :func:`close_clients` closes it."""
    path = f"/r/{rollout_id}/v1" if rollout_id else "/v1"
    client = openai_client(base + path, api_key="unused", max_retries=0, timeout=20)
    _OPEN_CLIENTS.append(client)
    return client


def close_clients() -> None:
    """Close every client :func:`client_for` made so far (each test module's autouse fixture calls it)."""
    while _OPEN_CLIENTS:
        _OPEN_CLIENTS.pop().close()


def run_agent(
    bases: list[str], rollout_id: str, turns: int, *, before_turn: Callable[[int], None] | None = None
) -> tuple[list[dict[str, Any]], str]:
    """A multi-turn agent whose calls alternate over *bases*; returns the final conversation and last response id.
    *before_turn* is called with each turn's index before its call (to change the world between two calls)."""
    messages: list[dict[str, Any]] = [SYSTEM, {"role": "user", "content": f"task {rollout_id}"}]
    last_id = ""
    for turn in range(turns):
        if before_turn is not None:
            before_turn(turn)
        client = client_for(bases[turn % len(bases)], rollout_id)
        completion = client.chat.completions.create(
            model="simulated",
            messages=messages,  # type: ignore[arg-type]
            max_tokens=12,
            extra_body={"min_tokens": 4},
        )
        choice = completion.choices[0]
        assert choice.logprobs is None and completion.model_extra is not None
        assert unset(completion.model_extra, "prompt_token_ids")
        assert unset(choice.model_extra or {}, "token_ids")
        messages.append({"role": "assistant", "content": choice.message.content})
        messages.append({"role": "tool", "content": f"result {turn}", "tool_call_id": f"t{turn}"})
        last_id = completion.id
    return messages[:-1], last_id


def finish(base: str, rollout_id: str, reward: float, response_id: str) -> None:
    answer = httpx.post(
        f"{base}/r/{rollout_id}/finished",
        json={"reward": reward, "declared_response_id": response_id},
        verify=tls(),
    )
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
