"""Exact-prefix mode against the real vLLM 0.32 (the ``vllm`` tier): the splice rule on the real templates (ChatML,
the template that drops earlier reasoning, the tool template) with parents that stopped on a stop string, ran with
``ignore_eos`` or ended inside their reasoning, and :func:`worker.proxy.exact.chat.exact_chat` answering a root call as
vLLM's own chat route does (same seed: same ids, same parsed message)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.helpers.scale_out import engine_call
from tests.helpers.vllm_server import VllmServer
from worker.proxy.exact.chat import RENDER_PATH, EngineTraits, Parent, exact_chat, render_chat
from worker.proxy.exact.splice import count_end_of_turn, splice_exact_prompt

pytestmark = [pytest.mark.anyio, pytest.mark.vllm]

SYSTEM = {"role": "system", "content": "You are terse."}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]
NO_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<think>")


def bias(server: VllmServer, **extra: float) -> dict[str, float]:
    """A logit bias that keeps the tiny model off specials that its text would hide (plus *extra* by token)."""
    out = {str(server.id_of(token)): -100.0 for token in NO_SPECIALS}
    out.update({str(server.id_of(token)): value for token, value in extra.items()})
    return out


PARENTS: dict[str, dict[str, Any]] = {
    "stop-string": {"stop": ["e", "t", "a", "o"], "max_tokens": 80},
    "ignore-eos": {"ignore_eos": True, "max_tokens": 12},
    "eos": {"max_tokens": 40},
}


async def render_ids(client: httpx.AsyncClient, server: VllmServer, **body: Any) -> list[int]:
    answer = await client.post(server.url + RENDER_PATH, json={"model": server.model, "max_tokens": 4, **body})
    assert answer.status_code == 200, answer.text
    ids: list[int] = answer.json()["token_ids"]
    return ids


@pytest.mark.parametrize("variant", ["chatml", "reasoning", "tools"])
@pytest.mark.parametrize("kind", sorted(PARENTS))
async def test_splice_on_the_real_templates(variant: str, kind: str, request: pytest.FixtureRequest) -> None:
    server: VllmServer = request.getfixturevalue(f"vllm_{variant}")
    eot = server.id_of("<|im_end|>")
    extra_bias = {"<|im_end|>": 4.0} if kind != "stop-string" else {"<|im_end|>": -100.0}
    if variant == "reasoning":
        extra_bias["</think>"] = 2.0
    tools = {"tools": TOOLS} if variant == "tools" else {}
    messages: list[dict[str, Any]] = [SYSTEM, {"role": "user", "content": "Go."}]
    first = {"model": server.model, "messages": messages, "seed": 11, "logit_bias": bias(server, **extra_bias)}
    async with httpx.AsyncClient(timeout=120) as client:
        call = engine_call(client, server.url)
        traits = EngineTraits(frozenset({eot}))
        answer = await exact_chat(call, {**first, **PARENTS[kind], **tools}, parent=None, traits=traits)
        assert answer.status == 200, answer.payload
        choice = answer.payload["choices"][0]
        generated = choice["token_ids"]
        parent = answer.payload["prompt_token_ids"] + generated
        if kind == "stop-string":
            assert isinstance(choice["stop_reason"], str) and generated[-1] != eot
        if kind == "ignore-eos":
            assert eot in generated[:-1], "the seeded parent must hold an end-of-turn inside its output"
        reply: dict[str, Any] = {"role": "assistant", "content": choice["message"]["content"] or ""}
        new: list[dict[str, Any]] = [{"role": "user", "content": "More."}]
        if variant == "tools":
            call_id = "call_0"
            function = {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
            reply["tool_calls"] = [{"id": call_id, "type": "function", "function": function}]
            new = [{"role": "tool", "tool_call_id": call_id, "content": "sunny"}]
        history = [*messages, reply]
        full = await render_ids(client, server, messages=history + new, **tools)
        counted = count_end_of_turn(
            await render_ids(client, server, messages=history, add_generation_prompt=False, **tools), {eot}
        )
        spliced = splice_exact_prompt(full, history_eot_count=counted, eot_ids={eot}, parent_ids=parent)
        closing = [] if generated[-1] == eot else [eot]
        alone = await render_ids(client, server, messages=new)  # the new turns as the template renders them
        assert spliced == parent + closing + server.encode("\n") + alone
        # Where re-templating the history would have drifted. (With a tool parser vLLM keeps special tokens in the
        # text, so an ignore_eos reply's end-of-turns come back as text that re-tokenizes to the same ids.)
        if kind == "stop-string" or variant == "reasoning" or (kind == "ignore-eos" and variant == "chatml"):
            assert full[: len(parent)] != parent, "re-templating this history would have drifted"
        rendered = await client.post(server.url + RENDER_PATH, json={"model": server.model, "messages": history + new})
        generate = {**rendered.json(), "token_ids": spliced}
        assert (await client.post(server.url + "/inference/v1/generate", json=generate)).status_code == 200


ROOT_CASES: dict[str, dict[str, Any]] = {
    "stop-string": {"stop": ["q", "w"], "max_tokens": 24},
    "eos": {"max_tokens": 24},
    "tool-call": {"max_tokens": 30, "structured_outputs": {"choice": ["[get_weather(city='Oslo')]"]}},
}


@pytest.mark.parametrize(
    ("variant", "case"),
    [(v, c) for v in ("chatml", "reasoning", "tools") for c in ("stop-string", "eos")] + [("tools", "tool-call")],
)
async def test_a_root_call_answers_as_the_chat_route_does(
    variant: str, case: str, request: pytest.FixtureRequest
) -> None:
    server: VllmServer = request.getfixturevalue(f"vllm_{variant}")
    eot = server.id_of("<|im_end|>")
    extra = {"</think>": 2.0} if variant == "reasoning" else {}
    if case == "eos":
        extra["<|im_end|>"] = 3.0
    body: dict[str, Any] = {
        "model": server.model,
        "messages": [SYSTEM, {"role": "user", "content": "Go."}],
        "seed": 5,
        "logit_bias": bias(server, **extra),
        **ROOT_CASES[case],
        **({"tools": TOOLS} if variant == "tools" else {}),
    }
    async with httpx.AsyncClient(timeout=120) as client:
        direct = await client.post(
            server.url + "/v1/chat/completions", json={**body, "return_token_ids": True, "logprobs": True}
        )
        assert direct.status_code == 200, direct.text
        traits = EngineTraits(frozenset({eot}))
        answer = await exact_chat(engine_call(client, server.url), body, parent=None, traits=traits)
    expected, got = direct.json(), answer.payload
    assert got["prompt_token_ids"] == expected["prompt_token_ids"]
    [want], [have] = expected["choices"], got["choices"]
    assert have["token_ids"] == want["token_ids"]
    if case == "eos":
        assert have["token_ids"][-1] == eot and have["stop_reason"] is None
    for field in ("content", "reasoning"):
        assert have["message"].get(field) == want["message"].get(field), field
    calls = [{**call, "id": None} for call in have["message"].get("tool_calls") or ()]
    assert calls == [{**call, "id": None} for call in want["message"].get("tool_calls") or ()]
    if case == "tool-call":
        assert [call["function"]["name"] for call in calls] == ["get_weather"]
    assert have["finish_reason"] == want["finish_reason"] and have["stop_reason"] == want["stop_reason"]
    assert [e["logprob"] for e in have["logprobs"]["content"]] == pytest.approx(
        [e["logprob"] for e in want["logprobs"]["content"]], abs=1e-4
    )
    assert have["weight_versions"] == [{"version": "default", "start": 0, "end": len(have["token_ids"])}]


async def test_an_over_long_continuation_is_the_engines_400(vllm_chatml: VllmServer) -> None:
    server = vllm_chatml
    eot = server.id_of("<|im_end|>")
    history = [SYSTEM, {"role": "user", "content": "Go."}, {"role": "assistant", "content": "ok"}]
    request = {"model": server.model, "messages": [*history, {"role": "user", "content": "x"}], "max_tokens": 4}
    async with httpx.AsyncClient(timeout=120) as client:
        call = engine_call(client, server.url)
        rendering = await render_chat(call, request, {eot})
        parent = Parent([5] * 1100, rendering.history_context)
        traits = EngineTraits(frozenset({eot}))
        answer = await exact_chat(call, request, parent=parent, traits=traits, rendering=rendering)
    assert answer.status == 400 and answer.spliced
    assert answer.payload["error"]["type"] == "BadRequestError"
