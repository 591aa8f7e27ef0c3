"""Exact custody of real multi-turn agent traffic: the official ``openai`` client -> the capture proxy (uvicorn) ->
a logging hop (uvicorn) -> the engine, for every scenario, against the simulated engine (fast tier) and the real
vLLM 0.32 (``vllm`` tier). Every rollout must be trainable and equal, token for token (ids, mask, log-probs), to
what the engine generated as the logging hop saw it."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from functools import partial
from typing import Any

import anyio
import httpx
import orjson
import pytest

from sink.trainer.pulled import PulledRollout
from sink_tools.simulated.http_app import EngineApp
from sink_tools.simulated.options import EngineOptions
from tests.helpers.engine_truth import Generated, assert_row_is_exact, generations
from tests.helpers.logging_hop import Exchange, running_hop
from tests.helpers.processes import free_port
from tests.helpers.proxy import close_clients, finish, proxy_config, pull, run_agent
from tests.helpers.scenario_agent import Turn, run_scenario
from tests.helpers.tier_engine import TierEngine, tier_engine
from worker.errors import StagingModeError
from worker.proxy.app import ProxyApp
from worker.proxy.serve import running_server

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "parameters": {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]},
        },
    }
]


Options = Callable[[TierEngine, int], dict[str, Any]]


def plain(engine: TierEngine, turn: int) -> dict[str, Any]:
    return {"max_tokens": 12, "seed": turn, "logit_bias": engine.bias()}


def streaming(engine: TierEngine, turn: int) -> dict[str, Any]:
    return {**plain(engine, turn), "stream": True, "stream_options": {"include_usage": True}}


def tools(engine: TierEngine, turn: int) -> dict[str, Any]:
    # Turns 0 and 1: structured outputs make the tiny model write a pythonic call, which the tool parser turns
    # into tool_calls (the simulated engine has no parser and ignores the constraint).
    forced = {"extra_body": {"structured_outputs": {"choice": [f"[lookup(q='t{turn}')]"]}}} if turn < 2 else {}
    return {**plain(engine, turn), "max_tokens": 24, "tools": TOOLS, **forced}


def reasoning(engine: TierEngine, turn: int) -> dict[str, Any]:
    think = {str(engine.think_end): 2.0} if engine.think_end is not None else {}
    return {"max_tokens": 16, "seed": turn, "logit_bias": {**engine.bias(), **think}}


def reasoning_streaming(engine: TierEngine, turn: int) -> dict[str, Any]:
    return {**reasoning(engine, turn), "stream": True}


def stop_strings(engine: TierEngine, turn: int) -> dict[str, Any]:
    return {"max_tokens": 40, "seed": turn, "stop": ["e", "t", "a", "o"], "logit_bias": engine.bias()}


def ignore_eos(engine: TierEngine, turn: int) -> dict[str, Any]:
    eot = {str(engine.eot): 4.0}
    return {"max_tokens": 10, "seed": turn, "logit_bias": {**engine.bias(), **eot}, "extra_body": {"ignore_eos": True}}


def forced_empty(engine: TierEngine, turn: int) -> dict[str, Any]:
    eot = 100.0 if turn == 1 else -100.0  # turn 1's reply is empty: its first sampled id is the end-of-turn
    return {"max_tokens": 8, "seed": turn, "logit_bias": engine.bias(**{str(engine.eot): eot})}


@dataclass(frozen=True)
class Scenario:
    variant: str
    options: Options
    proxies: int = 1
    observation: str = "tool"
    retry_400_on: int | None = None


SCENARIOS = {
    "plain": Scenario("chatml", plain, observation="user"),
    "streaming": Scenario("chatml", streaming),
    "tools": Scenario("tools", tools),
    "reasoning": Scenario("reasoning", reasoning, observation="user"),
    "reasoning-streaming": Scenario("reasoning", reasoning_streaming, observation="user"),
    "stop-strings": Scenario("chatml", stop_strings),
    "ignore-eos": Scenario("chatml", ignore_eos),
    "forced-empty": Scenario("chatml", forced_empty),
    "400-then-retry": Scenario("chatml", plain, retry_400_on=1),
    "two-proxies": Scenario("chatml", plain, proxies=2),
}
ENGINES = ["simulated", pytest.param("vllm", marks=pytest.mark.vllm)]


@pytest.fixture(autouse=True)
def _clients() -> Iterator[None]:
    yield
    close_clients()


def _start_up_probe(exchange: Exchange) -> bool:
    """The proxy's one start-up chat call (exact mode learns the chat route's fingerprint and empty reply from it)."""
    if exchange.path != "/v1/chat/completions":
        return False
    body = exchange.request_json()
    return body.get("max_tokens") == 1 and "return_token_ids" not in body


def _check_scenario(name: str, kind: str, turns: list[Turn]) -> None:
    if name == "forced-empty":
        assert turns[1].content in ("", None)
    if name == "tools" and kind == "vllm":
        assert [call["function"]["name"] for turn in turns[:2] for call in turn.tool_calls] == ["lookup", "lookup"]
    if name.startswith("reasoning") and kind == "vllm":
        assert any(turn.reasoning for turn in turns), "the reasoning parser must have split some reasoning off"


def _run(
    name: str, kind: str, redis_url: str, request: pytest.FixtureRequest, **settings: Any
) -> tuple[PulledRollout, list[Generated], list[Turn], list[str]]:
    """Run scenario *name* on engine *kind*; returns the pulled rollout, the engine's generations as the hop saw
    them, the agent's turns and the paths the hop relayed."""
    scenario = SCENARIOS[name]
    rollout_id = f"{name}-{kind}"
    with ExitStack() as stack:
        engine = tier_engine(kind, scenario.variant, request, stack)
        hop, hop_url = stack.enter_context(running_hop(engine.url))
        bases = [
            stack.enter_context(running_server(ProxyApp(proxy_config(redis_url, hop_url, **settings))))
            for _ in range(scenario.proxies)
        ]
        conversation, turns = run_scenario(
            bases,
            rollout_id,
            engine.model,
            3,
            lambda turn: scenario.options(engine, turn),
            observation=scenario.observation,
            retry_400_on=scenario.retry_400_on,
        )
        finish(bases[0], rollout_id, 1.0, turns[-1].response_id)
        assert conversation[-1]["role"] == "assistant"
        engine_answers = generations(hop)
        paths = [exchange.path for exchange in hop.exchanges if not _start_up_probe(exchange)]
    [pulled] = pull(redis_url, 1)
    return pulled, engine_answers, turns, paths


@pytest.mark.parametrize("kind", ENGINES)
@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_every_rollout_is_trainable_and_exact(
    name: str, kind: str, scenario_redis_url: str, request: pytest.FixtureRequest
) -> None:
    pulled, engine_answers, turns, paths = _run(name, kind, scenario_redis_url, request)
    assert pulled.row is not None, f"{pulled.skip_code}: {pulled.skip_reason}"
    assert len(pulled.row.model_call_ids) == 3
    assert_row_is_exact(pulled.row, engine_answers)
    _check_scenario(name, kind, turns)
    # Exact-prefix mode: every generation went through the token-in route, none through the re-templating one.
    assert "/v1/chat/completions" not in paths and paths.count("/inference/v1/generate") == len(engine_answers) == 3
    # ... and none generated more than the agent's max_tokens (vLLM drops a default-valued max_tokens from render).
    limits = [SCENARIOS[name].options(TierEngine("", "", 0), turn)["max_tokens"] for turn in range(3)]
    assert all(len(g.ids) <= limit for g, limit in zip(engine_answers, limits, strict=True)), [len(g.ids) for g in engine_answers]


@pytest.mark.vllm
@pytest.mark.parametrize("name", ["reasoning", "stop-strings", "ignore-eos"])
def test_verify_mode_skips_what_exact_mode_trains(
    name: str, scenario_redis_url: str, request: pytest.FixtureRequest
) -> None:
    # The control: with the engine re-templating history, these rollouts drift and are never trained.
    pulled, _, _, paths = _run(name, "vllm", scenario_redis_url, request, prefix_mode="verify")
    assert pulled.row is None and pulled.skip_code == "rollout_failed", pulled.skip_reason
    assert "/inference/v1/generate" not in paths


def test_the_mode_is_probed_at_start_and_logged_once(redis_url: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="worker.proxy.exact.mode")

    async def mode_of(url: str, **settings: Any) -> bool:
        proxy = ProxyApp(proxy_config(redis_url, url, **settings))
        await proxy.open()
        try:
            assert proxy.middleware is not None
            return proxy.middleware.prefix_mode.exact is not None
        finally:
            await proxy.aclose()

    with running_server(EngineApp(EngineOptions(scale_out=True))) as url:
        assert anyio.run(mode_of, url) is True
    with running_server(EngineApp(EngineOptions())) as url:
        assert anyio.run(mode_of, url) is False
        with pytest.raises(StagingModeError, match="--enable-scale-out"):
            anyio.run(partial(mode_of, url, prefix_mode="exact"))
    lines = [record.getMessage() for record in caplog.records if record.name == "worker.proxy.exact.mode"]
    assert lines[0].startswith("prefix mode: exact (") and "end-of-turn ids [2]" in lines[0]
    assert lines[1] == (
        "prefix mode: verify (the engine's token-in/token-out routes are disabled (start vLLM with --enable-scale-out))"
    )
    assert len(lines) == 2


def test_a_streamed_reply_carries_the_token_fields_the_agent_asked_for(scenario_redis_url: str) -> None:
    with ExitStack() as stack:
        engine = stack.enter_context(running_server(EngineApp(EngineOptions(seed=2, scale_out=True))))
        proxy = stack.enter_context(running_server(ProxyApp(proxy_config(scenario_redis_url, engine))))
        body = {
            "model": "simulated",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 6,
            "stream": True,
            "return_token_ids": True,
        }
        answer = httpx.post(f"{proxy}/r/stream-ids/v1/chat/completions", json=body, timeout=20)
        assert answer.status_code == 200, answer.text
        events = [orjson.loads(line[6:]) for line in answer.text.splitlines() if line.startswith("data: {")]
        first, last = events[0], events[-1]  # vLLM's layout: prompt ids on the role chunk, ids on the ending one
        finish(proxy, "stream-ids", 1.0, first["id"])
    [pulled] = pull(scenario_redis_url, 1)
    assert pulled.row is not None
    assert first["prompt_token_ids"] + last["choices"][0]["token_ids"] == list(pulled.row.token_ids)
    assert last["choices"][0]["finish_reason"] in ("stop", "length") and last.get("prompt_token_ids") is None


def test_an_engine_not_up_at_start_is_probed_on_the_first_call(
    scenario_redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="worker.proxy.exact.mode")
    port = free_port()
    engine_url = f"http://127.0.0.1:{port}"
    with running_server(ProxyApp(proxy_config(scenario_redis_url, engine_url))) as proxy:
        assert "prefix mode: undecided (GET /v1/models answered 502)" in caplog.text
        with running_server(EngineApp(EngineOptions(seed=4, scale_out=True)), port=port):
            _, last_id = run_agent([proxy], "late-engine", turns=2)
            finish(proxy, "late-engine", 1.0, last_id)
    assert "prefix mode: exact (" in caplog.text
    [pulled] = pull(scenario_redis_url, 1)
    assert pulled.row is not None and len(pulled.row.model_call_ids) == 2
