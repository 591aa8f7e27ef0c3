"""Multi-chain rollouts through the capture proxy (contract §14): compaction, a sub-agent, deliberate branching
and a poisoned chain next to a healthy one come out as one exact row per chain.

Real parts only: the official openai client -> proxy (uvicorn) -> simulated HTTP engine (uvicorn) -> Redis, then
the assembler and the trainer reader.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from sink.trainer.pulled import PulledRollout
from sink_tools.simulated.http_app import EngineApp
from sink_tools.simulated.options import EngineOptions
from tests.helpers.proxy import SYSTEM, client_for, close_clients, expected_ids, manifest, proxy_config, pull
from tests.helpers.tls import tls
from worker.proxy.app import ProxyApp
from worker.proxy.serve import running_server

Messages = list[dict[str, Any]]


@pytest.fixture(autouse=True)
def _clients() -> Iterator[None]:
    yield
    close_clients()


@pytest.fixture
def engine() -> Iterator[tuple[EngineApp, str]]:
    app = EngineApp(EngineOptions(seed=11))
    with running_server(app) as url:
        yield app, url


def _chat(base: str, rollout_id: str, messages: Messages, headers: dict[str, str] | None = None) -> Messages:
    """One call; returns *messages* with the assistant reply appended (and its response id in ``_id``)."""
    client = client_for(base, rollout_id)
    completion = client.chat.completions.create(
        model="simulated",
        messages=messages,  # type: ignore[arg-type]
        max_tokens=10,
        extra_body={"min_tokens": 3},
        extra_headers=headers or {},
    )
    return [*messages, {"role": "assistant", "content": completion.choices[0].message.content, "_id": completion.id}]


def _clean(messages: Messages) -> Messages:
    return [{key: value for key, value in item.items() if key != "_id"} for item in messages]


def _tool(messages: Messages, text: str) -> Messages:
    return [*_clean(messages), {"role": "tool", "content": text, "tool_call_id": "t"}]


def _finish(base: str, rollout_id: str, response_id: str) -> None:
    body = {"reward": 0.75, "declared_response_id": response_id}
    answer = httpx.post(f"{base}/r/{rollout_id}/finished", json=body, verify=tls())
    assert answer.status_code == 200, answer.text


def _assert_exact(app: EngineApp, pulled: PulledRollout, conversations: list[Messages]) -> None:
    """Every delivered row is the engine's exact sequence of its chain, in chain order; never two chains mixed."""
    assert pulled.row is None and pulled.chains is not None
    assert [row.chain_index for row in pulled.rows] == list(range(len(conversations))), pulled.chain_skips
    for row, conversation in zip(pulled.rows, conversations, strict=True):
        assert row.rollout_id == pulled.rollout_id
        assert list(row.token_ids) == expected_ids(app, _clean(conversation))
        # Trained tokens: the replies of this chain's own calls (the last one keeps its response id; earlier
        # ones are the assistant messages its row carries with mask 1, one per call), each with its end token.
        replies = [item for item in conversation if item["role"] == "assistant"][-len(row.model_call_ids) :]
        assert sum(row.token_mask) == sum(len(app.engine.tokenizer.encode(m["content"])) + 1 for m in replies)
        assert all(lp == 0.0 for lp, mask in zip(row.logprobs, row.token_mask, strict=True) if mask == 0.0)
        assert any(lp != 0.0 for lp in row.logprobs)


def test_compaction_opted_in_by_header_yields_one_row_per_chain(redis_url: str, engine: tuple[EngineApp, str]) -> None:
    app, upstream = engine
    opt_in = {"X-Staging-Chains": "roots"}
    with running_server(ProxyApp(proxy_config(redis_url, upstream))) as proxy:
        first = _chat(proxy, "compact-1", [SYSTEM, {"role": "user", "content": "long task"}], opt_in)
        first = _chat(proxy, "compact-1", _tool(first, "result one"), opt_in)
        # The agent compacts: its own earlier turns are rewritten as a summary it keeps as an assistant message.
        compacted: Messages = [
            SYSTEM,
            {"role": "user", "content": "long task (compacted)"},
            {"role": "assistant", "content": "summary of the work so far"},
            {"role": "tool", "content": "result one", "tool_call_id": "t"},
        ]
        second = _chat(proxy, "compact-1", compacted, opt_in)
        second = _chat(proxy, "compact-1", _tool(second, "result two"), opt_in)
        _finish(proxy, "compact-1", second[-1]["_id"])
    shown = manifest(redis_url, "compact-1")
    assert not shown.failures and len(shown.records) == 4
    assert [row.parent_call_id is None for row in shown.records] == [True, False, True, False]
    [pulled] = pull(redis_url, 1)
    assert pulled.receipt.capture_poisoned is False  # the seed receipt stays valid (one chain, as before)
    _assert_exact(app, pulled, [first, second])
    assert pulled.chains is not None
    assert [chain.selection for chain in pulled.chains.chains] == ["heuristic", "declared"]
    assert all(row.weight_versions for row in pulled.rows)


def test_without_opt_in_compaction_still_poisons_the_rollout(redis_url: str, engine: tuple[EngineApp, str]) -> None:
    _, upstream = engine
    with running_server(ProxyApp(proxy_config(redis_url, upstream))) as proxy:
        first = _chat(proxy, "compact-0", [SYSTEM, {"role": "user", "content": "long task"}])
        compacted: Messages = [SYSTEM, {"role": "assistant", "content": "rewritten"}, *_tool(first, "r")[2:]]
        _chat(proxy, "compact-0", compacted)
        _finish(proxy, "compact-0", first[-1]["_id"])
    [pulled] = pull(redis_url, 1)
    assert pulled.chains is None and pulled.skip_code == "rollout_failed"
    assert pulled.skip_reason == "unresolved_parent"


def test_sub_agent_needs_no_client_change_with_a_namespace_policy(
    redis_url: str, engine: tuple[EngineApp, str]
) -> None:
    app, upstream = engine
    with running_server(ProxyApp(proxy_config(redis_url, upstream, chain_policy="roots"))) as proxy:
        planner = _chat(proxy, "sub-1", [SYSTEM, {"role": "user", "content": "plan the job"}])
        worker = _chat(
            proxy,
            "sub-1",
            [{"role": "system", "content": "You are a worker."}, {"role": "user", "content": "do step 1"}],
        )
        worker = _chat(proxy, "sub-1", _tool(worker, "step output"))
        planner = _chat(proxy, "sub-1", _tool(planner, f"worker said: {worker[-1]['content']}"))
        _finish(proxy, "sub-1", planner[-1]["_id"])
    [pulled] = pull(redis_url, 1)
    _assert_exact(app, pulled, [planner, worker])
    assert pulled.receipt.reward == 0.75 and all(row.rollout_id == "sub-1" for row in pulled.rows)


def test_deliberate_branches_each_train(redis_url: str, engine: tuple[EngineApp, str]) -> None:
    app, upstream = engine
    with running_server(ProxyApp(proxy_config(redis_url, upstream, chain_policy="branches"))) as proxy:
        trunk = _chat(proxy, "branch-1", [SYSTEM, {"role": "user", "content": "solve it"}])
        left = _chat(proxy, "branch-1", [*_clean(trunk), {"role": "user", "content": "try approach A"}])
        right = _chat(proxy, "branch-1", [*_clean(trunk), {"role": "user", "content": "try approach B"}])
        _finish(proxy, "branch-1", right[-1]["_id"])
    [pulled] = pull(redis_url, 1)
    _assert_exact(app, pulled, [left, right])
    first, second = pulled.rows
    assert first.model_call_ids[0] == second.model_call_ids[0]  # the shared trunk, in each branch's row


def test_poisoned_chain_is_skipped_while_the_healthy_one_trains(redis_url: str) -> None:
    drifting, clean = EngineApp(EngineOptions(seed=5, drift=True)), EngineApp(EngineOptions(seed=5))
    with (
        running_server(drifting) as drift_url,
        running_server(clean) as clean_url,
        running_server(ProxyApp(proxy_config(redis_url, drift_url, chain_policy="roots"))) as planner_proxy,
        running_server(ProxyApp(proxy_config(redis_url, clean_url, chain_policy="roots"))) as worker_proxy,
    ):
        planner = _chat(planner_proxy, "mixed-1", [SYSTEM, {"role": "user", "content": "plan with many words"}])
        worker = _chat(
            worker_proxy, "mixed-1", [{"role": "system", "content": "worker"}, {"role": "user", "content": "go"}]
        )
        worker = _chat(worker_proxy, "mixed-1", _tool(worker, "out"))
        planner = _chat(planner_proxy, "mixed-1", _tool(planner, "the worker is done"))  # drifts: capture failure
        _finish(planner_proxy, "mixed-1", worker[-1]["_id"])
    shown = manifest(redis_url, "mixed-1")
    assert [failure.reason for failure in shown.failures] == ["worker_capture_failed"]
    [pulled] = pull(redis_url, 1)
    assert pulled.trainable and pulled.receipt.capture_poisoned is True  # the seed view stays conservative
    [row] = pulled.rows
    assert row.chain_index == 1 and list(row.token_ids) == expected_ids(clean, _clean(worker))
    [skip] = pulled.chain_skips
    assert (skip.chain_index, skip.skip_code, skip.skip_reason) == (0, "rollout_failed", "worker_capture_failed")


def test_invalid_chain_header_is_refused(redis_url: str, engine: tuple[EngineApp, str]) -> None:
    _, upstream = engine
    with running_server(ProxyApp(proxy_config(redis_url, upstream))) as proxy:
        answer = httpx.post(
            f"{proxy}/r/bad-header/v1/chat/completions",
            json={"model": "simulated", "messages": [SYSTEM]},
            headers={"X-Staging-Chains": "everything"},
        )
    assert answer.status_code == 400 and "X-Staging-Chains" in answer.text


def test_a_rollout_keeps_the_first_chain_policy_it_recorded(redis_url: str, engine: tuple[EngineApp, str]) -> None:
    """The rollout opts into roots once: later calls without the header, or with another value (single, branches),
    follow the recorded policy (contract §14.1: the first recorded policy wins) and poison nothing."""
    app, upstream = engine
    with (
        running_server(ProxyApp(proxy_config(redis_url, upstream))) as proxy,
        running_server(ProxyApp(proxy_config(redis_url, upstream))) as other_proxy,  # a gate that recorded nothing
    ):
        first = _chat(proxy, "keep-1", [SYSTEM, {"role": "user", "content": "long task"}], {"X-Staging-Chains": "roots"})
        first = _chat(proxy, "keep-1", _tool(first, "result one"))
        second = _chat(  # compacted, no header: a new root, as the recorded policy says
            other_proxy,
            "keep-1",
            [SYSTEM, {"role": "user", "content": "long task (compacted)"}, {"role": "assistant", "content": "so far"}],
        )
        third = _chat(  # compacted again, with a conflicting header: the recorded policy still decides
            other_proxy,
            "keep-1",
            [SYSTEM, {"role": "user", "content": "long task (again)"}, {"role": "assistant", "content": "lately"}],
            {"X-Staging-Chains": "single"},
        )
        third = _chat(other_proxy, "keep-1", _tool(third, "result three"), {"X-Staging-Chains": "branches"})
        _finish(proxy, "keep-1", third[-1]["_id"])
    shown = manifest(redis_url, "keep-1")
    assert not shown.failures and len(shown.records) == 5
    [pulled] = pull(redis_url, 1)
    assert pulled.chains is not None and pulled.chains.policy == "roots"
    _assert_exact(app, pulled, [first, second, third])
