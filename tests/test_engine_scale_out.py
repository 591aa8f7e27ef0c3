"""The token-in/token-out routes (render, generate, derender), the weight routes and errors, pinned on the real
vLLM 0.32 (the ``vllm`` tier) and checked on the simulated engine with the same test bodies (the fast tier).

What a real vLLM 0.32.0 (``--enable-scale-out``, ``VLLM_SERVER_DEV_MODE=1``) does, as these tests pin it:

* ``POST /v1/chat/completions/render`` returns a generate request: ``{request_id, token_ids, sampling_params,
  model, output_mode: "tokens", stream, ...}``; ``sampling_params.max_tokens`` is the request's, ``logprobs: 0``
  when the request asked for log-probs;
* ``POST /inference/v1/generate`` answers ``choices[0] = {token_ids, logprobs.content[*] = {token_id, logprob,
  rank, top_logprobs}, finish_reason, stop_reason, weight_versions: [{version, start, end}]}`` plus ``usage``;
  streamed, every chunk carries its own ids and log-probs, only the last one ``finish_reason`` and the
  ``weight_versions`` spans over the whole output, then ``data: [DONE]``; ``prompt_token_ids`` is null;
* ``POST /v1/chat/completions/derender`` turns that answer back into a ``chat.completion`` (log-probs with token
  strings, ``message.content`` the decoded text, ``""`` for an empty reply); streamed, one call per generate chunk
  with the ``stream_state`` carried from the previous answer returns ``{chunk, stream_state}``, the first chunk's
  delta has ``role: "assistant"``;
* with vLLM's pythonic tool-call parser (the ``tools`` variant), derender of a generation holding ``[lookup(q='x')]``
  returns it as ``message.tool_calls`` with ``finish_reason`` as given (``stop``); the chat route says ``tool_calls``;
* ``/v1/completions`` with a token-id prompt echoes the prompt in ``choices[0].prompt_token_ids``;
* ``GET /weight_info`` is ``{"weight_version": "default"}`` until ``POST /update_weight_version
  {"new_version": s}`` (answer ``{"success": true, "new_version": s}``), and then generate's spans carry ``s``;
* a prompt over the context is a 400 ``BadRequestError`` on render, generate and chat completions.
"""

from __future__ import annotations

import json
from array import array
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from sink_tools.simulated.http_app import EngineApp
from sink_tools.simulated.options import EngineOptions
from tests.helpers.scale_out import (
    ScaleOutEngine,
    engine_call,
    engine_get,
    post,
    simulated_engine,
    stream,
    vllm_engine,
)
from tests.helpers.vllm_server import VllmServer
from tests.helpers.vllm_shapes import TOOL_CALL, TOOLS
from worker.asgi import Receive, Scope, Send, error_body, read_body, send_body, send_json
from worker.proxy.exact.probe import probe_exact_prefix
from worker.proxy.serve import running_server

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi."}]
MAX_MODEL_LEN = 1024


def _engine(request: pytest.FixtureRequest, variant: str) -> Iterator[ScaleOutEngine]:
    if request.param == "vllm":
        server: VllmServer = request.getfixturevalue(f"vllm_{variant}")
        yield vllm_engine(server)
        return
    with running_server(EngineApp(EngineOptions(seed=3, scale_out=True, max_model_len=MAX_MODEL_LEN))) as url:
        yield simulated_engine(url)


@pytest.fixture(params=["simulated", pytest.param("vllm", marks=pytest.mark.vllm)])
def engine(request: pytest.FixtureRequest) -> Iterator[ScaleOutEngine]:
    yield from _engine(request, "chatml")


@pytest.fixture(params=["simulated", pytest.param("vllm", marks=pytest.mark.vllm)])
def tools_engine(request: pytest.FixtureRequest) -> Iterator[ScaleOutEngine]:
    """An engine with vLLM's pythonic tool-call parser (the real one: the ``tools`` model variant)."""
    yield from _engine(request, "tools")


def render(engine: ScaleOutEngine, **fields: Any) -> dict[str, Any]:
    body = {"model": engine.model, "messages": MESSAGES, "max_tokens": 8, "logprobs": True, **fields}
    answer = post(engine, "/v1/chat/completions/render", body)
    assert answer.status_code == 200, answer.text
    rendered: dict[str, Any] = answer.json()
    return rendered


def generate(engine: ScaleOutEngine, request: dict[str, Any]) -> dict[str, Any]:
    answer = post(engine, "/inference/v1/generate", request)
    assert answer.status_code == 200, answer.text
    generated: dict[str, Any] = answer.json()
    return generated


def test_render_returns_a_generate_request(engine: ScaleOutEngine) -> None:
    rendered = render(engine, max_tokens=5)
    ids = rendered["token_ids"]
    assert isinstance(ids, list) and all(type(token) is int for token in ids)
    assert ids[-len(engine.generation_prompt) :] == engine.generation_prompt
    assert ids.count(engine.eot_id) == len(MESSAGES)  # one end-of-turn per rendered message
    assert rendered["output_mode"] == "tokens" and rendered["stream"] is False
    assert rendered["sampling_params"]["max_tokens"] == 5 and rendered["sampling_params"]["logprobs"] == 0
    assert rendered["model"] == engine.model and isinstance(rendered["request_id"], str)
    assert render(engine, stream=True)["stream"] is True


def test_generate_answers_ids_logprobs_and_weight_spans(engine: ScaleOutEngine) -> None:
    rendered = render(engine)
    answer = generate(engine, rendered)
    [choice] = answer["choices"]
    ids = choice["token_ids"]
    assert 1 <= len(ids) <= 8 and all(type(token) is int for token in ids)
    content = choice["logprobs"]["content"]
    assert [entry["token_id"] for entry in content] == ids
    assert all(isinstance(entry["logprob"], float) and entry["logprob"] <= 0.0 for entry in content)
    assert choice["finish_reason"] in ("stop", "length")
    if choice["finish_reason"] == "stop":
        assert ids[-1] == engine.eot_id and choice["stop_reason"] is None
    else:
        assert len(ids) == 8
    assert choice["weight_versions"] == [{"version": "default", "start": 0, "end": len(ids)}]
    assert answer["usage"]["completion_tokens"] == len(ids)
    assert answer["usage"]["prompt_tokens"] == len(rendered["token_ids"])


def _binary32(value: float) -> bool:
    """Whether *value* is a binary32 value widened to a double (what a float32 tensor's ``tolist()`` gives)."""
    return array("f", [value])[0] == value


def test_every_log_prob_is_a_float32_value(engine: ScaleOutEngine) -> None:
    """vLLM computes log-probs in float32: every one it answers, on the generate and chat routes and among the
    ``top_logprobs``, is a binary32 value. A record of them stores 4 bytes per log-prob, not 8, and a proxy's
    benchmark on the simulated engine then takes the path a real vLLM's answers take."""
    generated = generate(engine, render(engine, max_tokens=48, min_tokens=48, top_logprobs=2))
    entries = generated["choices"][0]["logprobs"]["content"]
    answer = post(
        engine,
        "/v1/chat/completions",
        {"model": engine.model, "messages": MESSAGES, "max_tokens": 48, "min_tokens": 48, "logprobs": True,
         "top_logprobs": 2},
    )  # fmt: skip
    assert answer.status_code == 200, answer.text
    entries += answer.json()["choices"][0]["logprobs"]["content"]
    values = [entry["logprob"] for entry in entries]
    values += [top["logprob"] for entry in entries for top in entry["top_logprobs"]]
    assert len(values) >= 2 * 48 * 3
    assert [value for value in values if not _binary32(value)] == []


def test_generate_streams_per_chunk_ids_and_final_spans(engine: ScaleOutEngine) -> None:
    rendered = render(engine, stream=True, max_tokens=6)
    chunks = stream(engine, "/inference/v1/generate", rendered)
    choices = [chunk["choices"][0] for chunk in chunks]
    assert all(chunk["output_mode"] == "tokens" for chunk in chunks)
    for choice in choices:
        assert [entry["token_id"] for entry in choice["logprobs"]["content"]] == choice["token_ids"]
    ids = [token for choice in choices for token in choice["token_ids"]]
    assert 1 <= len(ids) <= 6
    assert [choice["finish_reason"] for choice in choices[:-1]] == [None] * (len(choices) - 1)
    assert choices[-1]["finish_reason"] in ("stop", "length")
    assert [choice["weight_versions"] for choice in choices[:-1]] == [None] * (len(choices) - 1)
    assert choices[-1]["weight_versions"] == [{"version": "default", "start": 0, "end": len(ids)}]


def test_derender_returns_the_chat_completion_of_the_ids(engine: ScaleOutEngine) -> None:
    rendered = render(engine)
    generated = generate(engine, rendered)
    body = {"model": engine.model, "generate_response": generated, "prompt_token_ids": rendered["token_ids"]}
    answer = post(engine, "/v1/chat/completions/derender", body)
    assert answer.status_code == 200, answer.text
    completion = answer.json()
    [choice] = completion["choices"]
    ids = generated["choices"][0]["token_ids"]
    assert completion["object"] == "chat.completion"
    assert choice["message"]["role"] == "assistant" and choice["message"]["content"] == engine.decode(ids)
    assert choice["finish_reason"] == generated["choices"][0]["finish_reason"]
    logprobs = [entry["logprob"] for entry in choice["logprobs"]["content"]]
    assert logprobs == [entry["logprob"] for entry in generated["choices"][0]["logprobs"]["content"]]
    assert all(isinstance(entry["token"], str) for entry in choice["logprobs"]["content"])


def test_derender_streams_with_a_carried_state(engine: ScaleOutEngine) -> None:
    rendered = render(engine, stream=True, max_tokens=6)
    chunks = stream(engine, "/inference/v1/generate", rendered)
    state: Any = None
    deltas: list[dict[str, Any]] = []
    for chunk in chunks:
        body = {
            "stream": True,
            "model": engine.model,
            "generate_chunk": chunk,
            "stream_state": state,
            "prompt_token_ids": rendered["token_ids"],
        }
        answer = post(engine, "/v1/chat/completions/derender", body)
        assert answer.status_code == 200, answer.text
        out = answer.json()
        assert out["chunk"]["object"] == "chat.completion.chunk"
        state = out["stream_state"]
        assert isinstance(state, dict) and state["role_sent"] is True
        deltas.append(out["chunk"]["choices"][0])
    ids = [token for chunk in chunks for token in chunk["choices"][0]["token_ids"]]
    assert deltas[0]["delta"]["role"] == "assistant"
    assert "".join(delta["delta"]["content"] or "" for delta in deltas) == engine.decode(ids)
    assert deltas[-1]["finish_reason"] == chunks[-1]["choices"][0]["finish_reason"]
    streamed = [entry["logprob"] for delta in deltas for entry in delta["logprobs"]["content"]]
    assert streamed == [entry["logprob"] for c in chunks for entry in c["choices"][0]["logprobs"]["content"]]


def test_derender_returns_the_tool_call_the_generation_holds(tools_engine: ScaleOutEngine) -> None:
    """A generation constrained to a pythonic call comes back from derender as ``tool_calls`` (``finish_reason`` as
    given: ``stop``), and from the chat route with ``finish_reason: "tool_calls"``."""
    request = {
        "model": tools_engine.model,
        "messages": MESSAGES,
        "tools": TOOLS,
        "max_tokens": 30,
        "structured_outputs": {"choice": [TOOL_CALL]},
    }
    answer = post(tools_engine, "/v1/chat/completions/render", request)
    assert answer.status_code == 200, answer.text
    rendered = answer.json()
    generated = generate(tools_engine, rendered)
    choice = generated["choices"][0]
    assert choice["token_ids"][-1] == tools_engine.eot_id and choice["finish_reason"] == "stop"
    shown = {**choice, "token_ids": choice["token_ids"][:-1], "logprobs": None}  # the end-of-turn is not text
    body = {
        "model": tools_engine.model,
        "generate_response": {**generated, "choices": [shown]},
        "prompt_token_ids": rendered["token_ids"],
        "chat_request": request,
    }
    answer = post(tools_engine, "/v1/chat/completions/derender", body)
    assert answer.status_code == 200, answer.text
    [derendered] = answer.json()["choices"]
    calls = [
        (call["function"]["name"], json.loads(call["function"]["arguments"]))
        for call in derendered["message"]["tool_calls"]
    ]
    assert calls == [("lookup", {"q": "x"})]
    assert derendered["message"]["content"] is None and derendered["finish_reason"] == "stop"
    answer = post(tools_engine, "/v1/chat/completions", request)
    assert answer.status_code == 200, answer.text
    [chat] = answer.json()["choices"]
    assert chat["finish_reason"] == "tool_calls" and chat["message"]["content"] is None
    assert [call["function"]["name"] for call in chat["message"]["tool_calls"]] == ["lookup"]


def _chat_ids(engine: ScaleOutEngine, **fields: Any) -> list[int]:
    body = {"model": engine.model, "messages": MESSAGES, "return_token_ids": True, **fields}
    answer = post(engine, "/v1/chat/completions", body)
    assert answer.status_code == 200, answer.text
    ids: list[int] = answer.json()["choices"][0]["token_ids"]
    return ids


def _generated_ids(engine: ScaleOutEngine, **fields: Any) -> list[int]:
    """Render *fields*, then generate with the agent's ``max_tokens`` set explicitly (as the proxy does)."""
    rendered = render(engine, **fields)
    rendered["sampling_params"]["max_tokens"] = fields["max_tokens"]
    ids: list[int] = generate(engine, rendered)["choices"][0]["token_ids"]
    return ids


DETERMINISTIC: dict[str, dict[str, Any]] = {
    "greedy": {"temperature": 0.0, "max_tokens": 12},
    "seed": {"temperature": 1.0, "seed": 5, "max_tokens": 16},
    "greedy-stop": {"temperature": 0.0, "max_tokens": 20, "stop": ["a", "e"]},
    "seed-min-tokens": {"temperature": 0.9, "seed": 2, "max_tokens": 10, "min_tokens": 6},
}


@pytest.mark.parametrize("name", sorted(DETERMINISTIC))
def test_greedy_and_seeded_requests_generate_the_same_ids_every_time(engine: ScaleOutEngine, name: str) -> None:
    """Greedy decoding, or a request ``seed``, gives the same ids on every call, on the chat route and on render then
    generate; and the chat route generates exactly what render then generate generate for the same request."""
    fields = DETERMINISTIC[name]
    chat = [_chat_ids(engine, **fields) for _ in range(2)]
    generated = [_generated_ids(engine, **fields) for _ in range(2)]
    assert chat[0] == chat[1] and generated[0] == generated[1]
    assert chat[0] == generated[0]


def test_greedy_completions_generate_the_same_ids_every_time(engine: ScaleOutEngine) -> None:
    prompt = render(engine)["token_ids"]
    body = {"model": engine.model, "prompt": prompt, "max_tokens": 8, "temperature": 0.0, "return_token_ids": True}
    answers = [post(engine, "/v1/completions", body) for _ in range(2)]
    assert all(answer.status_code == 200 for answer in answers), answers[0].text
    first, second = (answer.json()["choices"][0]["token_ids"] for answer in answers)
    assert first == second and 1 <= len(first) <= 8


def test_unseeded_sampling_draws_anew_on_every_call(engine: ScaleOutEngine) -> None:
    """Without greedy decoding or a ``seed``, two identical requests sample two different generations."""
    fields: dict[str, Any] = {"temperature": 1.0, "max_tokens": 16, "logit_bias": {str(engine.eot_id): -100.0}}
    assert _chat_ids(engine, **fields) != _chat_ids(engine, **fields)
    assert _generated_ids(engine, **fields) != _generated_ids(engine, **fields)


def test_completions_take_a_token_id_prompt(engine: ScaleOutEngine) -> None:
    prompt = render(engine)["token_ids"]
    body = {"model": engine.model, "prompt": prompt, "max_tokens": 4, "logprobs": 0, "return_token_ids": True}
    answer = post(engine, "/v1/completions", body)
    assert answer.status_code == 200, answer.text
    [choice] = answer.json()["choices"]
    assert choice["prompt_token_ids"] == prompt
    assert 1 <= len(choice["token_ids"]) <= 4
    assert len(choice["logprobs"]["token_logprobs"]) == len(choice["token_ids"])


def test_weight_version_routes_label_the_spans(engine: ScaleOutEngine) -> None:
    assert httpx.get(engine.url + "/weight_info").json() == {"weight_version": "default"}
    try:
        answer = post(engine, "/update_weight_version", {"new_version": "3"})
        assert answer.status_code == 200 and answer.json() == {"success": True, "new_version": "3"}
        assert httpx.get(engine.url + "/weight_info").json() == {"weight_version": "3"}
        spans = generate(engine, render(engine))["choices"][0]["weight_versions"]
        assert [span["version"] for span in spans] == ["3"] and spans[0]["start"] == 0
    finally:
        post(engine, "/update_weight_version", {"new_version": "default"})


def test_a_prompt_over_the_context_is_a_400(engine: ScaleOutEngine) -> None:
    long_messages = [{"role": "user", "content": "a" * MAX_MODEL_LEN}]
    body = {"model": engine.model, "messages": long_messages, "max_tokens": 4}
    for path in ("/v1/chat/completions/render", "/v1/chat/completions"):
        answer = post(engine, path, body)
        assert answer.status_code == 400, answer.text
        assert answer.json()["error"]["type"] == "BadRequestError" and answer.json()["error"]["code"] == 400
    for path in ("/v1/chat/completions/render", "/v1/chat/completions"):
        answer = post(engine, path, {"model": engine.model, "messages": MESSAGES, "max_tokens": 100_000})
        assert answer.status_code == 400 and "max_tokens" in answer.json()["error"]["message"], answer.text
    request = render(engine)
    request["token_ids"] = request["token_ids"] * (MAX_MODEL_LEN // len(request["token_ids"]) + 1)
    answer = post(engine, "/inference/v1/generate", request)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["type"] == "BadRequestError"


def test_scale_out_routes_answer_403_when_disabled() -> None:
    with running_server(EngineApp(EngineOptions())) as url:
        engine = simulated_engine(url)
        for path in ("/v1/chat/completions/render", "/inference/v1/generate", "/v1/chat/completions/derender"):
            answer = post(engine, path, {"model": "simulated", "messages": MESSAGES})
            assert answer.status_code == 403, answer.text
            error = answer.json()["error"]
            assert error["type"] == "PermissionDeniedError" and "--enable-scale-out" in error["message"]


@pytest.mark.anyio
async def test_the_probe_finds_exact_mode_and_the_end_of_turn(engine: ScaleOutEngine) -> None:
    async with httpx.AsyncClient(timeout=120) as client:
        probe = await probe_exact_prefix(engine_call(client, engine.url), engine_get(client, engine.url))
    assert probe.mode == "exact", probe.reason
    assert probe.eot_ids == {engine.eot_id} and probe.model == engine.model


@pytest.mark.anyio
async def test_the_probe_keeps_verify_mode_with_the_reason() -> None:
    async with httpx.AsyncClient(timeout=20) as client:
        with running_server(EngineApp(EngineOptions())) as url:
            probe = await probe_exact_prefix(engine_call(client, url), engine_get(client, url))
            assert probe.mode == "verify" and "--enable-scale-out" in probe.reason
        with running_server(_old_engine) as url:
            probe = await probe_exact_prefix(engine_call(client, url), engine_get(client, url))
            assert probe.mode == "verify" and "answered 404" in probe.reason


async def _old_engine(scope: Scope, receive: Receive, send: Send) -> None:
    """An OpenAI-compatible engine older than the token-in/token-out routes: 404 on them."""
    if scope["type"] != "http":
        return
    await read_body(receive)
    if scope["path"] == "/v1/models":
        await send_json(send, 200, {"object": "list", "data": [{"id": "old", "object": "model"}]})
        return
    await send_body(send, 404, error_body(404, "Not Found", "NotFoundError"))
