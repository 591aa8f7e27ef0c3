"""What the capture proxy strips from an engine answer before the agent sees it, field by field, on engine-shaped
chat, completion and Responses bodies: every token field the client did not ask for goes (the sink's commit
coordinates always), what it asked for stays; and the route a bare ``/r/{id}`` forwards to."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from worker.proxy.routes import (
    ClientAsked,
    RouteKind,
    Target,
    parse_target,
    response_items,
    served_items,
    strip_token_fields,
)

NOTHING = ClientAsked(token_ids=False, logprobs=False)
EVERYTHING = ClientAsked(token_ids=True, logprobs=True)
TOKEN_FIELDS = {"prompt_token_ids": [1, 2], "generation_token_ids": [3], "generation_log_probs": [-0.5]}


def _chat() -> dict[str, Any]:
    return {
        "id": "chatcmpl-1",
        "prompt_token_ids": [1, 2],
        "ng_commit_coords": {"staging_key": "r/c0"},
        "choices": [
            "not a choice",  # an engine oddity: skipped, the next choice is still stripped
            {
                "index": 0,
                "message": {"role": "assistant", "content": "hi", **TOKEN_FIELDS, "routed_experts": [[0]]},
                "token_ids": [3],
                "prompt_token_ids": [1, 2],
                "logprobs": {"content": [{"token": "token_id:3", "logprob": -0.5}]},
            },
        ],
    }


def _stripped(route: RouteKind, payload: dict[str, Any], asked: ClientAsked) -> dict[str, Any]:
    """*payload* once stripped, checking that the strip reports a change exactly when it made one."""
    before = copy.deepcopy(payload)
    changed = strip_token_fields(route, payload, asked)
    assert changed is (payload != before)
    return payload


def test_a_chat_answer_loses_every_token_field_the_client_did_not_ask_for() -> None:
    stripped = _stripped("chat", _chat(), NOTHING)
    assert stripped == {
        "id": "chatcmpl-1",
        "prompt_token_ids": None,  # vLLM's key without return_token_ids: null, as vLLM answers
        "choices": [
            "not a choice",
            {
                "index": 0,
                "message": {"role": "assistant", "content": "hi"},  # NeMo Gym's message fields: removed
                "token_ids": None,
                "prompt_token_ids": None,
                "logprobs": None,
            },
        ],
    }


def test_what_the_client_asked_for_stays_and_the_coordinates_always_go() -> None:
    expected = _chat()
    del expected["ng_commit_coords"]
    assert _stripped("chat", _chat(), EVERYTHING) == expected
    only_logprobs = _stripped("chat", _chat(), ClientAsked(token_ids=False, logprobs=True))
    assert only_logprobs["choices"][1]["logprobs"] == {"content": [{"token": "token_id:3", "logprob": -0.5}]}
    assert only_logprobs["choices"][1]["token_ids"] is None and only_logprobs["prompt_token_ids"] is None
    # A choice without logprobs does not gain the field.
    assert "logprobs" not in _stripped("completions", {"choices": [{"text": "x"}]}, NOTHING)["choices"][0]


@pytest.mark.parametrize("route", ["chat", "completions", "responses"])
def test_an_answer_holding_only_fields_the_client_asked_for_is_left_as_it_came(route: RouteKind) -> None:
    """Nothing to strip (no coordinates, every token field asked for, or null as vLLM writes it unasked): the strip
    reports no change, so the proxy serves the engine's own bytes."""
    answers: dict[str, dict[str, Any]] = {
        "chat": {k: v for k, v in _chat().items() if k != "ng_commit_coords"},
        "completions": {"prompt_token_ids": None, "choices": [{"text": "x", "token_ids": None, "logprobs": None}]},
        "responses": {"output": [{"type": "message", "content": [], **TOKEN_FIELDS}]},
    }
    asked = NOTHING if route == "completions" else EVERYTHING
    payload = answers[route]
    before = copy.deepcopy(payload)
    assert strip_token_fields(route, payload, asked) is False
    assert payload == before


def test_responses_items_keep_their_token_fields_only_when_asked() -> None:
    def answer() -> dict[str, Any]:
        return {"ng_commit_coords": {}, "output": [{"type": "message", "content": [], **TOKEN_FIELDS}, "odd"]}

    assert _stripped("responses", answer(), NOTHING) == {"output": [{"type": "message", "content": []}, "odd"]}
    kept = _stripped("responses", answer(), ClientAsked(token_ids=True, logprobs=False))
    assert kept == {"output": [{"type": "message", "content": [], **TOKEN_FIELDS}, "odd"]}


@pytest.mark.parametrize("asked", [NOTHING, EVERYTHING, ClientAsked(token_ids=False, logprobs=True)], ids=str)
@pytest.mark.parametrize("route", ["chat", "completions", "responses"])
def test_the_served_items_are_known_before_the_answer_is_stripped(route: RouteKind, asked: ClientAsked) -> None:
    """The gate's row, sent behind the stage before the answer is stripped, fingerprints the items as served."""
    chat = _chat()
    chat["choices"] = chat["choices"][1:]  # the first choice is the one the gate reads
    payloads: dict[str, dict[str, Any]] = {
        "chat": chat,
        "completions": {"choices": [{"text": "x", "token_ids": [3], "logprobs": {"tokens": ["x"]}}]},
        "responses": {"output": [{"type": "message", "role": "assistant", "content": [], **TOKEN_FIELDS}, "odd"]},
    }
    payload = payloads[route]
    before = copy.deepcopy(payload)
    served = served_items(route, payload, asked)
    assert payload == before, "served_items changed the answer"
    assert served == response_items(route, _stripped(route, copy.deepcopy(payload), asked))
    assert served  # every route serves one item here


def test_a_bare_rollout_prefix_forwards_to_the_root() -> None:
    assert parse_target("/r/roll-1", None) == Target("roll-1", "/")
    assert parse_target("/r/roll-1/finished", None) == Target("roll-1", "/finished", finished=True)
    assert parse_target("/v1/models", "roll-2") == Target("roll-2", "/v1/models")
