"""``/v1/completions`` in exact-prefix mode: a prompt that extends a captured call's exact text (its prompt, then the
text it served) is sent as token ids (the parent's exact staged sequence, then the engine-tokenized suffix), so
multi-turn completions with stop strings chain and train exactly. The official ``openai`` client -> the proxy -> a
logging hop -> the simulated engine (fast tier) or the real vLLM 0.32 (``vllm`` tier)."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from contextlib import ExitStack
from typing import Any

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from sink.trainer.pulled import PulledRollout
from sink_tools.simulated.http_app import EngineApp
from sink_tools.simulated.options import EngineOptions
from tests.helpers.engine_truth import Generated, assert_row_is_exact, generations
from tests.helpers.logging_hop import Exchange, running_hop
from tests.helpers.proxy import client_for, close_clients, finish, manifest, proxy_config, pull
from tests.helpers.vllm_server import VllmServer
from worker.proxy.app import ProxyApp
from worker.proxy.exact.text import ExactText, index_entry, match_parent, prompt_text, spell_ids
from worker.proxy.serve import running_server

ENGINES = ["simulated", pytest.param("vllm", marks=pytest.mark.vllm)]
STOPS = ["e", "t", "a", "o"]


@pytest.fixture(autouse=True)
def _clients() -> Iterator[None]:
    yield
    close_clients()


# --- the rule (pure) ---------------------------------------------------------------


def _remember(index: dict[bytes, bytes], call: ExactText, served: str) -> None:
    field, value = index_entry(call, served)
    index[field.encode()] = value


@given(st.lists(st.text(min_size=0, max_size=6), min_size=2, max_size=8))
def test_a_chain_of_prompts_resolves_to_its_deepest_ancestor(pieces: list[str]) -> None:
    """Prompt, served, suffix, served, ...: every prompt of the chain continues the call just before it."""
    index: dict[bytes, bytes] = {}
    text = "p:" + pieces[0]
    call = match_parent(ExactText("t", text), index)
    assert call.parent_segments == () and call.items() == [{"role": "user", "content": text}]
    for depth, served in enumerate(pieces[1:], start=1):
        _remember(index, call, served)
        suffix = f"|{depth}|"
        child = match_parent(ExactText("t", call.text + served + suffix), index)
        assert child.parent_length == len(call.text + served) and child.suffix == suffix
        items = child.items()
        assert [item["role"] for item in items][-2:] == ["assistant", "user"]
        assert "".join(item["content"] for item in items) == child.text
        call = child


@given(st.text(max_size=6), st.text(max_size=6), st.text(min_size=1, max_size=3), st.text(max_size=6))
def test_a_remembered_stop_string_is_not_in_the_suffix_and_leaves_the_items_alone(
    prompt: str, served: str, stop: str, more: str
) -> None:
    call = ExactText("t", "p:" + prompt)
    index: dict[bytes, bytes] = {}
    for entry in (index_entry(call, served), index_entry(call, served, stop)):
        index[entry[0].encode()] = entry[1]
    child = match_parent(ExactText("t", call.text + served + stop + more), index)
    assert child.suffix == more  # the stop string is in the parent's ids: never tokenized again
    plain = ExactText("t", child.text, (("u", len(call.text)), ("a", len(served))))
    assert child.items() == plain.items()  # what the gate resolves the parent from is unchanged


def test_what_is_not_an_exact_prefix_stays_a_root() -> None:
    index: dict[bytes, bytes] = {}
    root = ExactText("t", "hello")
    _remember(index, root, " world")
    assert match_parent(ExactText("t", "hello worl"), index).parent_segments == ()  # shorter than the text
    assert match_parent(ExactText("t", "hello World!"), index).parent_segments == ()  # differs
    assert match_parent(ExactText("i", "1,2,"), index).parent_segments == ()  # another kind
    bad = {b"t11:" + b"0" * 64: b"[]", b"tx:abc": b"[]", next(iter(index)): b"not json"}
    assert match_parent(ExactText("t", "hello world!"), bad).parent_segments == ()  # malformed entries are ignored
    assert prompt_text({"not": "a prompt"}) is None and prompt_text([]) is None


def test_token_id_prompts_chain_on_ids() -> None:
    index: dict[bytes, bytes] = {}
    root = prompt_text([5, 6])
    assert root is not None and root.items() == [{"role": "user", "content": "token_ids:5,6"}]
    _remember(index, root, spell_ids([7, 8]))
    child = match_parent(ExactText("i", spell_ids([5, 6, 7, 8, 9])), index)
    assert child.items() == [
        {"role": "user", "content": "token_ids:5,6"},
        {"role": "assistant", "content": "token_ids:7,8"},
        {"role": "user", "content": "token_ids:9"},
    ]
    assert match_parent(ExactText("i", spell_ids([5, 6, 7, 80])), index).parent_segments == ()


# --- through the proxy ----------------------------------------------------------------


def _engine(kind: str, request: pytest.FixtureRequest, stack: ExitStack) -> tuple[str, str, dict[str, float]]:
    """The engine's URL, model and the logit bias keeping specials out of the tiny model's text."""
    if kind == "simulated":
        app = EngineApp(EngineOptions(seed=7, scale_out=True, max_model_len=2048))
        return stack.enter_context(running_server(app)), "simulated", {}
    server: VllmServer = request.getfixturevalue("vllm_chatml")
    hidden = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>")
    return server.url, server.model, {str(server.id_of(token)): -100.0 for token in hidden}


def _agent(base: str, rollout_id: str, model: str, bias: dict[str, float], turns: int) -> tuple[list[str], str]:
    """A ReAct-style completions agent: each prompt is the last prompt, the text it got, then an observation."""
    client = client_for(base, rollout_id)
    prompt, prompts, last_id = "Question: go\n", [], ""
    for turn in range(turns):
        prompts.append(prompt)
        extra: dict[str, Any] = {"logit_bias": bias} if bias else {}
        completion = client.completions.create(
            model=model, prompt=prompt, max_tokens=24, seed=turn, stop=STOPS, extra_body=extra
        )
        last_id = completion.id
        prompt = prompt + completion.choices[0].text + f"\nObservation {turn}\n"
    return prompts, last_id


def _run(kind: str, redis_url: str, request: pytest.FixtureRequest, **settings: Any) -> tuple[
    PulledRollout, list[Generated], list[Exchange]
]:
    rollout_id = f"completions-{kind}-{settings.get('prefix_mode', 'auto')}"
    with ExitStack() as stack:
        url, model, bias = _engine(kind, request, stack)
        hop, hop_url = stack.enter_context(running_hop(url))
        base = stack.enter_context(running_server(ProxyApp(proxy_config(redis_url, hop_url, **settings))))
        _, last_id = _agent(base, rollout_id, model, bias, 3)
        finish(base, rollout_id, 1.0, last_id)
        records = manifest(redis_url, rollout_id).records
        exchanges = hop.on("/v1/completions")
        engine_answers = generations(hop)
    [pulled] = pull(redis_url, 1)
    if settings.get("prefix_mode") != "verify":
        assert [r.parent_call_id is None for r in records] == [True, False, False]
        assert [r.parent_call_id for r in records[1:]] == [r.model_call_id for r in records[:2]]
    return pulled, engine_answers, exchanges


@pytest.mark.parametrize("kind", ENGINES)
def test_multi_turn_completions_with_stop_strings_train_exactly(
    kind: str, scenario_redis_url: str, request: pytest.FixtureRequest
) -> None:
    pulled, engine_answers, exchanges = _run(kind, scenario_redis_url, request, prefix_mode="exact")
    assert pulled.row is not None, f"{pulled.skip_code}: {pulled.skip_reason}"
    assert len(pulled.row.model_call_ids) == 3
    assert_row_is_exact(pulled.row, engine_answers)
    # The stop strings did fire (the token that completed one is in the ids, not in the text the agent saw) ...
    stopped = [x.response_json()["choices"][0] for x in exchanges]
    assert any(choice.get("stop_reason") in STOPS for choice in stopped)
    # ... and every continuation went to the engine as token ids starting with its parent's exact sequence.
    prompts = [x.request_json()["prompt"] for x in exchanges]
    assert isinstance(prompts[0], str) and all(isinstance(p, list) for p in prompts[1:])
    for parent, child in itertools.pairwise(engine_answers):
        assert child.prompt[: len(parent.sequence)] == parent.sequence


def test_verify_mode_keeps_completions_roots(scenario_redis_url: str, request: pytest.FixtureRequest) -> None:
    """Verify mode is unchanged: every completions call is a root (the text prompt goes to the engine as text)."""
    pulled, _, exchanges = _run("simulated", scenario_redis_url, request, prefix_mode="verify")
    assert all(isinstance(x.request_json()["prompt"], str) for x in exchanges)
    assert pulled.row is None or len(pulled.row.model_call_ids) == 1


@pytest.mark.parametrize("kind", ENGINES)
def test_a_stop_string_the_agent_appends_reaches_the_engine_once(
    kind: str, scenario_redis_url: str, request: pytest.FixtureRequest
) -> None:
    """A ReAct agent appends the stop string that ended each reply ("Observation:" in real agents) before its next
    observation: the parent's ids already hold it, so the engine must not see it twice."""
    rollout_id = f"react-stop-{kind}"
    with ExitStack() as stack:
        url, model, bias = _engine(kind, request, stack)
        hop, hop_url = stack.enter_context(running_hop(url))
        base = stack.enter_context(running_server(ProxyApp(proxy_config(scenario_redis_url, hop_url))))
        client = client_for(base, rollout_id)
        prompt, last_id, stops = "Question: go\n", "", []
        for turn in range(3):
            extra: dict[str, Any] = {"logit_bias": bias} if bias else {}
            completion = client.completions.create(
                model=model, prompt=prompt, max_tokens=24, seed=turn, stop=STOPS, extra_body=extra
            )
            stop = (completion.choices[0].model_extra or {}).get("stop_reason")
            stops.append(stop)
            last_id = completion.id
            prompt = prompt + completion.choices[0].text + (stop if isinstance(stop, str) else "") + f"\nObs {turn}\n"
        finish(base, rollout_id, 1.0, last_id)
        engine_answers = generations(hop)
        newline = _newline_id(kind, url, request)
    assert any(isinstance(stop, str) for stop in stops[:2]), "no stop string fired: the case tests nothing"
    for parent, child in itertools.pairwise(engine_answers):
        assert child.prompt[: len(parent.sequence)] == parent.sequence
        assert child.prompt[len(parent.sequence)] == newline, "the stop string was sent again after the parent's ids"
    [pulled] = pull(scenario_redis_url, 1)
    assert pulled.row is not None and len(pulled.row.model_call_ids) == 3, pulled.skip_reason
    assert_row_is_exact(pulled.row, engine_answers)


def _newline_id(kind: str, url: str, request: pytest.FixtureRequest) -> int:
    if kind == "vllm":
        server: VllmServer = request.getfixturevalue("vllm_chatml")
        return server.id_of("\n")
    answer = httpx.post(f"{url}/tokenize", json={"prompt": "\n", "add_special_tokens": False}, timeout=20)
    [token] = answer.json()["tokens"]
    return int(token)
