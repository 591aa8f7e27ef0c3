"""The OpenAI-shape adapters (vLLM completions, NeMo Gym message-level fields on chat and Responses items) and the
proxy's request/response rewriting: exact extraction, and a typed EnginePayloadError naming the field."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from sink.errors import StagingError
from worker.errors import EnginePayloadError
from worker.openai_adapters import (
    NemoGymChatAdapter,
    NemoGymResponsesAdapter,
    OpenAIChatAdapter,
    VLLMCompletionAdapter,
    ids_from_token_strings,
)
from worker.proxy.routes import (
    ClientAsked,
    parse_target,
    request_items,
    response_items,
    strip_token_fields,
    upstream_request,
)

COMPLETION: dict[str, Any] = {
    "id": "cmpl-1",
    "choices": [
        {
            "index": 0,
            "text": "ab",
            "prompt_token_ids": [1, 2, 3],
            "token_ids": [7, 8],
            "logprobs": {"tokens": ["token_id:7", "token_id:8"], "token_logprobs": [-0.5, -1], "top_logprobs": None},
        }
    ],
}
GYM_MESSAGE: dict[str, Any] = {
    "role": "assistant",
    "content": "ab",
    "prompt_token_ids": [1, 2],
    "generation_token_ids": ["token_id:7", "token_id:8"],
    "generation_log_probs": [-0.25, -0.5],
    "routed_experts": [[[1, 2]], [[3, 4]]],
}
GYM_CHAT: dict[str, Any] = {"id": "c", "choices": [{"index": 0, "message": GYM_MESSAGE, "finish_reason": "stop"}]}
GYM_RESPONSE: dict[str, Any] = {
    "id": "r",
    "output": [{"type": "reasoning", "summary": []}, {"type": "message", "role": "assistant", **GYM_MESSAGE}],
}


def test_vllm_completion_extraction() -> None:
    adapter = VLLMCompletionAdapter()
    assert adapter.extract_prompt_ids(COMPLETION) == [1, 2, 3]
    assert adapter.extract_generation(COMPLETION) == ([7, 8], [-0.5, -1.0])
    without_ids = copy.deepcopy(COMPLETION)
    del without_ids["choices"][0]["token_ids"]
    without_ids["prompt_token_ids"] = [9]  # top level wins when present
    assert adapter.extract_generation(without_ids)[0] == [7, 8]
    assert adapter.extract_prompt_ids(without_ids) == [9]
    assert adapter.extract_extras(COMPLETION) is None


def test_nemo_gym_chat_and_responses_extraction() -> None:
    for adapter, payload in ((NemoGymChatAdapter(), GYM_CHAT), (NemoGymResponsesAdapter(), GYM_RESPONSE)):
        assert adapter.extract_prompt_ids(payload) == [1, 2]
        assert adapter.extract_generation(payload) == ([7, 8], [-0.25, -0.5])
        assert adapter.extract_extras(payload) == {"routed_experts": [[[1, 2]], [[3, 4]]]}
    chat = OpenAIChatAdapter()
    assert chat.extract_generation(GYM_CHAT) == ([7, 8], [-0.25, -0.5])


def _with(payload: dict[str, Any], path: tuple[Any, ...], value: Any) -> dict[str, Any]:
    changed = copy.deepcopy(payload)
    target: Any = changed
    for key in path[:-1]:
        target = target[key]
    if value is KeyError:
        del target[path[-1]]
    else:
        target[path[-1]] = value
    return changed


MESSAGE = ("choices", 0, "message")


@pytest.mark.parametrize(
    ("adapter", "payload", "field"),
    [
        (VLLMCompletionAdapter(), _with(COMPLETION, ("choices", 0, "prompt_token_ids"), [1, True]), "prompt_token_ids"),
        (VLLMCompletionAdapter(), _with(COMPLETION, ("choices", 0, "logprobs"), None), "logprobs"),
        (VLLMCompletionAdapter(), _with(COMPLETION, ("choices", 0, "token_ids"), [7]), "2 log-probabilities"),
        (VLLMCompletionAdapter(), _with(COMPLETION, ("choices",), []), "exactly one choice"),
        (NemoGymChatAdapter(), _with(GYM_CHAT, (*MESSAGE, "generation_token_ids"), ["7", 8]), "token_id:<n>"),
        (NemoGymChatAdapter(), _with(GYM_CHAT, (*MESSAGE, "generation_log_probs"), [-1, "x"]), "log_probs"),
        (NemoGymChatAdapter(), _with(GYM_CHAT, (*MESSAGE, "prompt_token_ids"), KeyError), "prompt_token_ids"),
        (NemoGymChatAdapter(), _with(GYM_CHAT, (*MESSAGE, "generation_log_probs"), [-1.0]), "1 log-probabilities"),
        (NemoGymResponsesAdapter(), _with(GYM_RESPONSE, ("output",), []), "got 0"),
        (NemoGymResponsesAdapter(), _with(GYM_RESPONSE, ("output", 1, "generation_token_ids"), "7"), "list"),
        (
            OpenAIChatAdapter(),
            {"prompt_token_ids": [1], "choices": [{"message": {"content": "a"}, "logprobs": None}]},
            "logprobs",
        ),
        (OpenAIChatAdapter(), {"prompt_token_ids": [1], "choices": "nope"}, "choices must be a list"),
    ],
)
def test_malformed_payloads_raise_a_typed_error(adapter: Any, payload: dict[str, Any], field: str) -> None:
    with pytest.raises(EnginePayloadError, match=field) as raised:
        adapter.extract_prompt_ids(payload)
        adapter.extract_generation(payload)
    assert isinstance(raised.value, StagingError) and isinstance(raised.value, ValueError)


def test_token_strings() -> None:
    assert ids_from_token_strings(["token_id:0", 5, "token_id:12"], "t") == [0, 5, 12]
    for bad in (["token_id:-1"], ["token_id:"], ["token_id:１"], [True], [-1], "token_id:1"):
        with pytest.raises(EnginePayloadError):
            ids_from_token_strings(bad, "t")


def test_upstream_request_asks_for_ids_and_strips_what_the_client_did_not_ask() -> None:
    request = {
        "messages": [{"role": "user", "content": "x"}],
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    body, asked = upstream_request("chat", request, "vllm", [1, 2])
    assert body["return_token_ids"] is True and body["logprobs"] is True and body["top_logprobs"] == 0
    assert body["return_tokens_as_token_ids"] is True and "stream" not in body and "stream_options" not in body
    assert "required_prefix_token_ids" not in body and asked == ClientAsked(token_ids=False, logprobs=False)
    assert request["stream"] is True  # the client's request is not modified
    body, _ = upstream_request("chat", request, "nemo-rl", [1, 2])
    assert body["required_prefix_token_ids"] == [1, 2]
    body, _ = upstream_request("completions", {"prompt": [1], "logprobs": 2}, "vllm", [])
    assert body["logprobs"] == 2 and "return_tokens_as_token_ids" not in body

    payload = copy.deepcopy(GYM_CHAT)
    payload["prompt_token_ids"] = [1]
    payload["choices"][0].update(token_ids=[7], logprobs={"content": []})
    assert strip_token_fields("chat", payload, ClientAsked(token_ids=False, logprobs=False)) is True
    assert payload["prompt_token_ids"] is None and payload["choices"][0]["logprobs"] is None
    assert set(payload["choices"][0]["message"]) == {"role", "content"}
    kept = copy.deepcopy(GYM_CHAT)
    strip_token_fields("chat", kept, ClientAsked(token_ids=True, logprobs=True))
    assert kept["choices"][0]["message"]["generation_token_ids"] == ["token_id:7", "token_id:8"]
    assert response_items("chat", copy.deepcopy(GYM_CHAT)) == [{"role": "assistant", "content": "ab"}]
    responses = copy.deepcopy(GYM_RESPONSE)
    assert strip_token_fields("responses", responses, ClientAsked(False, False)) is True
    assert "generation_token_ids" not in responses["output"][1]


def test_request_items_and_targets() -> None:
    assert request_items("responses", {"input": "hi"}) == [{"role": "user", "content": "hi"}]
    assert request_items("completions", {"prompt": [1, 2]}) == [{"role": "user", "content": "token_ids:1,2"}]
    for route, bad in (("chat", {"messages": "x"}), ("completions", {"prompt": [1.0]}), ("responses", {"input": [1]})):
        with pytest.raises(EnginePayloadError):
            request_items(route, bad)  # type: ignore[arg-type]
    assert parse_target("/r/abc/v1/chat/completions", None) == parse_target("/v1/chat/completions", "abc").__class__(
        "abc", "/v1/chat/completions"
    )
    assert parse_target("/r/abc/finished", None).finished
    assert parse_target("/v1/models", None).rollout_id is None
    with pytest.raises(ValueError, match="Invalid rollout id"):
        parse_target("/r/a b/v1/models", None)
