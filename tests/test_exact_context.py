"""Exact-prefix mode splices a continuation onto its parent only when everything before the parent's reply renders
as it did for the parent, and stages each call's sampling provenance.

The gate resolves a parent from the conversation's fingerprints, which leave system and developer messages out
(contract §6.4: their content is volatile); a splice would then send the engine the parent's old system prompt. Here
an agent edits its system message (or, on the real tool template, its tools) between two turns: the engine must see
what the agent sent; under ``single`` the rollout is poisoned (its capture failed, with the cause logged), under
``roots`` the call starts a new chain and both chains train.

Both tiers: the simulated engine (fast) and the real vLLM 0.32 (``vllm``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import ExitStack
from typing import Any

import httpx
import pytest

from tests.helpers.logging_hop import LoggingHop, running_hop
from tests.helpers.proxy import client_for, close_clients, finish, manifest, proxy_config, pull
from tests.helpers.tier_engine import tier_engine
from worker.proxy.app import ProxyApp
from worker.proxy.serve import running_server

TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {}}}}]
OTHER_TOOLS = [{"type": "function", "function": {"name": "search", "parameters": {"type": "object", "properties": {}}}}]


@pytest.fixture(autouse=True)
def _clients() -> Iterator[None]:
    yield
    close_clients()


EDITS: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    # name: (model variant, what turn 1 sends, what turn 2 sends instead)
    "system": (
        "chatml",
        {"system": "Answer in FRENCH."},
        {"system": "Answer in GERMAN."},
    ),
    "tools": ("tools", {"system": "Be terse.", "tools": TOOLS}, {"system": "Be terse.", "tools": OTHER_TOOLS}),
}
CASES = [
    pytest.param("simulated", "system", id="simulated-system"),
    pytest.param("vllm", "system", marks=pytest.mark.vllm, id="vllm-system"),
    pytest.param("vllm", "tools", marks=pytest.mark.vllm, id="vllm-tools"),
]


def _turn(base: str, rollout: str, model: str, bias: dict[str, float], setup: dict[str, Any], history: list[Any]) -> Any:
    client = client_for(base, rollout)
    create: Any = client.chat.completions.create
    messages = [{"role": "system", "content": setup["system"]}, *history]
    extra = {"logit_bias": bias} if bias else {}
    tools = {"tools": setup["tools"]} if "tools" in setup else {}
    return create(
        model=model,
        messages=messages,
        max_tokens=8,
        temperature=0.0,
        extra_body=extra,
        extra_headers=setup.get("headers", {}),
        **tools,
    )


def _rendered(url: str, model: str, setup: dict[str, Any], history: list[Any]) -> list[int]:
    body: dict[str, Any] = {"model": model, "messages": [{"role": "system", "content": setup["system"]}, *history]}
    if "tools" in setup:
        body["tools"] = setup["tools"]
    answer = httpx.post(f"{url}/v1/chat/completions/render", json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    ids: list[int] = answer.json()["token_ids"]
    return ids


def _generate_prompts(hop: LoggingHop) -> list[list[int]]:
    return [exchange.request_json()["token_ids"] for exchange in hop.on("/inference/v1/generate")]


@pytest.mark.parametrize(("kind", "edit"), CASES)
@pytest.mark.parametrize("policy", ["single", "roots"])
def test_an_edited_context_is_never_spliced_onto_the_old_one(
    kind: str, edit: str, policy: str, scenario_redis_url: str, request: pytest.FixtureRequest,
    caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    caplog.set_level(logging.WARNING, logger="worker.proxy.captured_call")
    variant, before, after = EDITS[edit]
    headers = {"X-Staging-Chains": policy}
    before, after = {**before, "headers": headers}, {**after, "headers": headers}
    rollout = f"context-{edit}-{kind}-{policy}"
    with ExitStack() as stack:
        engine = tier_engine(kind, variant, request, stack, seed=6)
        url, model, bias = engine.url, engine.model, engine.bias()
        hop, hop_url = stack.enter_context(running_hop(url))
        base = stack.enter_context(running_server(ProxyApp(proxy_config(scenario_redis_url, hop_url))))
        history: list[Any] = [{"role": "user", "content": "Go."}]
        first = _turn(base, rollout, model, bias, before, history)
        history += [{"role": "assistant", "content": first.choices[0].message.content or ""}, {"role": "user", "content": "More."}]
        second = _turn(base, rollout, model, bias, after, history)
        assert second.choices[0].message is not None  # served: the agent got its answer
        # The engine generated the second turn from what the agent sent (the edited context), not the old one.
        assert _generate_prompts(hop)[-1] == _rendered(url, model, after, history)
        finish(base, rollout, 1.0, second.id)
    assert "not a continuation of call" in caplog.text
    shown = manifest(scenario_redis_url, rollout)
    [pulled] = pull(scenario_redis_url, 1)
    if policy == "single":
        assert [failure.reason for failure in shown.failures] == ["worker_capture_failed"]
        assert pulled.row is None and pulled.skip_code == "rollout_failed", pulled.skip_reason
        return
    assert not shown.failures and [record.parent_call_id for record in shown.records] == [None, None]
    assert pulled.chains is not None and [row.chain_index for row in pulled.rows] == [0, 1], pulled.chain_skips
    assert [list(row.token_ids) for row in pulled.rows] == [
        prompt + list(answer) for prompt, answer in zip(_generate_prompts(hop), _generated(hop), strict=True)
    ]


def _generated(hop: LoggingHop) -> list[list[int]]:
    return [exchange.response_json()["choices"][0]["token_ids"] for exchange in hop.on("/inference/v1/generate")]


@pytest.mark.parametrize("kind", ["simulated", pytest.param("vllm", marks=pytest.mark.vllm)])
def test_an_unchanged_context_is_spliced_and_every_call_says_how_it_was_sampled(
    kind: str, scenario_redis_url: str, request: pytest.FixtureRequest
) -> None:
    setup = {"system": "Be terse."}
    rollout = f"context-same-{kind}"
    with ExitStack() as stack:
        engine = tier_engine(kind, "chatml", request, stack, seed=6)
        url, model, bias = engine.url, engine.model, engine.bias()
        base = stack.enter_context(running_server(ProxyApp(proxy_config(scenario_redis_url, url))))
        history: list[Any] = [{"role": "user", "content": "Go."}]
        first = _turn(base, rollout, model, bias, setup, history)
        history += [{"role": "assistant", "content": first.choices[0].message.content or ""}, {"role": "user", "content": "More."}]
        second = _turn(base, rollout, model, bias, setup, history)
        finish(base, rollout, 1.0, second.id)
    [pulled] = pull(scenario_redis_url, 1)
    assert pulled.row is not None and len(pulled.row.model_call_ids) == 2, pulled.skip_reason
    assert pulled.row.provenance_known
    for provenance in pulled.row.sampling:
        assert provenance is not None and provenance.source == "engine"
        assert provenance.temperature == 0.0 and provenance.max_tokens == 8 and provenance.constraint is None
        assert provenance.logit_bias is bool(bias)
