"""Real-traffic fixes that hold in verify mode (``--prefix-mode verify``, an engine without token-in/token-out
routes): the official ``openai`` client -> the capture proxy (uvicorn) -> a logging hop -> the simulated engine.

A forced empty reply mid-rollout (two earlier calls then match the next request; the deepest is the parent), an
engine 400 followed by a retry (a failed attempt, not a poison row), the streamed replay (reasoning, tool calls,
the token fields the agent asked for), ``routed_experts`` on the choice (vLLM 0.32) or on the message, a precise
log line for every failure, and a body the proxy cannot parse under fail-open (the rollout records the failure).
"""

from __future__ import annotations

import base64
import io
import json
import logging
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import httpx
import numpy as np
import openai
import orjson
import pytest
from openai.types.chat import ChatCompletionChunk

from sink.contract.records import UNRESOLVED_PARENT_REASON, WORKER_CAPTURE_FAILED_REASON
from sink.store.source import RedisStagingSource
from sink.trainer.pulled import PulledRollout
from sink_tools.simulated.chat_extras import routed_experts_array
from sink_tools.simulated.engine import IM_END
from sink_tools.simulated.http_app import DRIFT_SPACE_ID, EngineApp
from sink_tools.simulated.options import EngineOptions
from tests.helpers.engine_truth import Generated, assert_row_is_exact, generations
from tests.helpers.logging_hop import running_hop
from tests.helpers.processes import free_port, service
from tests.helpers.proxy import SYSTEM, client_for, close_clients, finish, manifest, proxy_config, pull, unset
from tests.helpers.scenario_agent import run_scenario
from tests.helpers.vllm_server import VllmServer
from worker.proxy.app import ProxyApp
from worker.proxy.serve import running_server

MESSAGES: list[Any] = [SYSTEM, {"role": "user", "content": "go"}]
TOOLS: Any = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {}}}}]


@pytest.fixture(autouse=True)
def _clients() -> Iterator[None]:
    yield
    close_clients()


ENGINES = ["simulated", pytest.param("vllm", marks=pytest.mark.vllm)]


@dataclass(frozen=True)
class _Engine:
    url: str
    model: str
    eot: int
    hidden: dict[str, float]
    """A bias that keeps the tiny real model off the specials its text would hide."""


def _engine(kind: str, request: pytest.FixtureRequest, stack: ExitStack) -> _Engine:
    if kind == "simulated":
        app = EngineApp(EngineOptions(seed=5, max_model_len=1024))
        return _Engine(stack.enter_context(running_server(app)), "simulated", IM_END, {})
    server: VllmServer = request.getfixturevalue("vllm_chatml")
    hidden = {str(server.id_of(token)): -100.0 for token in ("<|endoftext|>", "<|im_start|>", "<think>")}
    return _Engine(server.url, server.model, server.id_of("<|im_end|>"), hidden)


def _verify_rollout(
    redis_url: str,
    rollout_id: str,
    options: Callable[[_Engine, int], dict[str, Any]],
    kind: str,
    request: pytest.FixtureRequest,
    *,
    retry_400_on: int | None = None,
) -> tuple[PulledRollout, list[Generated], list[str]]:
    """Three turns in verify mode on engine *kind*; returns the pulled rollout, the engine's generations (as the
    logging hop saw them) and the hop's paths."""
    with ExitStack() as stack:
        engine = _engine(kind, request, stack)
        hop, hop_url = stack.enter_context(running_hop(engine.url))
        proxy = stack.enter_context(running_server(ProxyApp(proxy_config(redis_url, hop_url, prefix_mode="verify"))))
        _, turns = run_scenario(
            [proxy], rollout_id, engine.model, 3, lambda turn: options(engine, turn), retry_400_on=retry_400_on
        )
        finish(proxy, rollout_id, 1.0, turns[-1].response_id)
        paths = [exchange.path for exchange in hop.exchanges]
        engine_answers = generations(hop)
    [pulled] = pull(redis_url, 1)
    return pulled, engine_answers, paths


# --- 1. nested ambiguity: an empty reply makes two calls match; the deepest is the parent ---------------------


@pytest.mark.parametrize("kind", ENGINES)
def test_a_forced_empty_reply_mid_rollout_trains_in_verify_mode(
    kind: str, scenario_redis_url: str, request: pytest.FixtureRequest
) -> None:
    def options(engine: _Engine, turn: int) -> dict[str, Any]:
        eot = 100.0 if turn == 1 else -100.0  # turn 1's reply is empty: its first sampled id is the end-of-turn
        return {"max_tokens": 8, "seed": turn, "logit_bias": {**engine.hidden, str(engine.eot): eot}}

    pulled, engine_answers, paths = _verify_rollout(scenario_redis_url, f"empty-verify-{kind}", options, kind, request)
    assert len(engine_answers[1].ids) == 1  # the empty reply happened: only the end-of-turn id
    assert pulled.row is not None, f"{pulled.skip_code}: {pulled.skip_reason}"
    assert len(pulled.row.model_call_ids) == 3
    assert_row_is_exact(pulled.row, engine_answers)
    assert paths.count("/v1/chat/completions") == 3 and "/inference/v1/generate" not in paths


# --- 2. an engine 400 (nothing generated) is a failed attempt, never a poison row ------------------------------


@pytest.mark.parametrize("kind", ENGINES)
def test_a_400_then_a_retry_trains_in_verify_mode(
    kind: str, scenario_redis_url: str, request: pytest.FixtureRequest, caplog: pytest.LogCaptureFixture
) -> None:
    def options(engine: _Engine, turn: int) -> dict[str, Any]:
        return {"max_tokens": 12, "seed": turn, "logit_bias": engine.hidden}

    rollout_id = f"retry-verify-{kind}"
    pulled, engine_answers, paths = _verify_rollout(
        scenario_redis_url, rollout_id, options, kind, request, retry_400_on=1
    )
    assert pulled.row is not None, f"{pulled.skip_code}: {pulled.skip_reason}"
    assert len(pulled.row.model_call_ids) == 3
    assert_row_is_exact(pulled.row, engine_answers)
    assert paths.count("/v1/chat/completions") == 4  # the refused attempt reached the engine
    assert "upstream answered 400 (nothing generated): a failed attempt, the rollout is not poisoned" in caplog.text
    assert "max_tokens" in caplog.text and "engine said: " in caplog.text


def test_a_refused_root_and_a_complete_chain_train(redis_url: str, caplog: pytest.LogCaptureFixture) -> None:
    """The 400 on the very first call leaves nothing: the retry is the root, the rollout trains."""
    with running_server(EngineApp(EngineOptions(seed=3, max_model_len=1024))) as engine:
        proxy = ProxyApp(proxy_config(redis_url, engine, prefix_mode="verify"))
        with running_server(proxy) as url:
            client = client_for(url, "refused-root")
            with pytest.raises(openai.BadRequestError):
                client.chat.completions.create(model="simulated", messages=MESSAGES, max_tokens=100_000)
            completion = client.chat.completions.create(model="simulated", messages=MESSAGES, max_tokens=6)
            finish(url, "refused-root", 1.0, completion.id)
    assert not manifest(redis_url, "refused-root").failures
    [pulled] = pull(redis_url, 1)
    assert pulled.row is not None and len(pulled.row.model_call_ids) == 1
    assert proxy.metrics.counts["uncaptured"] == 1 and proxy.metrics.counts["captured"] == 1


def test_an_engine_5xx_still_poisons(redis_url: str, caplog: pytest.LogCaptureFixture) -> None:
    """A server error may come after a generation: it stays a failure row."""
    with running_server(EngineApp(EngineOptions(delay_s=0.8))) as engine:
        proxy = ProxyApp(proxy_config(redis_url, engine, prefix_mode="verify", upstream_timeout_s=0.2))
        with running_server(proxy) as url, pytest.raises(openai.APIStatusError) as raised:
            client_for(url, "timeout-verify").chat.completions.create(
                model="simulated", messages=MESSAGES, max_tokens=4
            )
    assert raised.value.status_code == 504
    assert [failure.reason for failure in manifest(redis_url, "timeout-verify").failures] == [
        WORKER_CAPTURE_FAILED_REASON
    ]
    assert "upstream answered 504; capture failed" in caplog.text


# --- 3. the streamed replay carries reasoning, tool calls and the token fields the agent asked for --------------


def _stream(url: str, rollout_id: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    answer = httpx.post(f"{url}/r/{rollout_id}/v1/chat/completions", json=body, timeout=20)
    assert answer.status_code == 200, answer.text
    assert answer.text.endswith("data: [DONE]\n\n")
    return [orjson.loads(line[6:]) for line in answer.text.splitlines() if line.startswith("data: {")]


@pytest.mark.parametrize("field", ["reasoning", "reasoning_content"])
def test_the_streamed_replay_carries_reasoning_and_tool_calls(redis_url: str, field: Any) -> None:
    options = EngineOptions(seed=8, reasoning_field=field, tool_calls=True)
    with (
        running_server(EngineApp(options)) as engine,
        running_server(ProxyApp(proxy_config(redis_url, engine, prefix_mode="verify"))) as url,
    ):
        client = client_for(url, f"stream-{field}")
        plain = client.chat.completions.create(
            model="simulated", messages=MESSAGES, max_tokens=24, extra_body={"min_tokens": 8}, tools=TOOLS
        )
        chunks: list[ChatCompletionChunk] = list(
            client.chat.completions.create(
                model="simulated",
                messages=MESSAGES,
                max_tokens=24,
                extra_body={"min_tokens": 8},
                tools=TOOLS,
                stream=True,
            )
        )
    message = plain.choices[0].message
    assert (message.model_extra or {}).get(field)  # the engine's reasoning reached the agent, not streamed
    deltas = [chunk.choices[0].delta.model_extra or {} for chunk in chunks if chunk.choices]
    reasoning = "".join(delta.get(field) or "" for delta in deltas)
    calls = [call for chunk in chunks if chunk.choices for call in chunk.choices[0].delta.tool_calls or ()]
    assert reasoning, "the streamed replay lost the reasoning"
    assert [call.function.name for call in calls if call.function is not None] == ["lookup"]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_the_streamed_replay_carries_the_token_fields_asked_for(redis_url: str) -> None:
    with (
        running_server(EngineApp(EngineOptions(seed=2))) as engine,
        running_server(ProxyApp(proxy_config(redis_url, engine, prefix_mode="verify"))) as url,
    ):
        body = {"model": "simulated", "messages": MESSAGES, "max_tokens": 6, "stream": True}
        asked = _stream(url, "stream-asked", {**body, "return_token_ids": True, "logprobs": True})
        not_asked = _stream(url, "stream-not-asked", body)
        finish(url, "stream-asked", 1.0, asked[0]["id"])
    first, ending = asked[0], asked[-1]  # vLLM's layout: the prompt ids on the role chunk, the rest on the ending one
    assert ending["choices"][0]["logprobs"]["content"]  # the log-probs the agent asked for
    assert all(unset(event, "prompt_token_ids") and unset(event["choices"][0], "token_ids") for event in not_asked)
    assert not_asked[0]["choices"][0]["logprobs"] is None
    [pulled] = pull(redis_url, 1)
    assert pulled.row is not None
    assert first["prompt_token_ids"] + ending["choices"][0]["token_ids"] == list(pulled.row.token_ids)
    logprobs = [entry["logprob"] for entry in ending["choices"][0]["logprobs"]["content"]]
    assert [value for value, m in zip(pulled.row.logprobs, pulled.row.token_mask, strict=True) if m] == logprobs


@pytest.mark.parametrize("kind", ENGINES)
def test_an_answer_with_every_token_field_asked_for_reaches_the_agent_as_the_engine_wrote_it(
    redis_url: str, kind: str, request: pytest.FixtureRequest
) -> None:
    """An RL harness asks for ``logprobs`` and ``return_token_ids``: nothing is stripped, and the agent gets the
    engine's bytes as the logging hop saw them (vLLM writes its JSON with Python's ``json``), the call staged."""
    with ExitStack() as stack:
        engine = _engine(kind, request, stack)
        hop, hop_url = stack.enter_context(running_hop(engine.url))
        url = stack.enter_context(running_server(ProxyApp(proxy_config(redis_url, hop_url, prefix_mode="verify"))))
        body = {"model": engine.model, "messages": MESSAGES, "max_tokens": 8, "logit_bias": engine.hidden}
        answer = httpx.post(
            f"{url}/r/as-written-{kind}/v1/chat/completions",
            json={**body, "logprobs": True, "return_token_ids": True},
            timeout=60,
        )
        [exchange] = hop.on("/v1/chat/completions")
    assert answer.status_code == 200, answer.text
    assert answer.content == exchange.response_body
    assert answer.json()["choices"][0]["logprobs"]["content"]  # the token fields are there, as asked
    assert len(manifest(redis_url, f"as-written-{kind}").records) == 1


# --- 4. routed_experts: staged from the choice or the message, stripped unless asked ---------------------------


def _staged_extras(redis_url: str, rollout_id: str) -> dict[str, Any]:
    """The extras of the rollout's one staged record, fetched from the store (digest verified by the source)."""
    [record] = manifest(redis_url, rollout_id).records
    assert record.staging_key is not None
    source = RedisStagingSource.from_url(redis_url)
    try:
        [snapshot] = source.fetch([record.staging_key])
    finally:
        source.close()
    assert snapshot.extras is not None
    return snapshot.extras


def _decoded_npy(text: str) -> np.ndarray[Any, Any]:
    return np.load(io.BytesIO(base64.b64decode(text)), allow_pickle=False)  # type: ignore[no-any-return]


@pytest.mark.parametrize("place", ["choice", "message"])
@pytest.mark.parametrize("asked", [False, True], ids=["not-asked", "asked"])
def test_routed_experts_are_staged_and_stripped_unless_asked(redis_url: str, place: Any, asked: bool) -> None:
    rollout_id = f"experts-{place}-{asked}"
    with (
        running_server(EngineApp(EngineOptions(seed=4, routed_experts=place))) as engine,
        running_server(ProxyApp(proxy_config(redis_url, engine, prefix_mode="verify"))) as url,
    ):
        extra = {"return_token_ids": True} if asked else {}
        completion = client_for(url, rollout_id).chat.completions.create(
            model="simulated", messages=MESSAGES, max_tokens=6, extra_body=extra
        )
        staged = _staged_extras(redis_url, rollout_id)["routed_experts"]
        finish(url, rollout_id, 1.0, completion.id)
    choice_extra = completion.choices[0].model_extra or {}
    message_extra = completion.choices[0].message.model_extra or {}
    served = choice_extra.get("routed_experts") if place == "choice" else message_extra.get("routed_experts")
    assert (served is not None) is asked
    assert "routed_experts" not in (message_extra if place == "choice" else choice_extra)
    [pulled] = pull(redis_url, 1)
    assert pulled.row is not None
    if place == "choice":  # as vLLM 0.32 sends it: (num_tokens - 1, layers, k) over the whole sequence
        assert isinstance(staged, str)
        expected = routed_experts_array(list(pulled.row.token_ids)[:-1])
        assert np.array_equal(_decoded_npy(staged), expected)
    else:
        generated = [t for t, m in zip(pulled.row.token_ids, pulled.row.token_mask, strict=True) if m]
        assert staged == routed_experts_array(generated).tolist()
    if asked:
        assert served == staged


# --- 5. every failure logs its precise cause -----------------------------------------------------------------------


def test_drift_logs_the_token_index_and_both_ids(redis_url: str, caplog: pytest.LogCaptureFixture) -> None:
    with (
        running_server(EngineApp(EngineOptions(seed=1, drift=True))) as engine,
        running_server(ProxyApp(proxy_config(redis_url, engine, prefix_mode="verify"))) as url,
    ):
        client = client_for(url, "drift-log")
        messages: list[Any] = list(MESSAGES)
        first = client.chat.completions.create(
            model="simulated", messages=messages, max_tokens=16, extra_body={"min_tokens": 16}
        )
        text = first.choices[0].message.content or ""
        assert " " in text.rstrip(), "the seed must generate a space the drifting engine re-tokenizes"
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "more"}]
        client.chat.completions.create(model="simulated", messages=messages, max_tokens=4)
    prompt = EngineApp().render(MESSAGES)  # the first call's prompt, generation prompt included
    index = len(prompt) + next(i for i, ch in enumerate(text.encode()) if ch == 0x20)  # the first space drifts
    expected = f"prompt drifts from the gate-authorized prefix at token index {index}: expected id 48, received id "
    assert expected + f"{DRIFT_SPACE_ID}" in caplog.text, caplog.text
    assert [failure.reason for failure in manifest(redis_url, "drift-log").failures] == [WORKER_CAPTURE_FAILED_REASON]


def test_an_ambiguous_parent_logs_the_candidates(redis_url: str, caplog: pytest.LogCaptureFixture) -> None:
    """Two answers to one context whose content is empty (all reasoning) but whose ids differ: the next request
    matches both at the same depth, so its parent is ambiguous; the log names both candidates."""
    caplog.set_level(logging.WARNING)
    options = EngineOptions(seed=6, reasoning_field="reasoning")
    with (
        running_server(EngineApp(options)) as engine,
        running_server(ProxyApp(proxy_config(redis_url, engine, prefix_mode="verify"))) as url,
    ):
        client = client_for(url, "ambiguous-log")
        replies = [
            client.chat.completions.create(
                model="simulated", messages=MESSAGES, max_tokens=2, extra_body={"min_tokens": 2}
            )
            for _ in range(2)
        ]
        assert [reply.choices[0].message.content for reply in replies] == [None, None]  # all reasoning, as vLLM
        follow = [*MESSAGES, {"role": "assistant", "content": ""}, {"role": "user", "content": "next"}]
        client.chat.completions.create(model="simulated", messages=follow, max_tokens=4)
    rows = manifest(redis_url, "ambiguous-log")
    assert [failure.reason for failure in rows.failures] == [UNRESOLVED_PARENT_REASON]
    first, second = sorted(record.model_call_id for record in rows.records)
    assert len({record.cumulative_hash for record in rows.records}) == 2, "the seed must give two distinct replies"
    assert f"unresolved parent (ambiguous: candidates {first}, {second})" in caplog.text, caplog.text


# --- 6. fail-open: a body the proxy cannot parse is forwarded and the rollout records the failure --------------


class _LenientEngine:
    """An engine whose JSON parser is Python's (as vLLM's FastAPI server) over the simulated engine's answer."""

    def __init__(self) -> None:
        self.parsed = 0

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        from worker.asgi import read_body, send_body

        if scope["type"] != "http":
            return
        json.loads(await read_body(receive))
        self.parsed += 1
        answer = {
            "id": "chatcmpl-lenient",
            "object": "chat.completion",
            "created": 0,
            "model": "simulated",
            "prompt_token_ids": [1, 2, 3],
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "fine", "routed_experts": [[[1, 2]]]},
                    "logprobs": {"content": [{"token": "token_id:5", "logprob": -0.5, "top_logprobs": []}]},
                    "token_ids": [5],
                    "routed_experts": "AAAA",
                    "finish_reason": "stop",
                }
            ],
        }
        await send_body(send, 200, orjson.dumps(answer))


def test_fail_open_records_a_body_it_cannot_parse(redis_url: str, caplog: pytest.LogCaptureFixture) -> None:
    fields = {"model": "simulated", "messages": MESSAGES, "max_tokens": 4, "temperature_jitter": float("nan")}
    upstream = _LenientEngine()
    with running_server(upstream) as engine:
        proxy = ProxyApp(proxy_config(redis_url, engine, prefix_mode="verify"))
        with running_server(proxy) as url:
            answer = httpx.post(
                f"{url}/r/lenient-open/v1/chat/completions",
                content=json.dumps(fields).encode(),
                headers={"content-type": "application/json"},
                timeout=20,
            )
    assert answer.status_code == 200 and upstream.parsed == 1  # forwarded (fail-open)
    served = answer.json()
    choice = served["choices"][0]
    assert unset(served, "prompt_token_ids") and unset(choice, "token_ids", "routed_experts")
    assert choice["logprobs"] is None and "routed_experts" not in choice["message"]
    assert [failure.reason for failure in manifest(redis_url, "lenient-open").failures] == [
        WORKER_CAPTURE_FAILED_REASON
    ]
    assert proxy.metrics.counts["capture_failed"] == 1
    assert "request not captured (" in caplog.text
    assert "forwarded uncaptured; recorded worker_capture_failed" in caplog.text


def test_the_engine_command_emits_choice_level_routed_experts_and_reasoning() -> None:
    """``staging-sink engine --routed-experts choice --reasoning-field reasoning`` answers as vLLM 0.32 does."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = ("engine", "--port", str(port), "--routed-experts", "choice", "--reasoning-field", "reasoning")
    with service(*argv, health=f"{url}/health"):
        body = {"model": "simulated", "messages": MESSAGES, "max_tokens": 6, "return_token_ids": True}
        answer = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=20).json()
    choice = answer["choices"][0]
    sequence = answer["prompt_token_ids"] + choice["token_ids"]
    experts = _decoded_npy(choice["routed_experts"])
    assert experts.shape == (len(sequence) - 1, 2, 2)
    assert np.array_equal(experts, routed_experts_array(sequence[:-1]))
    assert choice["message"]["reasoning"] and "routed_experts" not in choice["message"]
